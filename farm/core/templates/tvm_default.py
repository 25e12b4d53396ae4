"""The schedule TVM gives a kernel untuned: what a model's build uses for a kernel without a record.

Relax's GPU builds schedule every PrimFunc that no tuning record scheduled with DLight's default
rules (`default_gpu_rules`, as `farm.build_model` applies them); CPU builds lower it as written.
`default_schedule` makes that schedule of one workload as an `s_tir.Schedule`, whose trace a
MetaSchedule database replays like a tuned config's, so that a task can measure it as its
baseline (`farm.core.task.Task.baseline_index`) and a model keep it where no config beats it.
"""

from __future__ import annotations

from typing import Any

from farm.core.errors import FarmError
from farm.core.targets import TargetSpec
from farm.core.templates.base import new_schedule
from farm.core.workloads import Workload


def default_gpu_rules() -> list[Any]:
    """DLight's rules in the order Relax's default GPU pipeline tries them: the first that applies
    to a function schedules it."""
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def default_schedule(wl: Workload, target: TargetSpec) -> Any:
    """The workload's function as TVM schedules it untuned for `target`: by the first of
    `default_gpu_rules` that applies on GPUs, unscheduled elsewhere (its trace only looks its
    blocks up: MetaSchedule's databases return no record of an empty trace, and a record of this
    one schedules nothing). FarmError where no rule applies (a model's build would then fail on
    the kernel too)."""
    sch = new_schedule(wl)
    if not target.is_gpu:
        sch.get_child_blocks(sch.get_sblock("root"))
        return sch
    func, tvm_target = sch.mod["main"], target.tvm()
    with tvm_target:
        for rule in default_gpu_rules():
            scheduled = rule.apply(func, tvm_target, False)
            if scheduled is not None:
                return scheduled if not isinstance(scheduled, list) else scheduled[0]
    raise FarmError(f"none of DLight's default GPU rules schedules {wl}")
