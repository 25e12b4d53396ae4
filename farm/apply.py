"""Apply tuned configs: build a kernel with the best config of an export.

    lib = farm.build("resnet-last-conv", "cuda", best="best.json")
    lib.export_library("kernel.so")        # loadable by TVM's runtime from C++ or Python

The record used is the fastest one in the export for the same workload (same parameters) and
target kind (and cuda arch), built with the template that tuned it. A workload the export does not
hold builds with its template's default config, with a warning that names it.
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


def _matches(rec: dict[str, Any], wl: Workload, target: TargetSpec) -> bool:
    spec = parse_target(rec["target"])
    same_device = spec.kind == target.kind and (not spec.is_gpu or spec.arch == target.arch)
    return same_device and make_workload(rec["workload"]["name"], rec["workload"]["params"]).key == wl.key


def best_record(wl: Workload, target: TargetSpec, best: str | Path | dict[str, Any] | None,
                allow_stale: bool = False) -> dict[str, Any] | None:
    """The fastest record of the export `best` (a path or a loaded document) for `wl` on `target`'s
    kind (and cuda arch), whichever template tuned it; None when it holds none."""
    if best is None:
        return None
    doc = load(best, allow_stale) if not isinstance(best, dict) else best
    records = [r for r in doc["records"] if _matches(r, wl, target)]
    return min(records, key=lambda r: r["latency_us"]) if records else None


def best_config(task: Task, best: str | Path | dict[str, Any] | None, allow_stale: bool = False) -> Config | None:
    """The config of the fastest record of the export `best` for this task (its template's), or
    None when it holds none."""
    rec = best_record(task.workload, task.target, best, allow_stale)
    return task.config_from_json(rec["config"]) if rec is not None and rec["template"] == task.template.name else None


def build(workload: str | Workload, target: str | dict[str, Any] | TargetSpec, best: str | Path | None = None,
          params: dict[str, Any] | None = None, allow_stale: bool = False) -> Any:
    """Compile `workload` for `target` with the best config of the export `best`.

    Returns TVM's compiled module (`lib["main"](*inputs, output)`, `lib.export_library(path)`),
    its CUDA code compiled as the farm compiled the candidates it measured
    (`workers.compiler.compile_module`).
    Raises FarmError for a bad workload, target or export.
    """
    wl = workload if isinstance(workload, Workload) else make_workload(workload, params)
    spec = parse_target(target)
    rec = best_record(wl, spec, best, allow_stale)
    task = Task(wl, spec, rec["template"] if rec is not None else None)
    config = task.config_from_json(rec["config"]) if rec is not None else None
    if config is None:
        config = task.default_config()
        where = f"in {best}" if best is not None else "given (no export)"
        warnings.warn(f"no tuned config for {wl} on {task.target} {where}: building with the default config",
                      stacklevel=2)
    return compile_module(task.schedule(config).mod, task.target)
