"""Templates by (workload, target kind). `get_template` is the one lookup everything uses."""

from __future__ import annotations

from farm.core.errors import FarmError
from farm.core.templates.base import Template
from farm.core.templates.cuda_depthwise import CudaDepthwise
from farm.core.templates.cuda_pool import CudaPool
from farm.core.templates.cuda_tensorcore import CudaTensorCore
from farm.core.templates.cuda_tiled import CudaTiled
from farm.core.templates.llvm_tiled import LlvmTiled
from farm.core.workloads import Workload

# In order of preference: the first that applies to a workload schedules it (tensor cores, where
# the dtype and shape allow them, before CUDA cores).
TEMPLATES: list[Template] = [CudaTensorCore(), CudaTiled(), CudaDepthwise(), CudaPool(), LlvmTiled()]


def get_template(workload: Workload, kind: str) -> Template:
    """The template for `workload` on target `kind`; FarmError if there is none."""
    for template in TEMPLATES:
        if template.kind == kind and workload.name in template.workloads and template.applies(workload):
            return template
    raise FarmError(f"no {kind} template for workload {workload.name!r}")


__all__ = ["TEMPLATES", "Template", "get_template"]
