"""The output check that runs where the kernel runs: no output crosses the RPC link.

Every candidate's output is poisoned with NaN before it runs and compared with the NumPy
reference after. Done on the host, that moves the whole output over TVM RPC twice per
candidate (51 MB each way for a 64x64x112x112 max pool: seconds per candidate). Instead the
runner uploads the reference once per session and calls two small kernels of this module:

- `fill(out)`: writes NaN into every element of the output (an unwritten element stays NaN); an
  integer output (a model's mask or index kernel) has no NaN: it gets its type's largest value
  (a boolean, true), which an unwritten element keeps and the reference rarely holds;
- `check(out, ref, err)`: err[0] = sum((out - ref)^2), err[1] = sum(ref^2), in float64.

The relative L2 error is sqrt(err[0] / err[1]); a NaN or infinity anywhere in the output makes
err[0] NaN or infinite, so the candidate fails, as the host comparison did. On cuda each sum is
one block's cross-thread reduction (memory-bound: a few ms for 100 MB); on llvm a plain loop.
"""

from __future__ import annotations

import math
from typing import Any

from farm.core.targets import TargetSpec
from farm.core.workloads import Workload

# Threads of the one block that reduces each sum on a GPU.
_THREADS = 1024


def checker_module(workload: Workload, target: TargetSpec) -> Any:
    """The IRModule with `fill` and `check` for the workload's output, scheduled for `target`."""
    import tvm
    from tvm import s_tir, te, tirx

    shape, dtype = workload.output_shape(), workload.dtype
    out = te.placeholder(shape, dtype, name="out")
    ref = te.placeholder(shape, dtype, name="ref")
    axes = [te.reduce_axis((0, n), f"k{i}") for i, n in enumerate(shape)]

    def squared(x: Any) -> Any:
        return x * x

    def sums(i: Any) -> Any:
        at = [a.var for a in axes]
        got, want = out[tuple(at)].astype("float64"), ref[tuple(at)].astype("float64")
        return te.sum(tirx.Select(i == 0, squared(got - want), squared(want)), axis=axes)

    err = te.compute((2,), sums, name="err")
    nan = te.compute(shape, lambda *i: _unwritten(dtype), name="nan")
    mod = tvm.IRModule({"check": te.create_prim_func([out, ref, err]).with_attr("global_symbol", "check"),
                        "fill": te.create_prim_func([nan]).with_attr("global_symbol", "fill")})
    if not target.is_gpu:
        return mod
    sch = s_tir.Schedule(mod)
    sch.work_on("check")
    block = sch.get_sblock("err")
    i, *reduce = sch.get_loops(block)
    _, thread = sch.split(sch.fuse(*reduce), [None, _THREADS])
    sch.bind(i, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    sch.work_on("fill")
    block = sch.get_sblock("nan")
    outer, thread = sch.split(sch.fuse(*sch.get_loops(block)), [None, _THREADS])
    sch.bind(outer, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    return sch.mod


def _unwritten(dtype: str) -> Any:
    """What `fill` writes into an output of `dtype` (module docstring)."""
    from tvm import tirx

    if dtype.startswith(("float", "bfloat")):
        return tirx.const(math.nan, dtype)
    return tirx.const(True, dtype) if dtype == "bool" else tirx.max_value(dtype)


def relative_error(err: Any) -> float:
    """sqrt(err[0] / err[1]) from `check`'s output (NaN when the output held NaN)."""
    diff, norm = (float(x) for x in err)
    if not math.isfinite(diff):
        return math.nan
    return math.sqrt(diff) / (math.sqrt(norm) or 1.0)
