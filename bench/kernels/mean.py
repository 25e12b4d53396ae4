"""Kernel `mean` of a BERT encoder layer (hidden 768, 12 heads, feed-forward 3072), written by bench/model_kernels.py."""
from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@T.prim_func(s_tir=True)
def mean(lv3: T.Buffer((T.int64(128), T.int64(3072)), "float32"), T_divide: T.Buffer((T.int64(128),), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    # with T.sblock("root"):
    lv3_red = T.sblock_alloc_buffer((T.int64(128),))
    for ax0, k1 in T.grid(T.int64(128), T.int64(3072)):
        with T.sblock("lv3_red"):
            v_ax0, v_k1 = T.axis.remap("SR", [ax0, k1])
            T.reads(lv3[v_ax0, v_k1])
            T.writes(lv3_red[v_ax0])
            with T.init():
                lv3_red[v_ax0] = T.float32(0.0)
            lv3_red[v_ax0] = lv3_red[v_ax0] + lv3[v_ax0, v_k1]
    for ax0 in range(T.int64(128)):
        with T.sblock("T_divide"):
            v_ax0 = T.axis.spatial(T.int64(128), ax0)
            T.reads(lv3_red[v_ax0])
            T.writes(T_divide[v_ax0])
            T_divide[v_ax0] = lv3_red[v_ax0] / T.float32(3072.0)