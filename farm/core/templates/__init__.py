"""Templates by (workload, target kind). `get_template` is the one lookup everything uses."""

from __future__ import annotations

from farm.core.errors import FarmError
from farm.core.templates.base import Template
from farm.core.templates.cuda_depthwise import CudaDepthwise
from farm.core.templates.cuda_pool import CudaPool
from farm.core.templates.cuda_tiled import CudaTiled
from farm.core.templates.llvm_tiled import LlvmTiled

TEMPLATES: list[Template] = [CudaTiled(), CudaDepthwise(), CudaPool(), LlvmTiled()]


def get_template(workload: str, kind: str) -> Template:
    """The template for `workload` on target `kind`; FarmError if there is none."""
    for template in TEMPLATES:
        if template.kind == kind and workload in template.workloads:
            return template
    raise FarmError(f"no {kind} template for workload {workload!r}")


__all__ = ["TEMPLATES", "Template", "get_template"]
