"""A kernel-tuning farm for Apache TVM.

`Client` submits jobs and follows them; `make_workload` builds the kernels it tunes;
`build` compiles a kernel with the best config of an export.
"""

from farm.build import build
from farm.client import Client, Job
from farm.errors import FarmError
from farm.workloads import PRESETS, WORKLOADS, make_workload

__all__ = ["PRESETS", "WORKLOADS", "Client", "FarmError", "Job", "build", "make_workload"]
