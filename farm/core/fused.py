"""A TIR kernel whose main computation is one of the farm's operators, with elementwise stages
around it: a model's fused ``conv2d + bias + relu``, ``matmul + bias + gelu`` or depthwise
convolution + batch norm + relu.

`match_operator` reads a TIR workload's blocks: one reduction (the main computation), before it at
most a padding block, after it only elementwise blocks. If the reduction is one of

- a matmul, ``C[i, j] += A[i, k] * B[k, j]``, also of a batch of rows, ``C[b..., i, j] += A[b..., i, k]
  * B[k, j]`` (a linear layer on a sequence); or a batch of matmuls, ``C[b..., i, j] += A[b..., i, k] *
  B[b..., k, j]`` (one or more batch axes, the same in both inputs: an attention's scores and context);
- an NCHW convolution, ``O[n, f, y, x] += P[n, c, y*s + r*d, x*s + q*d] * W[f, c, r, q]``;
- a grouped one, ``O[n, f, y, x] += P[n, f // (CO/G) * (CI/G) + c, y*s + r, x*s + q] * W[f, c, r, q]``,
  which is a depthwise convolution where each group has one input channel (TOPI writes PyTorch's
  ``groups=C`` convolutions so, with a reduction loop of extent 1);
- a max or sum pooling, ``O[n, c, y, x] = max/sum P[n, c, y*s + r, x*s + q]`` (the average's division
  is the elementwise stage after it),

where ``P`` is a kernel input or the padding block's output of one, it returns a `FusedOperator`: the
named workload of that computation (its parameters from the buffers and indices), tied to the TIR
kernel. The farm's hand templates then schedule the kernel itself (`new_schedule` starts from the
kernel's own function, its elementwise blocks inlined into the last one, the ``epilogue`` they fold
into the kernel), finding its blocks by role (`FusedOperator.stage`), so that the model's kernel gets
the templates that beat cuDNN. The output check compares with the whole kernel's own output.
"""

from __future__ import annotations

import math
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
    # Runs of the compute block's loops, (first, count), each fused into one loop so that the
    # templates find the loops of the workload they schedule: a depthwise convolution written as a
    # grouped one has a reduction loop of extent 1 before its window's (fused into the window's
    # rows), a batch matmul may have several batch axes (fused into one), a linear layer a batch of
    # sequences (fused into its rows). In each run at most one loop has an extent over 1
    # (match_operator), so the fused loop is that loop and its tiles stay boxes of the buffers.
    fuse_loops: tuple[tuple[int, int], ...] = field(default=(), kw_only=True)

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
        for first, count in reversed(self.fuse_loops):  # the last first: the earlier loops keep their places
            loops = sch.get_loops(sch.get_sblock(self.stage("compute")))
            sch.fuse(*loops[first:first + count])

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
    output = (after[-1] if after else blocks[main]).writes[0].source
    if output.name != list(params)[-1]:
        return None
    try:
        found = _matmul(blocks[main], params) if not before else None
        if found is None:
            found = _windowed(blocks[main], before[0] if before else None, params)
    except (FarmError, ValueError, KeyError, TypeError, AttributeError):  # not of the shape matched
        return None
    if found is None:
        return None
    name, values, fuse = found
    try:
        operator = make_workload(name, values)
    except FarmError:
        return None
    if operator.output_shape() != _collapsed([int(d) for d in output.shape], fuse):  # e.g. a pooling's ceil mode
        return None
    if name == "pool2d" and values["kind"] == "avg" and not after:  # a sum: no average's division
        return None
    extents = [int(v.dom.extent) for v in blocks[main].iter_vars]
    if any(sum(e > 1 for e in extents[first:first + count]) > 1 for first, count in fuse):
        # Two loops of extent > 1 fused into one: a tile of it is no box of the buffers, and TVM's
        # regions (of a write cache, an epilogue computed at the tile) would take the box around it.
        return None
    stages = [("compute", blocks[main].name_hint)]
    if before:
        stages.append(("pad", before[0].name_hint))
    if after:
        stages.append(("epilogue", after[-1].name_hint))
    return FusedOperator(operator.name, operator.params, source=tir, stages=tuple(stages),
                         inline=tuple(b.name_hint for b in after[:-1]), fuse_loops=fuse)


def _collapsed(shape: list[int], fuse: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """`shape` with each run of its axes that `fuse` fuses (FusedOperator.fuse_loops) as one axis."""
    for first, count in reversed(fuse):
        if first + count <= len(shape):  # a run of spatial loops, the output's axes
            shape[first:first + count] = [math.prod(shape[first:first + count])]
    return tuple(shape)


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


# What a matcher returns: the workload's name and params, and the loop runs to fuse (FusedOperator.fuse_loops).
Match = tuple[str, dict[str, Any], tuple[tuple[int, int], ...]]


def _matmul(block: Any, params: dict[str, Any]) -> Match | None:
    """("matmul", ...) if `block` is C[i, j] += A[i, k] * B[k, j] over two of the kernel's inputs, or
    C[b..., i, j] += A[b..., i, k] * B[k, j] (a linear layer on a batch of rows: the rows' loops fused
    into one); ("batch_matmul", ...) if it is C[b..., i, j] += A[b..., i, k] * B[b..., k, j]."""
    iters = [(v.var.name, int(v.dom.extent), int(v.iter_type)) for v in block.iter_vars]
    if len(iters) < 3 or [t for _, _, t in iters] != [0] * (len(iters) - 1) + [2]:
        return None
    *batch, (i, m, _), (j, n, _), (k, kk, _) = iters
    out = block.writes[0].source.name
    reads = [a for a in _accesses(block) if a[0] != out]
    if len(reads) != 2 or any(name not in params for name, _, _ in reads):
        return None
    (_, a_idx, a_buf), (_, b_idx, b_buf) = reads
    same = [{b: 1} for b, _, _ in batch]
    shared = b_idx == [{k: 1}, {j: 1}]  # one B for every batch
    if a_idx != [*same, {i: 1}, {k: 1}] or (b_idx != [*same, {k: 1}, {j: 1}] and not shared) or \
            _dtype(a_buf) != _dtype(b_buf):
        return None
    size = math.prod(extent for _, extent, _ in batch)
    if shared:  # a matmul, of the batches' rows together where there are batches
        return "matmul", {"M": size * m, "N": n, "K": kk, "dtype": _dtype(a_buf)}, \
            ((0, len(batch) + 1),) if batch else ()
    return ("batch_matmul", {"B": size, "M": m, "N": n, "K": kk, "dtype": _dtype(a_buf)},
            ((0, len(batch)),) if len(batch) > 1 else ())


def _windowed(block: Any, pad: Any | None, params: dict[str, Any]) -> Match | None:
    """The convolution or pooling `block` computes (the module's doc) over a kernel input `data`,
    padded by the block `pad` if there is one, as a `Match`; None if it is neither."""
    from tvm import tirx

    iters = [(v.var, int(v.dom.extent), int(v.iter_type)) for v in block.iter_vars]
    kinds = [t for _, _, t in iters]
    if kinds not in ([0, 0, 0, 0, 2, 2], [0, 0, 0, 0, 2, 2, 2]):
        return None
    (n, _, _), (f, co, _), (y, _, _), (x, _, _) = iters[:4]
    (r, kh, _), (q, kw, _) = iters[-2:]
    reads = {name: (index, buffer) for name, index, buffer in _accesses(block)}
    reads.pop(block.writes[0].source.name, None)
    if pad is not None:  # the block reads the padded input, which `pad` makes from a kernel input
        read, data = pad.writes[0].source.name, params.get(pad.reads[0].source.name)
    else:  # the block reads a kernel input, the one indexed by the batch axis first
        read = next((name for name, (index, _) in reads.items() if index[:1] == [{n.name: 1}]), "")
        data = params.get(read)
    if data is None or read not in reads or len(data.shape) != 4:
        return None
    index, _ = reads.pop(read)
    shape = [int(d) for d in data.shape]
    pad_h = _padding(pad, shape) if pad is not None else 0
    if pad_h is None:
        return None
    stride, dilation = (index[2] or {}).get(y.name, 0), (index[2] or {}).get(r.name, 0)
    if index[0] != {n.name: 1} or index[2] != {y.name: stride, r.name: dilation} or \
            index[3] != {x.name: stride, q.name: dilation}:
        return None
    window = {"N": shape[0], "H": shape[2], "W": shape[3], "KH": kh, "KW": kw, "stride": stride, "pad": pad_h,
              "dtype": _dtype(data)}
    if len(iters) == 6:  # a pooling: one input, max or sum over the window
        value = block.body.value if isinstance(block.body, tirx.BufferStore) else None
        kind = "max" if isinstance(value, tirx.Max) else "avg" if isinstance(value, tirx.Add) else None
        if reads or kind is None or index[1] != {f.name: 1} or dilation != 1:
            return None
        return "pool2d", {**window, "C": shape[1], "kind": kind}, ()
    (weight_name, (weight_index, weight)), = reads.items()
    (c, cig, _) = iters[4]
    if weight_name not in params or weight_index != [{f.name: 1}, {c.name: 1}, {r.name: 1}, {q.name: 1}] or \
            _dtype(weight) != _dtype(data):
        return None
    ci = shape[1]
    if cig == ci:  # every input channel: a plain convolution
        if index[1] != {c.name: 1}:
            return None
        return "conv2d_nchw", {**window, "CI": ci, "CO": co, "dilation": dilation}, ()
    groups = ci // cig
    if ci % cig or co % groups or dilation != 1 or not _is_group_channel(block, read, f, c, co // groups, cig):
        return None
    if cig == 1:  # its reduction loop over a group's one input channel fused into the window's rows
        return "depthwise_conv2d_nchw", {**window, "C": ci, "multiplier": co // ci}, ((4, 2),)
    return "group_conv2d_nchw", {**window, "CI": ci, "CO": co, "groups": groups}, ()


def _padding(pad: Any, shape: list[int]) -> int | None:
    """The padding `pad` adds on every side of an NCHW input of `shape`, None unless it is the
    same on all four sides of the last two axes."""
    padded = [int(d) for d in pad.writes[0].source.shape]
    if len(pad.reads) != 1 or padded[:2] != shape[:2] or (padded[2] - shape[2]) % 2:
        return None
    amount = (padded[2] - shape[2]) // 2
    if padded[3] - shape[3] != 2 * amount:
        return None
    names = [v.var.name for v in pad.iter_vars]
    index = [_affine(rng.min) for rng in pad.reads[0].region]
    shifted = [{names[i]: 1, "": -amount} if amount else {names[i]: 1} for i in (2, 3)]
    expected = [{names[0]: 1}, {names[1]: 1}, *shifted]
    return amount if index == expected else None


def _is_group_channel(block: Any, read: str, f: Any, c: Any, per_group_out: int, per_group_in: int) -> bool:
    """Whether `block` reads buffer `read` at channel ``f // per_group_out * per_group_in + c`` (a
    grouped convolution's input channel), proven for all `f` and `c` by TVM's arithmetic analyzer."""
    from tvm import tirx
    from tvm.sym import Analyzer

    region = next(r for r in block.reads if r.source.name == read)
    const = lambda v: tirx.const(v, str(region.region[1].min.ty))  # noqa: E731
    expected = tirx.floordiv(f, const(per_group_out)) * const(per_group_in) + c
    return bool(Analyzer().can_prove_equal(region.region[1].min, expected))
