"""Half-precision PyTorch models through TVM's PyTorch frontend (`from_exported_program`).

TVM 0.27's converters of convolutions, `linear` and `addmm` give their result in float32 whatever
their inputs' dtype, then add the bias in the inputs' dtype: a float16 or bfloat16 model with a
biased convolution or linear layer does not import ("Binary operators must have the same datatype
for both operands"), and one without a bias would carry float32 activations into the next layer.
`HALF_CONVERTERS` (a `custom_convert_map`) runs TVM's own converter for each of those operators
without the bias, casts its float32 result to the inputs' dtype, and adds the bias there: the
product is summed in float32 and rounded once, as cuDNN and cuBLAS compute a half-precision
convolution or matmul, and a float32 model imports exactly as before.

The cast then stands between a convolution and its batch norm, where TVM's FoldBatchnormToConv2D
does not look: `fold_batch_norms` folds those too, so that a half-precision conv + batch norm +
ReLU is one kernel, as in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The operators whose converters give float32 results: the importer's method for each, and where
# its bias is among the node's arguments (addmm: `beta * input + alpha * mat1 @ mat2`, its input).
_CONVERTERS = {
    "conv1d.default": ("_conv1d", 2),
    "conv2d.default": ("_conv2d", 2),
    "conv3d.default": ("_conv3d", 2),
    "convolution.default": ("_convolution", 2),
    "conv_transpose1d.default": ("_conv_transpose1d", 2),
    "conv_transpose2d.input": ("_conv_transpose2d", 2),
    "linear.default": ("_linear", 2),
    "addmm.default": ("_addmm", 0),
}


@dataclass
class _Call:
    """What TVM's converters read of a torch.fx.Node: its arguments."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _in_input_dtype(key: str) -> Callable[[Any, Any], Any]:
    method, bias_at = _CONVERTERS[key]

    def convert(node: Any, importer: Any) -> Any:
        from tvm import relax

        convert_node = getattr(importer, method)
        # The data whose dtype the result takes: the input, or addmm's first matrix.
        dtype = importer.env[node.args[1 if key == "addmm.default" else 0]].ty.dtype
        if dtype == "float32":
            return convert_node(node)
        bias = node.args[bias_at] if len(node.args) > bias_at else None
        if key == "addmm.default":
            beta = node.kwargs.get("beta", 1)
            out = convert_node(_Call(node.args, {**node.kwargs, "beta": 0}))
        else:
            beta = 1
            out = convert_node(_Call(tuple(None if i == bias_at else a for i, a in enumerate(node.args)),
                                     dict(node.kwargs)))
        emit = importer.block_builder.emit
        if out.ty.dtype != dtype:
            out = emit(relax.op.astype(out, dtype))
        if bias is None or beta == 0:
            return out
        b = importer.env[bias]
        if key not in ("linear.default", "addmm.default"):  # a convolution's bias is per channel (axis 1)
            b = relax.op.reshape(b, (1, -1, *[1] * (out.ty.ndim - 2)))
        if beta != 1:
            b = relax.op.multiply(b, relax.const(beta, dtype))
        return emit(relax.op.add(out, b))

    return convert


HALF_CONVERTERS: dict[str, Callable[[Any, Any], Any]] = {key: _in_input_dtype(key) for key in _CONVERTERS}


def fold_batch_norms(mod: Any) -> Any:
    """`mod` with each inference batch norm of a cast convolution, ``batch_norm(astype(conv2d(x, W),
    t), ...)[0]`` with constant W and statistics (an OIHW kernel), folded into it:
    ``astype(conv2d(x, W * s) + b, t)``, s = gamma / sqrt(var + eps) and b = beta - mean * s, computed
    in float32 and the new weights rounded once to W's type. The batch norm's shift is added to
    the float32 sums, before the one rounding. FoldConstant makes the new weights and shift
    constants. Other batch norms are left as they are."""
    from tvm import relax, tirx
    from tvm.relax.dpl import TupleGetItemPattern, is_const, is_op, rewrite_call, wildcard

    data, weight = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)
    cast = is_op("relax.astype")(conv)
    gamma, beta, mean, var = is_const(), is_const(), is_const(), is_const()
    norm = is_op("relax.nn.batch_norm")(cast, gamma, beta, mean, var)
    pattern = TupleGetItemPattern(norm, 0)

    def fold(expr: Any, matches: Any) -> Any:
        call = matches[conv]
        if call.attrs["kernel_layout"] != "OIHW" or call.attrs["out_dtype"] != "float32":
            return expr
        f32 = [relax.op.astype(matches[c], "float32") for c in (gamma, beta, mean, var)]
        epsilon = relax.prim_value(tirx.FloatImm("float32", matches[norm].attrs["epsilon"]))
        scale = relax.op.divide(f32[0], relax.op.sqrt(relax.op.add(f32[3], epsilon)))
        shift = relax.op.subtract(f32[1], relax.op.multiply(f32[2], scale))
        channels = int(matches[gamma].ty.shape[0])
        w = matches[weight]
        folded = relax.op.astype(relax.op.multiply(relax.op.astype(w, "float32"),
                                                   relax.op.reshape(scale, (channels, 1, 1, 1))), str(w.ty.dtype))
        sums = relax.op.add(relax.Call(call.op, (matches[data], folded), call.attrs),
                            relax.op.reshape(shift, (1, channels, 1, 1)))
        return relax.op.astype(sums, matches[cast].attrs["dtype"])

    @relax.transform.function_pass(opt_level=0, name="FoldCastBatchnormToConv2D")
    def fold_in(func: Any, _mod: Any, _ctx: Any) -> Any:
        return rewrite_call(pattern, fold, func)

    return fold_in(mod)
