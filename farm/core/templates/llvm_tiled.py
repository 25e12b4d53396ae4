"""CPU (llvm) tiling for every workload: conv2d, depthwise conv2d, pooling, grouped conv2d,
matmul, batch matmul.

The classic register-tiled CPU schedule:
- padding inlined; every spatial axis but the batch and every reduction axis split into
  [outer, inner] (`tile_*`); loops ordered spatial outer | reduction outer | reduction inner |
  spatial inner, so each tile of outputs stays in registers / L1 while the reduction streams
  past it;
- the first `parallel_depth` spatial outer loops fused and run in parallel;
- the innermost spatial loop vectorized (`vectorize`);
- the reduction's initialisation split off at the outermost reduction loop
  (`decompose_reduction`: the init is vectorized too and the update loop carries no condition);
- `auto_unroll_max_step` for TVM's unroller, always explicit: LLVM code generation ignores TVM's
  implicit unroll hints, so an `unroll_explicit=0` value would only repeat the configs without
  unrolling;
- the `epilogue` stage (average pooling's division, float16's cast) computed per tile right after the tile's reduction
  (`reverse_compute_at`), while the sums are still in cache.

The batch axis stays whole, outermost (where `parallel_depth` can take it): leaving it out of
the tiling keeps the spaces at thousands to a few hundred thousand configs.
"""

from __future__ import annotations

from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace, SplitKnob
from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    Template,
    annotate_unroll,
    axis_extents,
    has_stage,
    new_schedule,
)
from farm.core.workloads import Workload

# Loop names of the `compute` block, spatial then reduction (see farm.core.workloads).
_CONV = ("n", "f", "y", "x"), ("rc", "ry", "rx")
_WINDOW = ("n", "c", "y", "x"), ("ry", "rx")
_AXES = {
    "conv2d_nchw": _CONV,
    "depthwise_conv2d_nchw": _WINDOW,
    "pool2d": _WINDOW,
    "group_conv2d_nchw": _CONV,
    "matmul": (("i", "j"), ("k",)),
    "batch_matmul": (("b", "i", "j"), ("k",)),
}
_UNTILED = ("n", "b")  # the batch axes


class LlvmTiled(Template, name="llvm.tiled", kind="llvm", workloads=tuple(_AXES)):
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        spatial, reduce = _AXES[wl.name]
        extents = axis_extents(wl, spatial + reduce)
        tiled = [a for a in spatial + reduce if a not in _UNTILED]
        return ConfigSpace([
            *[SplitKnob(f"tile_{a}", extents[a], 2) for a in tiled],
            ChoiceKnob("parallel_depth", list(range(1, len(spatial) + 1))),
            ChoiceKnob("vectorize", [0, 1]),
            ChoiceKnob("auto_unroll_max_step", [0, 16, 64, 512]),
        ])

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        spatial, reduce = _AXES[wl.name]
        sch = new_schedule(wl)
        if has_stage(sch, wl, "pad"):
            sch.compute_inline(sch.get_sblock(wl.stage("pad")))
        block = sch.get_sblock(wl.stage("compute"))
        loops = dict(zip(spatial + reduce, sch.get_loops(block), strict=True))
        outer: dict[str, list[Any]] = {"spatial": [], "reduce": []}
        inner: dict[str, list[Any]] = {"spatial": [], "reduce": []}
        for group, axes in (("spatial", spatial), ("reduce", reduce)):
            for a in axes:
                if a in _UNTILED:
                    outer[group].append(loops[a])
                else:
                    o, i = sch.split(loops[a], list(config[f"tile_{a}"]))
                    outer[group].append(o)
                    inner[group].append(i)
        sch.reorder(*outer["spatial"], *outer["reduce"], *inner["reduce"], *inner["spatial"])

        epilogue = sch.get_sblock(wl.stage("epilogue")) if has_stage(sch, wl, "epilogue") else None
        if epilogue is not None:
            # Unit loops kept, so the epilogue's innermost loop is always its own (x) loop.
            sch.reverse_compute_at(epilogue, outer["spatial"][-1], preserve_unit_loops=True)
        depth = config["parallel_depth"]
        par = sch.fuse(*outer["spatial"][:depth]) if depth > 1 else outer["spatial"][0]
        sch.parallel(par)
        if config["vectorize"]:
            sch.vectorize(inner["spatial"][-1])
            if epilogue is not None:
                sch.vectorize(sch.get_loops(epilogue)[-1])
        # Last: once the init is split off, the update block is no longer a reduction block
        # and `parallel` and `vectorize` refuse the loops around it.
        sch.decompose_reduction(block, outer["reduce"][0])
        # Always explicit: TVM's LLVM codegen ignores the implicit form (an unroll hint) and warns.
        annotate_unroll(sch, par, config["auto_unroll_max_step"], explicit=1)
        return sch
