"""CUDA pooling (max and average): one thread per output element, as in d2ltvm's GPU pooling
chapter (../shared/references/d2ltvm-pooling-gpu.txt).

Padding is inlined; the output's four axes are fused and split into
[blocks, per_thread, threads], bound to blockIdx.x / (serial) / threadIdx.x. The per-thread
loop sits outside the thread loop, so at each step consecutive threads write consecutive
outputs (coalesced). The window reduction runs in a register: for average pooling the sum
stage (`compute`) is computed at the `epilogue` stage's (the division's) thread loop in local scope (d2ltvm's
compute_at); for max pooling `cache_output` chooses between accumulating in a register
(1) and in the output itself (0, d2ltvm's max schedule). Pooling is memory-bound, so the
rest of the space is the block size (`threads`) and unrolling (`auto_unroll_max_step`,
`unroll_explicit`, which reach the window loops and the per-thread loop).

With threads=1024 (d2ltvm's max_num_threads), per_thread=1 and no unrolling this is exactly
d2ltvm's schedule_max / schedule_avg.
"""

from __future__ import annotations

from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace, Knob
from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    Template,
    annotate_unroll,
    has_stage,
    new_schedule,
    split_skipping_units,
)
from farm.core.workloads import Workload


class CudaPool(Template, name="cuda.pool", kind="cuda", workloads=("pool2d",)):
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        knobs: list[Knob] = [
            ChoiceKnob("threads", [32, 64, 128, 256, 512, 1024]),
            ChoiceKnob("per_thread", [1, 2, 4, 8]),
        ]
        if wl.p["kind"] == "max":  # average pooling always sums in a register
            knobs.append(ChoiceKnob("cache_output", [0, 1]))
        return ConfigSpace([
            *knobs,
            ChoiceKnob("auto_unroll_max_step", [0, 16, 64, 512]),
            ChoiceKnob("unroll_explicit", [0, 1]),
        ])

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        if config["threads"] > target.limit("max_threads_per_block"):
            return f"{config['threads']} threads per block > {target.limit('max_threads_per_block')}"
        return None

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        sch = new_schedule(wl)
        if has_stage(sch, wl, "pad"):
            sch.compute_inline(sch.get_sblock(wl.stage("pad")))
        pool = sch.get_sblock(wl.stage("compute"))
        if has_stage(sch, wl, "epilogue"):
            out = sch.get_sblock(wl.stage("epilogue"))
            sch.set_scope(pool, 0, "local")
        elif config["cache_output"]:
            out = sch.cache_write(pool, 0, "local")
        else:
            out, pool = pool, None
        fused = sch.fuse(*sch.get_loops(out)[:4])
        # Split with the block count inferred: a tail is guarded, not rounded to a divisor.
        bx, _, tx = split_skipping_units(
            sch, fused, [None, config["per_thread"], config["threads"]], keep=(0, 2)
        )
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        if pool is not None:
            sch.compute_at(pool, tx)
        annotate_unroll(sch, bx, config["auto_unroll_max_step"], config["unroll_explicit"])
        return sch
