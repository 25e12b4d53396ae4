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
from farm.core.templates.design_space import CudaDesignSpace, LlvmDesignSpace
from farm.core.templates.llvm_tiled import LlvmTiled
from farm.core.workloads import Workload

# In order of preference: the first that applies to a workload schedules it (tensor cores, where
# the dtype, shape and arch allow them, before CUDA cores; Hopper's wgmma where the target is
# sm_90a, before WMMA).
TEMPLATES: list[Template] = [CudaWgmma(), CudaTensorCore(), CudaTiled(), CudaDepthwise(), CudaPool(), LlvmTiled(),
                             CudaDesignSpace(), LlvmDesignSpace()]


def get_template(workload: Workload, target: TargetSpec | str) -> Template:
    """The template for `workload` on `target` (a kind alone means its default target, e.g.
    ``cuda``: sm_90); FarmError if there is none."""
    spec = parse_target(target)
    for template in TEMPLATES:
        if (template.kind == spec.kind and workload.name in template.workloads
                and template.applies(workload, spec)):
            return template
    raise FarmError(f"no {spec.kind} template for workload {workload.name!r}")


def templates_for(workload: Workload, target: TargetSpec | str) -> list[tuple[Workload, Template]]:
    """Every template that schedules `workload` on `target`, in order of preference, each with the
    workload it schedules: a TIR kernel whose main computation is one of the farm's operators
    (farm.core.fused) first gets that operator's hand templates, scheduling the kernel as a
    FusedOperator, then its design space; but a float16 one whose hand template would compute on
    CUDA cores gets its design space first, where the GPU has tensor cores. FarmError if none does."""
    from farm.core.fused import match_operator
    from farm.core.tir import TirWorkload

    spec = parse_target(target)
    fused = match_operator(workload) if isinstance(workload, TirWorkload) else None
    out = [(wl, t) for wl in ([fused] if fused is not None else []) + [workload] for t in TEMPLATES
           if t.kind == spec.kind and wl.name in t.workloads and t.applies(wl, spec)]
    if not out:
        raise FarmError(f"no {spec.kind} template for workload {workload.name!r}")
    if fused is not None and fused.dtype == "float16" and out[0][1].name in CUDA_CORE_PRODUCTS \
            and spec.compute_capability >= TENSOR_CORE_CAPABILITY:
        # Tensor cores before CUDA cores: the design space's sketches use them (MetaSchedule's
        # tensor-core tiling takes 16-bit types from sm_70 on), the hand template would not.
        out = [item for item in out if item[0] is workload] + [item for item in out if item[0] is not workload]
    return out


# The hand templates of matrix products and convolutions on CUDA cores: a float16 TIR kernel they
# would take goes to its design space first (templates_for).
CUDA_CORE_PRODUCTS = ("cuda.tiled",)
TENSOR_CORE_CAPABILITY = 70
# Arch-specific variants (CUDA's "a" suffix) that unlock a template the portable arch cannot use:
# sm_90a's wgmma. A target asks for them itself, since their kernels run on that one arch only.
ARCH_SPECIFIC = {"sm_90": "sm_90a"}
# The workloads whose arch-specific template was measured faster than the portable one, the only
# ones the hint names it for: cuda.wgmma's float16 matmuls. Its convolutions were slower than
# WMMA's (docs/defaults.md#wgmma-convolutions).
HINTED = {"cuda.wgmma": ("matmul",)}


def arch_specific_hint(workload: Workload, target: TargetSpec | str) -> str | None:
    """One line for the user where `target`'s arch-specific variant would tune `workload` with
    another template (a float16 matmul on sm_90 gets WMMA, on sm_90a wgmma); None otherwise."""
    spec = parse_target(target)
    variant = ARCH_SPECIFIC.get(spec.arch) if spec.kind == "cuda" else None
    if variant is None:
        return None
    current, better = get_template(workload, spec), get_template(workload, parse_target({**spec.doc, "arch": variant}))
    if better.name == current.name or workload.name not in HINTED.get(better.name, ()):
        return None
    return (f"hint: --target '{{\"kind\": \"cuda\", \"arch\": \"{variant}\"}}' tunes this kernel with "
            f"{better.name} instead of {current.name} (kernels built for {variant} run on {spec.arch} GPUs alone)")


__all__ = ["ARCH_SPECIFIC", "CUDA_CORE_PRODUCTS", "HINTED", "TEMPLATES", "TENSOR_CORE_CAPABILITY", "Template",
           "arch_specific_hint", "get_template", "templates_for"]
