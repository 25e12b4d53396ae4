"""A TIR kernel whose main computation is one of the farm's operators, with elementwise stages
around it: a model's fused ``conv2d + bias + relu`` or ``matmul + bias + gelu``.

`match_operator` reads a TIR workload's blocks: one reduction (the main computation), before it at
most a padding block, after it only elementwise blocks. If the reduction is a matmul
(``C[i, j] += A[i, k] * B[k, j]``) or an NCHW convolution (``O[n, f, y, x] += P[n, c, y*s + r*d,
x*s + q*d] * W[f, c, r, q]`` over the padding block's output), it returns a `FusedOperator`: the
named workload of that computation (its parameters from the buffers and indices), tied to the TIR
kernel. The farm's hand templates then schedule the kernel itself (`new_schedule` starts from the
kernel's own function, its elementwise blocks inlined into the last one, the ``epilogue`` they fold
into the kernel), finding its blocks by role (`FusedOperator.stage`), so that the model's kernel gets
the templates that beat cuDNN. The output check compares with the whole kernel's own output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from farm.core.errors import FarmError
from farm.core.tir import TirWorkload
from farm.core.workloads import Workload, make_workload

# Roles a hand template looks its blocks up by (farm.core.workloads' stage names).
ROLES = ("pad", "compute", "epilogue")


@dataclass(frozen=True)
class FusedOperator(Workload):
    """The named workload `name`/`params` computed by the TIR kernel `source`, whose block of
    each role is in `stages` and whose other elementwise blocks (`inline`) are inlined first."""

    source: TirWorkload | None = field(default=None, kw_only=True)
    stages: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)
    inline: tuple[str, ...] = field(default=(), kw_only=True)

    def stage(self, role: str) -> str | None:
        return dict(self.stages).get(role)

    def prim_func(self) -> Any:
        assert self.source is not None
        return self.source.prim_func()

    def prepare(self, sch: Any) -> None:
        """Inline the kernel's elementwise blocks but the last into it (schedule primitives, so a
        trace replays them on the kernel as given)."""
        for name in self.inline:
            sch.compute_inline(sch.get_sblock(name))

    def __str__(self) -> str:
        return f"{self.source} as {super().__str__()}"


@lru_cache(maxsize=256)
def match_operator(tir: TirWorkload) -> FusedOperator | None:
    """The farm operator `tir` computes with elementwise stages around it, or None."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": tir.prim_func()}))
    root = sch.get_sblock("root")
    blocks = [sch.get(b) for b in sch.get_child_blocks(root)]
    if any(len(sch.get_child_blocks(sch.get_sblock(b.name_hint))) for b in blocks):
        return None
    reductions = [i for i, b in enumerate(blocks) if any(int(v.iter_type) == 2 for v in b.iter_vars)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    before, after = blocks[:main], blocks[main + 1:]
    if len(before) > 1:
        return None
    params = {p.name: p for p in tir.prim_func().params}
    try:
        if before:
            found = _conv2d(blocks[main], before[0], params)
        else:
            found = _matmul(blocks[main], params)
    except (FarmError, ValueError, KeyError, TypeError, AttributeError):  # not of the shape matched
        return None
    if found is None:
        return None
    name, values = found
    stages = [("compute", blocks[main].name_hint)]
    if before:
        stages.append(("pad", before[0].name_hint))
    if after:
        stages.append(("epilogue", after[-1].name_hint))
    if (after[-1].writes[0].source.name if after else blocks[main].writes[0].source.name) != list(params)[-1]:
        return None
    try:
        operator = make_workload(name, values)
    except FarmError:
        return None
    return FusedOperator(operator.name, operator.params, source=tir, stages=tuple(stages),
                         inline=tuple(b.name_hint for b in after[:-1]))


def _affine(expr: Any) -> dict[str, int] | None:
    """An index as {variable: coefficient} (the constant under ""), None if it is not affine."""
    from tvm import tirx

    if isinstance(expr, tirx.Var):
        return {expr.name: 1}
    if isinstance(expr, tirx.IntImm):
        return {"": int(expr.value)}
    if isinstance(expr, tirx.Add | tirx.Sub):
        a, b = _affine(expr.a), _affine(expr.b)
        if a is None or b is None:
            return None
        sign = -1 if isinstance(expr, tirx.Sub) else 1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return out
    if isinstance(expr, tirx.Mul):
        for x, k in ((expr.a, expr.b), (expr.b, expr.a)):
            if isinstance(k, tirx.IntImm) and (inner := _affine(x)) is not None:
                return {name: c * int(k.value) for name, c in inner.items()}
    return None


def _accesses(block: Any) -> list[tuple[str, list[dict[str, int] | None], Any]]:
    """(buffer name, affine index of each dimension, buffer var) of each region the block reads."""
    return [(r.source.name, [_affine(rng.min) for rng in r.region], r.source) for r in block.reads]


def _dtype(buffer: Any) -> str:
    return str(buffer.dtype)


def _matmul(block: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """("matmul", params) if `block` is C[i, j] += A[i, k] * B[k, j] over two of the kernel's inputs."""
    iters = [(v.var.name, int(v.dom.extent), int(v.iter_type)) for v in block.iter_vars]
    if [t for _, _, t in iters] != [0, 0, 2]:
        return None
    (i, m, _), (j, n, _), (k, kk, _) = iters
    out = block.writes[0].source.name
    reads = [a for a in _accesses(block) if a[0] != out]
    if len(reads) != 2 or any(name not in params for name, _, _ in reads):
        return None
    (_, a_idx, a_buf), (_, b_idx, b_buf) = reads
    if a_idx != [{i: 1}, {k: 1}] or b_idx != [{k: 1}, {j: 1}] or _dtype(a_buf) != _dtype(b_buf):
        return None
    return "matmul", {"M": m, "N": n, "K": kk, "dtype": _dtype(a_buf)}


def _conv2d(block: Any, pad: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """("conv2d_nchw", params) if `pad` pads an input of the kernel and `block` convolves it with a
    kernel input: O[n, f, y, x] += P[n, c, y*s + r*d, x*s + q*d] * W[f, c, r, q]."""
    iters = [(v.var.name, int(v.dom.extent), int(v.iter_type)) for v in block.iter_vars]
    if [t for _, _, t in iters] != [0, 0, 0, 0, 2, 2, 2]:
        return None
    (n, _, _), (f, co, _), (y, _, _), (x, _, _), (c, ci, _), (r, kh, _), (q, kw, _) = iters
    padded = pad.writes[0].source
    reads = {name: (index, buffer) for name, index, buffer in _accesses(block)}
    if padded.name not in reads or len(pad.reads) != 1 or pad.reads[0].source.name not in params:
        return None
    data = params[pad.reads[0].source.name]
    index, _ = reads.pop(padded.name)
    reads.pop(block.writes[0].source.name, None)
    if len(reads) != 1:
        return None
    (weight_name, (weight_index, weight)), = reads.items()
    if weight_name not in params or weight_index != [{f: 1}, {c: 1}, {r: 1}, {q: 1}]:
        return None
    if index[0] != {n: 1} or index[1] != {c: 1} or index[2] is None or index[3] is None:
        return None
    stride, dilation = index[2].get(y, 0), index[2].get(r, 0)
    if index[2] != {y: stride, r: dilation} or index[3] != {x: stride, q: dilation}:
        return None
    shape = [int(d) for d in data.shape]
    pad_h = (int(padded.shape[2]) - shape[2]) // 2
    if int(padded.shape[3]) - shape[3] != 2 * pad_h or _dtype(data) != _dtype(weight):
        return None
    return "conv2d_nchw", {"N": shape[0], "CI": ci, "H": shape[2], "W": shape[3], "CO": co, "KH": kh, "KW": kw,
                           "stride": stride, "pad": pad_h, "dilation": dilation, "dtype": _dtype(data)}
