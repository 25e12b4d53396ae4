"""Apply tuned configs: build a kernel with the best config of an export.

    lib = farm.build("resnet-last-conv", "cuda", best="best.json")
    lib.export_library("kernel.so")        # loadable by TVM's runtime from C++ or Python

The record used is the fastest one in the export for the same workload (same parameters) and
target kind (and cuda arch). A workload the export does not hold builds with the template's
default config, with a warning that names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from farm.core.space import Config
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.workloads import Workload, make_workload
from farm.export import load
from workers.compiler import compile_module


def _matches(rec: dict[str, Any], task: Task) -> bool:
    target = parse_target(rec["target"])
    same_device = target.kind == task.target.kind and (not target.is_gpu or target.arch == task.target.arch)
    return same_device and make_workload(rec["workload"]["name"], rec["workload"]["params"]).key == task.workload.key


def best_config(task: Task, best: str | Path | dict[str, Any] | None, allow_stale: bool = False) -> Config | None:
    """The config of the fastest matching record of the export `best` (a path or a loaded
    document), or None when it holds none for this task."""
    if best is None:
        return None
    doc = load(best, allow_stale) if not isinstance(best, dict) else best
    records = [r for r in doc["records"] if _matches(r, task)]
    if not records:
        return None
    return task.space.from_json(min(records, key=lambda r: r["latency_us"])["config"])


def build(workload: str | Workload, target: str | dict[str, Any] | TargetSpec, best: str | Path | None = None,
          params: dict[str, Any] | None = None, allow_stale: bool = False) -> Any:
    """Compile `workload` for `target` with the best config of the export `best`.

    Returns TVM's compiled module (`lib["main"](*inputs, output)`, `lib.export_library(path)`),
    its CUDA code compiled as the farm compiled the candidates it measured
    (`workers.compiler.compile_module`).
    Raises FarmError for a bad workload, target or export.
    """
    wl = workload if isinstance(workload, Workload) else make_workload(workload, params)
    task = Task(wl, parse_target(target))
    config = best_config(task, best, allow_stale)
    if config is None:
        config = task.default_config()
        where = f"in {best}" if best is not None else "given (no export)"
        warnings.warn(f"no tuned config for {wl} on {task.target} {where}: building with the default config",
                      stacklevel=2)
    return compile_module(task.schedule(config).mod, task.target)
