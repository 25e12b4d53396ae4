"""A kernel-tuning farm for Apache TVM.

`Client` submits jobs and follows them; `make_workload` builds the kernels it tunes;
`build` compiles a kernel with the best config of an export.

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
    from farm.apply import build
    from farm.client import Client, Job
    from farm.core.errors import FarmError
    from farm.core.workloads import PRESETS, WORKLOADS, make_workload

_EXPORTS = {
    "build": "farm.apply", "Client": "farm.client", "Job": "farm.client", "FarmError": "farm.core.errors",
    "PRESETS": "farm.core.workloads", "WORKLOADS": "farm.core.workloads", "make_workload": "farm.core.workloads",
}

__all__ = ["PRESETS", "WORKLOADS", "Client", "FarmError", "Job", "build", "make_workload"]


def __getattr__(name: str) -> Any:
    """PEP 562: the public names, imported when first asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
