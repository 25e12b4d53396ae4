"""The tensor kernels the farm tunes: their TE definitions, NumPy references, costs and presets.

A `Workload` is a kernel name plus validated parameters (TOPI-style, see DESIGN.md). Each
definition builds its TE computation with fixed stage names that templates rely on:

- ``pad``: the padded input (absent when the kernel has no padding stage),
- ``compute``: the main reduction (the stage templates tile), accumulating in ``ACCUMULATOR[dtype]``,
- ``epilogue``: the elementwise stage that turns the accumulators into the output, where there is
  one: average pooling's division, and the cast back to float16 of a float16 sum (absent for
  float32 convolutions and matmul, and for max pooling, whose maximum is exact in any dtype).

The argument order of the built function is ``inputs..., output``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farm.core.errors import FarmError, brief

DTYPES = ("float32", "float16")
# The dtype sums accumulate in, per input dtype: float16 products are added up in float32, as
# cuDNN and cuBLAS do by default, so a float16 kernel loses precision only in its inputs and its
# one final rounding, and the farm's float16 kernels are compared with the vendors' at equal
# precision (tensor cores' mma takes float16 in and accumulates in float32 too).
ACCUMULATOR = {"float32": "float32", "float16": "float32"}
# Bounds on a workload, checked when it is made (so at submit, before anything is written).
# Every integer parameter (a size, a stride, a pad) is at most MAX_EXTENT (2^20: a million tokens
# of a matmul): the config space of a loop is enumerated from its extent's divisors, and no extent
# up to 2^20 has more than 125,440 4-way splits (farm.core.space.MAX_KNOB_VALUES).
MAX_EXTENT = 2**20
# Every tensor (inputs and output) has at most MAX_TENSOR_ELEMENTS elements: TVM indexes buffers
# with int32 unless told otherwise, and the farm allocates each tensor on the device to measure.
MAX_TENSOR_ELEMENTS = 2**31 - 1
# An integer parameter as the command line gives it (a sign for the bounds' own message).
_INTEGER = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class Param:
    """One parameter of a workload: an int in [`minimum`, `maximum`] or one of `choices`."""

    name: str
    default: Any = None  # None: required
    choices: tuple[str, ...] | None = None
    minimum: int = 1
    maximum: int = MAX_EXTENT

    def parse(self, workload: str, raw: Any) -> Any:
        """Return the parameter's value from `raw` (a string from the CLI or a Python value)."""
        if self.choices is not None:
            if raw not in self.choices:  # strings only: 1 is not "1", nor a list a choice
                raise FarmError(
                    f"{workload}: {self.name}={brief(raw)} is not one of {', '.join(self.choices)}"
                )
            return str(raw)
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str):  # from the command line
            # Digits 0-9 only: Python's int() also takes spaces, underscores (1_6) and other scripts'
            # digits (١٦), which would store a value the user did not write.
            if not _INTEGER.fullmatch(raw):
                raise FarmError(f"{workload}: {self.name} must be an integer written with the digits 0-9, "
                                f"got {brief(raw)}")
            try:
                value = int(raw, 10)
            except ValueError:  # a string of more than 4300 digits
                raise FarmError(f"{workload}: {self.name} must be an integer, got {brief(raw)}") from None
        else:  # True, 2.5, None, a list: not an integer, whatever int() would make of it
            raise FarmError(f"{workload}: {self.name} must be an integer, got {brief(raw)}")
        if value < self.minimum:
            raise FarmError(f"{workload}: {self.name} must be >= {self.minimum}, got {value}")
        if value > self.maximum:
            raise FarmError(f"{workload}: {self.name}={brief(value)} is larger than the farm's bound of "
                            f"{self.maximum:,} on every extent")
        return value


def _dtype() -> Param:
    return Param("dtype", "float32", DTYPES)


@dataclass(frozen=True)
class WorkloadDef:
    """A kernel family: parameters, TE definition, reference, costs.

    `check` raises FarmError for parameter combinations that have no valid kernel;
    `build_te` returns the function's arguments (inputs then output);
    `reference` computes the output in float64 from the inputs;
    `reduce_extents` are the extents of the ``compute`` stage's reduction axes, in the order
    `build_te` declares them (its spatial axes are the output's), so that templates size their
    spaces without building the TE (TVM's import takes seconds in a fresh process; tests check
    both agree); `ops_per_point` counts the operations per output point and reduction step
    (2 for a multiply-add, 1 for pooling's max or sum), from which `flops` follows.
    """

    name: str
    params: tuple[Param, ...]
    doc: str
    check: Callable[[Mapping[str, Any]], None]
    input_shapes: Callable[[Mapping[str, Any]], list[tuple[int, ...]]]
    output_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]
    build_te: Callable[[Mapping[str, Any]], list[Any]]
    reference: Callable[[Mapping[str, Any], list[np.ndarray]], np.ndarray]
    reduce_extents: Callable[[Mapping[str, Any]], tuple[int, ...]]
    ops_per_point: int


@dataclass(frozen=True)
class Workload:
    """A kernel with concrete, validated parameters. Hashable; its `key` is canonical JSON."""

    name: str
    params: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def definition(self) -> WorkloadDef:
        return WORKLOADS[self.name]

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def key(self) -> str:
        return json.dumps({"name": self.name, "params": self.p}, sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.p}

    def stage(self, role: str) -> str | None:
        """The name of the block of the workload's function that plays `role` (``pad``, ``compute``,
        ``epilogue``: see the module docstring), which templates look blocks up by; here the role's
        own name (a TIR kernel's blocks have others: farm.core.fused)."""
        return role

    @property
    def family(self) -> str:
        """What workloads one cost model learns together (farm.core.jobspec.family_key): the name."""
        return self.name

    @property
    def dtype(self) -> str:
        return self.p["dtype"]

    def input_shapes(self) -> list[tuple[int, ...]]:
        return self.definition.input_shapes(self.p)

    def output_shape(self) -> tuple[int, ...]:
        return self.definition.output_shape(self.p)

    def build_te(self) -> list[Any]:
        return self.definition.build_te(self.p)

    def prim_func(self) -> Any:
        """The kernel as a TVM PrimFunc (what templates schedule and MetaSchedule databases key on)."""
        from tvm import te

        return te.create_prim_func(self.build_te())

    def compute_extents(self) -> tuple[int, ...]:
        """The ``compute`` stage's loop extents before any scheduling: spatial (the output's
        shape), then reduction; what TVM's schedule of `prim_func` shows, without TVM."""
        return (*self.output_shape(), *self.definition.reduce_extents(self.p))

    def flops(self) -> int:
        return self.definition.ops_per_point * math.prod(self.compute_extents())

    def bytes(self) -> int:
        """Compulsory memory traffic: every input read once, the output written once."""
        item = np.dtype(self.dtype).itemsize
        elements = sum(int(np.prod(s)) for s in self.input_shapes())
        return (elements + int(np.prod(self.output_shape()))) * item

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Inputs drawn from U(-1, 1) (never zeros: they hide unwritten outputs)."""
        rng = np.random.default_rng(seed)
        return [rng.uniform(-1.0, 1.0, size=s).astype(self.dtype) for s in self.input_shapes()]

    def reference(self, inputs: list[np.ndarray]) -> np.ndarray:
        """The expected output, computed in float64 and cast to the workload's dtype."""
        ref = self.definition.reference(self.p, [x.astype(np.float64) for x in inputs])
        return ref.astype(self.dtype)

    def tolerance(self) -> float:
        """Bound on ||out - ref|| / ||ref|| for a correct kernel in this dtype."""
        return 2e-2 if self.dtype == "float16" else 1e-4

    def __str__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}({args})"


# --- shape helpers --------------------------------------------------------------------------


def _out_size(size: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def _check_window(name: str, p: Mapping[str, Any], dilation: int = 1) -> None:
    for axis, k in (("H", "KH"), ("W", "KW")):
        span = dilation * (p[k] - 1) + 1
        if span > p[axis] + 2 * p["pad"]:
            raise FarmError(
                f"{name}: kernel {k}={p[k]} (span {span}) is larger than the padded input "
                f"{axis}+2*pad={p[axis] + 2 * p['pad']}"
            )


def _pad_te(data: Any, pad: int, value: Any) -> Any:
    """The `pad` stage: `data` with `pad` elements of `value` around its last two axes."""
    from tvm import te, tirx

    n, c, h, w = data.shape
    return te.compute(
        (n, c, h + 2 * pad, w + 2 * pad),
        lambda i, j, y, x: tirx.if_then_else(
            tirx.all(y >= pad, y < h + pad, x >= pad, x < w + pad),
            data[i, j, y - pad, x - pad],
            value,
        ),
        name="pad",
    )


def _epilogue_te(acc: Any, dtype: str, scale: float | None = None) -> Any:
    """The output from the accumulators `acc`: scaled by `scale` if given, cast to `dtype`;
    `acc` itself where there is nothing to do (the ``epilogue`` stage, see the module's doc)."""
    from tvm import te, tirx

    if scale is None and acc.dtype == dtype:
        return acc

    def value(*i: Any) -> Any:
        v = acc(*i) if scale is None else acc(*i) * tirx.const(scale, acc.dtype)
        return v.astype(dtype)

    return te.compute(acc.shape, value, name="epilogue")


def _windows(x: np.ndarray, kh: int, kw: int, stride: int, pad: int, dilation: int,
             fill: float = 0.0) -> np.ndarray:
    """(N, C, OH, OW, KH, KW) view of the padded input's windows."""
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    n, c, hp, wp = xp.shape
    oh = (hp - dilation * (kh - 1) - 1) // stride + 1
    ow = (wp - dilation * (kw - 1) - 1) // stride + 1
    s = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp,
        shape=(n, c, oh, ow, kh, kw),
        strides=(s[0], s[1], s[2] * stride, s[3] * stride, s[2] * dilation, s[3] * dilation),
        writeable=False,
    )


# --- conv2d_nchw ----------------------------------------------------------------------------


def _conv_out(p: Mapping[str, Any]) -> tuple[int, int, int, int]:
    d = p.get("dilation", 1)
    return (p["N"], p["CO"], _out_size(p["H"], p["KH"], p["stride"], p["pad"], d),
            _out_size(p["W"], p["KW"], p["stride"], p["pad"], d))


def _conv2d_check(p: Mapping[str, Any]) -> None:
    _check_window("conv2d_nchw", p, p["dilation"])


def _conv2d_te(p: Mapping[str, Any]) -> list[Any]:
    from tvm import te, tirx

    dt, s, d = p["dtype"], p["stride"], p["dilation"]
    data = te.placeholder((p["N"], p["CI"], p["H"], p["W"]), dt, name="data")
    kernel = te.placeholder((p["CO"], p["CI"], p["KH"], p["KW"]), dt, name="kernel")
    padded = _pad_te(data, p["pad"], tirx.const(0.0, dt))
    rc = te.reduce_axis((0, p["CI"]), name="rc")
    ry = te.reduce_axis((0, p["KH"]), name="ry")
    rx = te.reduce_axis((0, p["KW"]), name="rx")
    acc = ACCUMULATOR[dt]
    # The kernel first: the product then reads as the matrix product W[f, k] * X[k, pixel] that
    # the tensor-core template rewrites it into, in the operand order of TVM's intrinsics.
    out = te.compute(
        _conv_out(p),
        lambda n, f, y, x: te.sum(
            kernel[f, rc, ry, rx].astype(acc) * padded[n, rc, y * s + ry * d, x * s + rx * d].astype(acc),
            axis=[rc, ry, rx],
        ),
        name="compute",
    )
    return [data, kernel, _epilogue_te(out, dt)]


def _conv2d_ref(p: Mapping[str, Any], xs: list[np.ndarray]) -> np.ndarray:
    win = _windows(xs[0], p["KH"], p["KW"], p["stride"], p["pad"], p["dilation"])
    return np.einsum("ncyxhw,fchw->nfyx", win, xs[1], optimize=True)


# --- depthwise_conv2d_nchw ------------------------------------------------------------------


def _dw_out(p: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return (p["N"], p["C"] * p["multiplier"], _out_size(p["H"], p["KH"], p["stride"], p["pad"]),
            _out_size(p["W"], p["KW"], p["stride"], p["pad"]))


def _dw_te(p: Mapping[str, Any]) -> list[Any]:
    from tvm import te, tirx

    dt, s, m = p["dtype"], p["stride"], p["multiplier"]
    data = te.placeholder((p["N"], p["C"], p["H"], p["W"]), dt, name="data")
    kernel = te.placeholder((p["C"], m, p["KH"], p["KW"]), dt, name="kernel")
    padded = _pad_te(data, p["pad"], tirx.const(0.0, dt))
    ry = te.reduce_axis((0, p["KH"]), name="ry")
    rx = te.reduce_axis((0, p["KW"]), name="rx")
    acc = ACCUMULATOR[dt]
    out = te.compute(
        _dw_out(p),
        lambda n, c, y, x: te.sum(
            padded[n, c // m, y * s + ry, x * s + rx].astype(acc) * kernel[c // m, c % m, ry, rx].astype(acc),
            axis=[ry, rx],
        ),
        name="compute",
    )
    return [data, kernel, _epilogue_te(out, dt)]


def _dw_ref(p: Mapping[str, Any], xs: list[np.ndarray]) -> np.ndarray:
    win = _windows(xs[0], p["KH"], p["KW"], p["stride"], p["pad"], 1)
    out = np.einsum("ncyxhw,cmhw->ncmyx", win, xs[1], optimize=True)
    n, c, m, oh, ow = out.shape
    return out.reshape(n, c * m, oh, ow)


# --- pool2d ---------------------------------------------------------------------------------


def _pool_out(p: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return (p["N"], p["C"], _out_size(p["H"], p["KH"], p["stride"], p["pad"]),
            _out_size(p["W"], p["KW"], p["stride"], p["pad"]))


def _pool_check(p: Mapping[str, Any]) -> None:
    _check_window("pool2d", p)
    if p["pad"] >= max(p["KH"], p["KW"]) and p["kind"] == "max":
        raise FarmError(
            f"pool2d: pad={p['pad']} must be smaller than the window ({p['KH']}x{p['KW']}), "
            "or some windows hold only padding"
        )


def _pool_te(p: Mapping[str, Any]) -> list[Any]:
    from tvm import te, tirx

    dt, s, kh, kw = p["dtype"], p["stride"], p["KH"], p["KW"]
    data = te.placeholder((p["N"], p["C"], p["H"], p["W"]), dt, name="data")
    fill = tirx.min_value(dt) if p["kind"] == "max" else tirx.const(0.0, dt)
    padded = _pad_te(data, p["pad"], fill)
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    if p["kind"] == "max":  # exact in any dtype: no accumulator, no epilogue
        pooled = te.compute(
            _pool_out(p),
            lambda n, c, y, x: te.max(padded[n, c, y * s + ry, x * s + rx], axis=[ry, rx]),
            name="compute",
        )
        return [data, pooled]
    acc = ACCUMULATOR[dt]
    summed = te.compute(
        _pool_out(p),
        lambda n, c, y, x: te.sum(padded[n, c, y * s + ry, x * s + rx].astype(acc), axis=[ry, rx]),
        name="compute",
    )
    # Average over the whole window, padding included (PyTorch's count_include_pad=True).
    return [data, _epilogue_te(summed, dt, scale=1.0 / (kh * kw))]


def _pool_ref(p: Mapping[str, Any], xs: list[np.ndarray]) -> np.ndarray:
    fill = -np.inf if p["kind"] == "max" else 0.0
    win = _windows(xs[0], p["KH"], p["KW"], p["stride"], p["pad"], 1, fill)
    if p["kind"] == "max":
        return win.max(axis=(4, 5))
    return win.sum(axis=(4, 5)) / (p["KH"] * p["KW"])


# --- group_conv2d_nchw ----------------------------------------------------------------------


def _group_check(p: Mapping[str, Any]) -> None:
    for ch in ("CI", "CO"):
        if p[ch] % p["groups"]:
            raise FarmError(
                f"group_conv2d_nchw: {ch}={p[ch]} is not divisible by groups={p['groups']}"
            )
    _check_window("group_conv2d_nchw", p)


def _group_te(p: Mapping[str, Any]) -> list[Any]:
    from tvm import te, tirx

    dt, s, g = p["dtype"], p["stride"], p["groups"]
    cig, cog = p["CI"] // g, p["CO"] // g
    data = te.placeholder((p["N"], p["CI"], p["H"], p["W"]), dt, name="data")
    kernel = te.placeholder((p["CO"], cig, p["KH"], p["KW"]), dt, name="kernel")
    padded = _pad_te(data, p["pad"], tirx.const(0.0, dt))
    rc = te.reduce_axis((0, cig), name="rc")
    ry = te.reduce_axis((0, p["KH"]), name="ry")
    rx = te.reduce_axis((0, p["KW"]), name="rx")
    acc = ACCUMULATOR[dt]
    out = te.compute(  # the kernel first, as in _conv2d_te
        _conv_out({**p, "dilation": 1}),
        lambda n, f, y, x: te.sum(
            kernel[f, rc, ry, rx].astype(acc) * padded[n, f // cog * cig + rc, y * s + ry, x * s + rx].astype(acc),
            axis=[rc, ry, rx],
        ),
        name="compute",
    )
    return [data, kernel, _epilogue_te(out, dt)]


def _group_ref(p: Mapping[str, Any], xs: list[np.ndarray]) -> np.ndarray:
    g = p["groups"]
    win = _windows(xs[0], p["KH"], p["KW"], p["stride"], p["pad"], 1)
    n, ci, oh, ow, kh, kw = win.shape
    win = win.reshape(n, g, ci // g, oh, ow, kh, kw)
    ker = xs[1].reshape(g, p["CO"] // g, ci // g, kh, kw)
    out = np.einsum("ngcyxhw,gfchw->ngfyx", win, ker, optimize=True)
    return out.reshape(n, p["CO"], oh, ow)


# --- matmul ---------------------------------------------------------------------------------


def _matmul_te(p: Mapping[str, Any]) -> list[Any]:
    """A matmul's computation, or a batch of them where `p` has a batch size ``B`` (batch_matmul)."""
    from tvm import te

    batch = (p["B"],) if "B" in p else ()
    a = te.placeholder((*batch, p["M"], p["K"]), p["dtype"], name="A")
    b = te.placeholder((*batch, p["K"], p["N"]), p["dtype"], name="B")
    k = te.reduce_axis((0, p["K"]), name="k")
    acc = ACCUMULATOR[p["dtype"]]
    if batch:
        c = te.compute((*batch, p["M"], p["N"]),
                       lambda n, i, j: te.sum(a[n, i, k].astype(acc) * b[n, k, j].astype(acc), axis=k), name="compute")
    else:
        c = te.compute((p["M"], p["N"]), lambda i, j: te.sum(a[i, k].astype(acc) * b[k, j].astype(acc), axis=k),
                       name="compute")
    return [a, b, _epilogue_te(c, p["dtype"])]


def _no_check(p: Mapping[str, Any]) -> None:
    return None


def _conv_shapes(p: Mapping[str, Any], ci_kernel: int) -> list[tuple[int, ...]]:
    return [(p["N"], p["CI"], p["H"], p["W"]), (p["CO"], ci_kernel, p["KH"], p["KW"])]


WORKLOADS: dict[str, WorkloadDef] = {
    d.name: d
    for d in (
        WorkloadDef(
            name="conv2d_nchw",
            params=(Param("N"), Param("CI"), Param("H"), Param("W"), Param("CO"), Param("KH"),
                    Param("KW"), Param("stride", 1), Param("pad", 0, minimum=0),
                    Param("dilation", 1), _dtype()),
            doc="2D convolution, NCHW data, OIHW kernel",
            check=_conv2d_check,
            input_shapes=lambda p: _conv_shapes(p, p["CI"]),
            output_shape=_conv_out,
            build_te=_conv2d_te,
            reference=_conv2d_ref,
            reduce_extents=lambda p: (p["CI"], p["KH"], p["KW"]),
            ops_per_point=2,
        ),
        WorkloadDef(
            name="depthwise_conv2d_nchw",
            params=(Param("N"), Param("C"), Param("H"), Param("W"), Param("KH"), Param("KW"),
                    Param("stride", 1), Param("pad", 0, minimum=0), Param("multiplier", 1),
                    _dtype()),
            doc="depthwise 2D convolution, NCHW data, (C, multiplier, KH, KW) kernel",
            check=lambda p: _check_window("depthwise_conv2d_nchw", p),
            input_shapes=lambda p: [(p["N"], p["C"], p["H"], p["W"]),
                                    (p["C"], p["multiplier"], p["KH"], p["KW"])],
            output_shape=_dw_out,
            build_te=_dw_te,
            reference=_dw_ref,
            reduce_extents=lambda p: (p["KH"], p["KW"]),
            ops_per_point=2,
        ),
        WorkloadDef(
            name="pool2d",
            params=(Param("N"), Param("C"), Param("H"), Param("W"), Param("KH"), Param("KW"),
                    Param("stride", 1), Param("pad", 0, minimum=0),
                    Param("kind", "max", ("max", "avg")), _dtype()),
            doc="2D max or average pooling (average counts padding), NCHW",
            check=_pool_check,
            input_shapes=lambda p: [(p["N"], p["C"], p["H"], p["W"])],
            output_shape=_pool_out,
            build_te=_pool_te,
            reference=_pool_ref,
            reduce_extents=lambda p: (p["KH"], p["KW"]),
            ops_per_point=1,
        ),
        WorkloadDef(
            name="group_conv2d_nchw",
            params=(Param("N"), Param("CI"), Param("H"), Param("W"), Param("CO"), Param("KH"),
                    Param("KW"), Param("groups"), Param("stride", 1), Param("pad", 0, minimum=0),
                    _dtype()),
            doc="grouped 2D convolution, NCHW data, (CO, CI/groups, KH, KW) kernel",
            check=_group_check,
            input_shapes=lambda p: _conv_shapes(p, p["CI"] // p["groups"]),
            output_shape=lambda p: _conv_out({**p, "dilation": 1}),
            build_te=_group_te,
            reference=_group_ref,
            reduce_extents=lambda p: (p["CI"] // p["groups"], p["KH"], p["KW"]),
            ops_per_point=2,
        ),
        WorkloadDef(
            name="matmul",
            params=(Param("M"), Param("N"), Param("K"), _dtype()),
            doc="C[M, N] = A[M, K] @ B[K, N]",
            check=_no_check,
            input_shapes=lambda p: [(p["M"], p["K"]), (p["K"], p["N"])],
            output_shape=lambda p: (p["M"], p["N"]),
            build_te=_matmul_te,
            reference=lambda p, xs: xs[0] @ xs[1],
            reduce_extents=lambda p: (p["K"],),
            ops_per_point=2,
        ),
        WorkloadDef(
            name="batch_matmul",
            params=(Param("B"), Param("M"), Param("N"), Param("K"), _dtype()),
            doc="C[B, M, N] = A[B, M, K] @ B[B, K, N], one matmul per batch (attention's scores and context)",
            check=_no_check,
            input_shapes=lambda p: [(p["B"], p["M"], p["K"]), (p["B"], p["K"], p["N"])],
            output_shape=lambda p: (p["B"], p["M"], p["N"]),
            build_te=_matmul_te,
            reference=lambda p, xs: xs[0] @ xs[1],
            reduce_extents=lambda p: (p["K"],),
            ops_per_point=2,
        ),
    )
}

PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "resnet-last-conv": (
        "conv2d_nchw",
        dict(N=1, CI=512, H=7, W=7, CO=512, KH=3, KW=3, stride=1, pad=1),
        "ResNet's last 3x3 conv (AutoTVM conv2d tutorial)",
    ),
    "seed-depthwise": (
        "depthwise_conv2d_nchw",
        dict(N=3, C=4, H=16, W=32, KH=7, KW=7, stride=1, pad=3),
        "the depthwise-conv blog post's 7x7 case",
    ),
    "seed-maxpool": (
        "pool2d",
        dict(N=1, C=64, H=64, W=64, KH=3, KW=3, stride=1, pad=1, kind="max"),
        "d2ltvm's GPU max pooling",
    ),
    "seed-avgpool": (
        "pool2d",
        dict(N=1, C=64, H=64, W=64, KH=3, KW=3, stride=1, pad=1, kind="avg"),
        "d2ltvm's GPU average pooling",
    ),
    "spio-grouped": (
        "group_conv2d_nchw",
        dict(N=32, CI=64, H=64, W=64, CO=64, KH=3, KW=3, pad=1, groups=8, dtype="float16"),
        "spio's grouped conv, group width 8, fp16",
    ),
}


def make_workload(name: str, params: Mapping[str, Any] | None = None) -> Workload:
    """Build a validated Workload from a workload or preset name and parameter overrides.

    Raises FarmError for an unknown name, an unknown, missing or malformed parameter (an integer
    outside [minimum, MAX_EXTENT]), a combination with no valid kernel, or a tensor of more than
    MAX_TENSOR_ELEMENTS elements.
    """
    if not isinstance(name, str):
        raise FarmError(f"a workload is a name or (name, {{param: value}}), got {brief(name)}")
    if params is not None and not isinstance(params, Mapping):
        raise FarmError(f"{brief(name)}: parameters must be a dict of name: value, got {brief(params)}")
    if not all(isinstance(key, str) for key in params or {}):
        raise FarmError(f"{brief(name)}: parameter names must be strings, got {brief(list(params or {}))}")
    if name == "tir":  # any PrimFunc, its IR in its parameters (farm.core.tir)
        from farm.core.tir import tir_from_params

        return tir_from_params(dict(params or {}))
    overrides = dict(params or {})
    if name in PRESETS:
        name, base, _ = PRESETS[name]
        overrides = {**base, **overrides}
    if name not in WORKLOADS:
        known = ", ".join([*WORKLOADS, *PRESETS])
        raise FarmError(f"unknown workload or preset {brief(name)}; known: {known}")
    definition = WORKLOADS[name]
    names = {prm.name for prm in definition.params}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise FarmError(
            f"{name}: unknown parameter(s) {brief(', '.join(unknown))}; parameters: {', '.join(names)}"
        )
    values: dict[str, Any] = {}
    for prm in definition.params:
        if prm.name in overrides:
            values[prm.name] = prm.parse(name, overrides[prm.name])
        elif prm.default is not None:
            values[prm.name] = prm.default
        else:
            raise FarmError(f"{name}: missing parameter {prm.name} (give it as {prm.name}=VALUE)")
    definition.check(values)
    workload = Workload(name, tuple(values.items()))
    for shape in [*workload.input_shapes(), workload.output_shape()]:
        elements = math.prod(shape)
        if elements > MAX_TENSOR_ELEMENTS:
            raise FarmError(f"{workload}: a tensor of shape {shape} has {elements:,} elements, more than the "
                            f"farm's bound of {MAX_TENSOR_ELEMENTS:,}")
    return workload


def parse_assignments(items: list[str]) -> dict[str, str]:
    """Parse CLI `key=value` words into a dict (values stay strings for `make_workload`). FarmError
    for a word that is not key=value with neither side empty or holding whitespace, and for a key
    given twice (which of the two was meant is not the farm's guess)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise FarmError(f"parameter {brief(item)} must look like key=value, e.g. CI=256")
        if any(c.isspace() for c in item):
            raise FarmError(f"parameter {brief(item)} holds whitespace: write key=value as one word, e.g. CI=256")
        if key in out:
            raise FarmError(f"parameter {brief(key)} is given twice ({key}={out[key]} and {item}): give it once")
        out[key] = value
    return out


def workload_label(doc: Mapping[str, Any], params: bool = True) -> str:
    """A workload as people read it, from its JSON (`Workload.to_json`), without TVM: a TIR
    kernel as ``tir:NAME@HASH`` (its IR left out), another as its name, with ``(k=v, ...)`` when
    `params`."""
    p = doc.get("params", {})
    if doc.get("name") == "tir":
        return f"tir:{p.get('func')}@{str(p.get('hash'))[:10]}"
    if not params:
        return str(doc.get("name"))
    return f"{doc.get('name')}({','.join(f'{k}={v}' for k, v in p.items())})"


def workload_from_json(doc: Mapping[str, Any]) -> Workload:
    """Inverse of `Workload.to_json`, validating again."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str) \
            or not isinstance(doc.get("params"), dict) or set(doc) != {"name", "params"}:
        raise FarmError(f"malformed workload {brief(doc)}: expected {{'name': ..., 'params': {{...}}}}")
    return make_workload(doc["name"], doc["params"])
