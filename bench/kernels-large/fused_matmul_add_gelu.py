"""Kernel `fused_matmul_add_gelu` of a BERT encoder layer (hidden 1024, 16 heads, feed-forward 4096), written by bench/model_kernels.py."""
from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@T.prim_func(s_tir=True)
def fused_matmul_add_gelu(lv: T.Buffer((T.int64(128), T.int64(1024)), "float32"), w1: T.Buffer((T.int64(1024), T.int64(4096)), "float32"), b1: T.Buffer((T.int64(4096),), "float32"), T_multiply_intermediate: T.Buffer((T.int64(128), T.int64(4096)), "float32")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    matmul_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    T_add_intermediate = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    T_multiply = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    compute = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    T_multiply_1 = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    T_add = T.sblock_alloc_buffer((T.int64(128), T.int64(4096)))
    for i0, i1, k in T.grid(T.int64(128), T.int64(4096), T.int64(1024)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(lv[v_i0, v_k], w1[v_k, v_i1])
            T.writes(matmul_intermediate[v_i0, v_i1])
            with T.init():
                matmul_intermediate[v_i0, v_i1] = T.float32(0.0)
            matmul_intermediate[v_i0, v_i1] = matmul_intermediate[v_i0, v_i1] + lv[v_i0, v_k] * w1[v_k, v_i1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("T_add"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(matmul_intermediate[v_ax0, v_ax1], b1[v_ax1])
            T.writes(T_add_intermediate[v_ax0, v_ax1])
            T_add_intermediate[v_ax0, v_ax1] = matmul_intermediate[v_ax0, v_ax1] + b1[v_ax1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("T_multiply"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_add_intermediate[v_ax0, v_ax1])
            T.writes(T_multiply[v_ax0, v_ax1])
            T_multiply[v_ax0, v_ax1] = T_add_intermediate[v_ax0, v_ax1] * T.float32(0.70710678118654757)
    for i0, i1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(T_multiply[v_i0, v_i1])
            T.writes(compute[v_i0, v_i1])
            compute[v_i0, v_i1] = T.erf(T_multiply[v_i0, v_i1])
    for ax0, ax1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("T_multiply_1"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(compute[v_ax0, v_ax1])
            T.writes(T_multiply_1[v_ax0, v_ax1])
            T_multiply_1[v_ax0, v_ax1] = compute[v_ax0, v_ax1] * T.float32(0.5)
    for ax0, ax1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("T_add1"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_multiply_1[v_ax0, v_ax1])
            T.writes(T_add[v_ax0, v_ax1])
            T_add[v_ax0, v_ax1] = T.float32(0.5) + T_multiply_1[v_ax0, v_ax1]
    for ax0, ax1 in T.grid(T.int64(128), T.int64(4096)):
        with T.sblock("T_multiply_2"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_add_intermediate[v_ax0, v_ax1], T_add[v_ax0, v_ax1])
            T.writes(T_multiply_intermediate[v_ax0, v_ax1])
            T_multiply_intermediate[v_ax0, v_ax1] = T_add_intermediate[v_ax0, v_ax1] * T_add[v_ax0, v_ax1]