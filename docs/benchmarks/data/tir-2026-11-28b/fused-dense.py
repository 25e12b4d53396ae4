from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@T.prim_func(s_tir=True)
def fused_matmul_add_gelu(input: T.Buffer((T.int64(128), T.int64(768)), "float32"), lv: T.Buffer((T.int64(768), T.int64(3072)), "float32"), p_0_bias: T.Buffer((T.int64(3072),), "float32"), T_multiply_intermediate: T.Buffer((T.int64(128), T.int64(3072)), "float32")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    matmul_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    T_add_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    T_multiply = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    compute = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    T_multiply_1 = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    T_add = T.sblock_alloc_buffer((T.int64(128), T.int64(3072)))
    for i0, i1, k in T.grid(T.int64(128), T.int64(3072), T.int64(768)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(input[v_i0, v_k], lv[v_k, v_i1])
            T.writes(matmul_intermediate[v_i0, v_i1])
            with T.init():
                matmul_intermediate[v_i0, v_i1] = T.float32(0.0)
            matmul_intermediate[v_i0, v_i1] = matmul_intermediate[v_i0, v_i1] + input[v_i0, v_k] * lv[v_k, v_i1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("T_add"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(p_0_bias[v_ax1], matmul_intermediate[v_ax0, v_ax1])
            T.writes(T_add_intermediate[v_ax0, v_ax1])
            T_add_intermediate[v_ax0, v_ax1] = p_0_bias[v_ax1] + matmul_intermediate[v_ax0, v_ax1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("T_multiply"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_add_intermediate[v_ax0, v_ax1])
            T.writes(T_multiply[v_ax0, v_ax1])
            T_multiply[v_ax0, v_ax1] = T_add_intermediate[v_ax0, v_ax1] * T.float32(0.70710678118654757)
    for i0, i1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(T_multiply[v_i0, v_i1])
            T.writes(compute[v_i0, v_i1])
            compute[v_i0, v_i1] = T.erf(T_multiply[v_i0, v_i1])
    for ax0, ax1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("T_multiply_1"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(compute[v_ax0, v_ax1])
            T.writes(T_multiply_1[v_ax0, v_ax1])
            T_multiply_1[v_ax0, v_ax1] = compute[v_ax0, v_ax1] * T.float32(0.5)
    for ax0, ax1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("T_add1"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_multiply_1[v_ax0, v_ax1])
            T.writes(T_add[v_ax0, v_ax1])
            T_add[v_ax0, v_ax1] = T.float32(0.5) + T_multiply_1[v_ax0, v_ax1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("T_multiply_2"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_add_intermediate[v_ax0, v_ax1], T_add[v_ax0, v_ax1])
            T.writes(T_multiply_intermediate[v_ax0, v_ax1])
            T_multiply_intermediate[v_ax0, v_ax1] = T_add_intermediate[v_ax0, v_ax1] * T_add[v_ax0, v_ax1]