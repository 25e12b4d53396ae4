"""The template interface: a config space per (workload, target) and a schedule per config.

A template is a pure function of (workload, target, config): `space` lists the knobs,
`check` rejects configs that cannot run (too many threads, too much shared memory, too many
vthreads) without compiling anything, and `schedule` returns the scheduled `s_tir.Schedule`.
Its `version` is a hash of the template's source, so a config tuned against an older template
is never applied silently to a changed one.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, ClassVar

from farm.space import Config, ConfigSpace
from farm.targets import TargetSpec
from farm.workloads import Workload


class Template(ABC):
    """A tunable schedule for some workloads on one target kind."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "cuda" or "llvm"
    workloads: ClassVar[tuple[str, ...]]

    @abstractmethod
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        """The knobs for this workload's shape (a pure function of its arguments)."""

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        """None if `config` may run on `target`, else why not (checked before building)."""
        return None

    @abstractmethod
    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        """The `tvm.s_tir.Schedule` of `wl` with `config` applied."""

    @cached_property
    def version(self) -> str:
        """Hash of the source of the module that defines this template and of this base."""
        text = inspect.getsource(sys.modules[type(self).__module__])
        text += inspect.getsource(sys.modules[__name__])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def new_schedule(wl: Workload) -> Any:
    """A fresh schedule of the workload's TE definition (stage names per farm.workloads)."""
    import tvm
    from tvm import s_tir, te

    func = te.create_prim_func(wl.build_te())
    return s_tir.Schedule(tvm.IRModule({"main": func}))


def has_block(sch: Any, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # s_tir raises a ScheduleError subclass of TVMError
        return False
    return True


def loop_extents(sch: Any, block: Any) -> list[int]:
    return [int(sch.get(loop).extent) for loop in sch.get_loops(block)]


def annotate_unroll(sch: Any, loop: Any, max_step: int, explicit: int) -> None:
    """Ask TVM's unroller to unroll loops under `loop` up to `max_step` iterations."""
    if max_step > 0:
        sch.annotate(loop, "pragma_auto_unroll_max_step", max_step)
        sch.annotate(loop, "pragma_unroll_explicit", explicit)


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "float16": 2}[dtype]


def prod(xs: Any) -> int:
    return math.prod(int(x) for x in xs)
