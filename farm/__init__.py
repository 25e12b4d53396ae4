"""A kernel-tuning farm for Apache TVM.

`Client` submits jobs and follows them; `make_workload` builds the kernels it tunes.
"""

from farm.client import Client, Job
from farm.errors import FarmError
from farm.workloads import PRESETS, WORKLOADS, make_workload

__all__ = ["PRESETS", "WORKLOADS", "Client", "FarmError", "Job", "make_workload"]
