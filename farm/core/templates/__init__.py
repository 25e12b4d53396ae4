"""Templates by (workload, target). `get_template` is the one lookup everything uses."""

from __future__ import annotations

from farm.core.errors import FarmError
from farm.core.targets import TargetSpec, parse_target
from farm.core.templates.base import Template
from farm.core.templates.cuda_depthwise import CudaDepthwise
from farm.core.templates.cuda_pool import CudaPool
from farm.core.templates.cuda_tensorcore import CudaTensorCore
from farm.core.templates.cuda_tiled import CudaTiled
from farm.core.templates.cuda_wgmma import CudaWgmma
from farm.core.templates.llvm_tiled import LlvmTiled
from farm.core.workloads import Workload

# In order of preference: the first that applies to a workload schedules it (tensor cores, where
# the dtype, shape and arch allow them, before CUDA cores; Hopper's wgmma where the target is
# sm_90a, before WMMA).
TEMPLATES: list[Template] = [CudaWgmma(), CudaTensorCore(), CudaTiled(), CudaDepthwise(), CudaPool(), LlvmTiled()]


def get_template(workload: Workload, target: TargetSpec | str) -> Template:
    """The template for `workload` on `target` (a kind alone means its default target, e.g.
    ``cuda``: sm_90); FarmError if there is none."""
    spec = parse_target(target)
    for template in TEMPLATES:
        if (template.kind == spec.kind and workload.name in template.workloads
                and template.applies(workload, spec)):
            return template
    raise FarmError(f"no {spec.kind} template for workload {workload.name!r}")


__all__ = ["TEMPLATES", "Template", "get_template"]
