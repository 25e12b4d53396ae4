"""A kernel-tuning farm for Apache TVM.

`Client` submits jobs and follows them; `make_workload` builds the kernels it tunes;
`build` compiles a kernel with the best config of an export. Whole models: `tune_model` tunes
every kernel of a PyTorch or ONNX model, `compile_model` builds it with the farm's records, and
`farm.torch.compile` makes it a drop-in PyTorch module (`torch.compile(..., backend="farm")` too).

The package has two layers: `farm.core` (workloads, spaces, templates, search, cost model;
imported by every other part of the farm) and the user-facing modules beside it (`cli`,
`client`, `predict`, `export`, `build`, `report`, `progress`). The names below are loaded
on first use, so that importing `farm.core` (as `db`, `workers` and `scheduler` do) does not
load the client, the export or TVM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from farm import torch
    from farm.apply import build
    from farm.build_model import CompiledModel, compile_model
    from farm.client import Client, Job, tune_model
    from farm.core.errors import FarmError
    from farm.core.workloads import PRESETS, WORKLOADS, make_workload

_EXPORTS = {
    "build": "farm.apply", "Client": "farm.client", "Job": "farm.client", "FarmError": "farm.core.errors",
    "PRESETS": "farm.core.workloads", "WORKLOADS": "farm.core.workloads", "make_workload": "farm.core.workloads",
    "tune_model": "farm.client", "compile_model": "farm.build_model", "CompiledModel": "farm.build_model",
}
# Submodules loaded on first use as attributes: `farm.torch.compile(...)` after `import farm`.
_SUBMODULES = ("torch",)

__all__ = ["PRESETS", "WORKLOADS", "Client", "CompiledModel", "FarmError", "Job", "build", "compile_model",
           "make_workload", "torch", "tune_model"]


def __getattr__(name: str) -> Any:
    """PEP 562: the public names, imported when first asked for."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"farm.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'farm' has no attribute {name!r}")
    globals()[name] = value
    return value
