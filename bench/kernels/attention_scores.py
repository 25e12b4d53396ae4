"""Kernel `attention_scores` of a BERT encoder layer (hidden 768, 12 heads, feed-forward 3072), written by bench/model_kernels.py."""
from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@T.prim_func(s_tir=True)
def attention_scores(q: T.Buffer((T.int64(12), T.int64(128), T.int64(64)), "float32"), k: T.Buffer((T.int64(12), T.int64(64), T.int64(128)), "float32"), matmul: T.Buffer((T.int64(12), T.int64(128), T.int64(128)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    # with T.sblock("root"):
    for i0, i1, i2, k_1 in T.grid(T.int64(12), T.int64(128), T.int64(128), T.int64(64)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k_1])
            T.reads(q[v_i0, v_i1, v_k], k[v_i0, v_k, v_i2])
            T.writes(matmul[v_i0, v_i1, v_i2])
            with T.init():
                matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
            matmul[v_i0, v_i1, v_i2] = matmul[v_i0, v_i1, v_i2] + q[v_i0, v_i1, v_k] * k[v_i0, v_k, v_i2]