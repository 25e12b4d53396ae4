"""Kernel `layer_norm` of a BERT encoder layer (hidden 1024, 16 heads, feed-forward 4096), written by bench/model_kernels.py."""
from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@T.prim_func(s_tir=True)
def layer_norm(x: T.Buffer((T.int64(128), T.int64(1024)), "float32"), gamma: T.Buffer((T.int64(1024),), "float32"), beta: T.Buffer((T.int64(1024),), "float32"), T_layer_norm: T.Buffer((T.int64(128), T.int64(1024)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    # with T.sblock("root"):
    x_sum = T.sblock_alloc_buffer((T.int64(128),))
    x_mean = T.sblock_alloc_buffer((T.int64(128),))
    x_var_sum = T.sblock_alloc_buffer((T.int64(128),))
    for ax0, k1 in T.grid(T.int64(128), T.int64(1024)):
        with T.sblock("x_sum"):
            v_ax0, v_k1 = T.axis.remap("SR", [ax0, k1])
            T.reads(x[v_ax0, v_k1])
            T.writes(x_sum[v_ax0])
            with T.init():
                x_sum[v_ax0] = T.float32(0.0)
            x_sum[v_ax0] = x_sum[v_ax0] + x[v_ax0, v_k1]
    for ax0 in range(T.int64(128)):
        with T.sblock("x_mean"):
            v_ax0 = T.axis.spatial(T.int64(128), ax0)
            T.reads(x_sum[v_ax0])
            T.writes(x_mean[v_ax0])
            x_mean[v_ax0] = x_sum[v_ax0] / T.float32(1024.0)
    for ax0, k1 in T.grid(T.int64(128), T.int64(1024)):
        with T.sblock("x_var_sum"):
            v_ax0, v_k1 = T.axis.remap("SR", [ax0, k1])
            T.reads(x[v_ax0, v_k1], x_mean[v_ax0])
            T.writes(x_var_sum[v_ax0])
            with T.init():
                x_var_sum[v_ax0] = T.float32(0.0)
            x_var_sum[v_ax0] = x_var_sum[v_ax0] + (x[v_ax0, v_k1] - x_mean[v_ax0]) * (x[v_ax0, v_k1] - x_mean[v_ax0])
    for ax0, ax1 in T.grid(T.int64(128), T.int64(1024)):
        with T.sblock("T_layer_norm"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(x[v_ax0, v_ax1], x_mean[v_ax0], x_var_sum[v_ax0], gamma[v_ax1], beta[v_ax1])
            T.writes(T_layer_norm[v_ax0, v_ax1])
            T_layer_norm[v_ax0, v_ax1] = (x[v_ax0, v_ax1] - x_mean[v_ax0]) * T.rsqrt(x_var_sum[v_ax0] / T.float32(1024.0) + T.float32(1.0000000000000001e-05)) * gamma[v_ax1] + beta[v_ax1]