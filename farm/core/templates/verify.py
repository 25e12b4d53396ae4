"""GPU-code verification of a scheduled module, before it is compiled or sent to a GPU.

`verify_gpu` lowers the module with the same pipeline `tvm.compile` uses for the target (so what
it checks is the code that would be generated), then runs TVM's `verify_gpu_code` on every
device kernel with the limits MetaSchedule's VerifyGPUCode postprocessor uses plus CUDA's
per-dimension block limits, and checks the grid limits CUDA enforces at launch time (which TVM
does not check). Virtual threads are lowered away before verification, as in MetaSchedule, so
`max_vthread` never fires: templates bound vthreads in their `check`. It also rejects a kernel
whose asynchronous copies (a `pipeline` stage, base.PIPELINE) move strided vectors: TVM 0.27's
``cp.async`` injection would copy them contiguously (base.compile_scheduled).
"""

from __future__ import annotations

import math
import re
from typing import Any

from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    CUDA_MAX_BLOCK_DIM,
    CUDA_MAX_GRID_DIM,
    DEFAULT_PIPELINE,
    register_default_pipeline,
    shared_memory_error,
    statements,
    tir_pipeline,
)


def lower(mod: Any, target: TargetSpec) -> Any:
    """`mod` after the TIR pipeline `tvm.compile` runs on it for `target` (its own, where it names
    one: base.tir_pipeline): host and device functions split, each with its `target` attribute
    (the steps of `tvm.tirx.build` before code generation). Lowered in TVM's default pass
    context, without base.compile_scheduled's ``cp.async`` injection: the copies it would inject
    stay visible as stores in ``async_scope`` attributes (`_strided_async_copy`); nothing else
    `verify_gpu` checks depends on it."""
    import tvm

    tvm_target = target.tvm()
    host = tvm.target.Target("llvm")
    mod = tvm.tirx.transform.BindTarget(tvm_target.with_host(host))(mod)
    pipeline, _, _ = tvm.tirx.get_tir_pipeline(register_default_pipeline(tir_pipeline(mod)))
    with tvm.transform.PassContext():
        return pipeline(mod)


def constraints(target: TargetSpec) -> dict[str, int]:
    """The limits `verify_gpu_code` checks, for `target`. Its shared memory bound is the opt-in
    one: it counts static and dynamic shared memory alike, and `verify_gpu` applies the rule
    that tells them apart (base.shared_memory_error)."""
    return {
        "max_threads_per_block": target.limit("max_threads_per_block"),
        "max_shared_memory_per_block": target.max_shared_memory_optin,
        "max_vthread": target.max_vthreads,
        "max_vector_bytes": 16,  # one 128-bit load/store
        **{f"max_thread_{d}": n for d, n in CUDA_MAX_BLOCK_DIM.items()},
    }


def verify_gpu(mod: Any, target: TargetSpec) -> str | None:
    """None if the scheduled IRModule `mod` lowers for `target` and every kernel fits its limits
    (threads per block and per dimension, shared memory, vector width, grid size); otherwise a
    one-line reason. Non-GPU targets have nothing to verify (None). Never raises for a bad
    schedule: a module TVM cannot lower is a reason too."""
    if not target.is_gpu:
        return None
    from tvm import s_tir

    try:
        lowered = lower(mod, target)
    except Exception as e:  # a schedule TVM cannot lower is data for the caller, not a crash
        return f"lowering failed: {_last_line(e)}"
    limits = constraints(target)
    for gvar, func in lowered.functions.items():
        func_target = func.attrs.get("target") if func.attrs is not None else None
        if func_target is None or func_target.kind.name != target.kind:
            continue  # host code
        if not s_tir.analysis.verify_gpu_code(func, limits):
            return f"kernel {gvar.name_hint}: {_violation(func, limits)}"
        allocated = s_tir.analysis.calculate_allocated_bytes(func)["main"]
        static, dynamic = int(allocated.get("shared", 0)), int(allocated.get("shared.dyn", 0))
        if (reason := shared_memory_error(static, target, dynamic)) is not None:
            return f"kernel {gvar.name_hint}: {reason}"
        if (reason := _strided_async_copy(func.body)) is not None:
            return f"kernel {gvar.name_hint}: {reason}"
    # A kernel written in TIRx binds no loops to blockIdx: its template's `check` bounds its grid.
    return _grid_violation(mod) if tir_pipeline(mod) == DEFAULT_PIPELINE else None


def shared_allocations(lowered: Any) -> dict[tuple[str, str], tuple[int, int]] | None:
    """{(kernel, buffer): (elements, bytes per element)} of the static shared buffers of every
    device kernel of the `lower`ed module; None if one uses dynamic shared memory."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for gvar, func in lowered.functions.items():
        for stmt in statements(func.body):
            buffer = getattr(stmt, "buffer", None) if type(stmt).__name__ == "AllocBuffer" else None
            if buffer is None or not buffer.scope().startswith("shared"):
                continue
            if buffer.scope() != "shared":
                return None
            out[(gvar.name_hint, buffer.name)] = (math.prod(int(d) for d in buffer.shape), itemsize(str(buffer.dtype)))
    return out


def itemsize(dtype: str) -> int:
    """Bytes of one element of `dtype` (``float16``, ``float32x4``; ``bool``: 1)."""
    bits = re.search(r"\d+", dtype.split("x")[0])
    lanes = int(dtype.split("x")[1]) if "x" in dtype else 1
    return max(1, (int(bits.group()) if bits else 8) * lanes // 8)


def _violation(func: Any, limits: dict[str, int]) -> str:
    """TVM's own words for what `verify_gpu_code` rejected in `func` (its pass form raises them)."""
    import tvm

    verify_pass = tvm.get_global_func("s_tir.transform.VerifyGPUCode")
    try:
        verify_pass(limits)(tvm.IRModule({"main": func}))
    except Exception as e:
        # "GPU constraint(s) violated:\n    <one line per violation>\n  In function\n<the TIR>"
        lines = [ln.strip() for ln in str(e).splitlines()]
        start = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("GPU constraint")), 0)
        found = []
        for ln in lines[start:]:
            if not ln or ln.startswith("In function"):
                break
            found.append(ln.rstrip(";"))
        if found:
            return "; ".join(found)
    return "GPU constraints violated"


def _strided_async_copy(body: Any) -> str | None:
    """Why an asynchronous copy in the lowered kernel `body` would be miscompiled, if one would:
    a store into shared memory, in an ``async_scope``, whose index or whose source's index is a
    vector of stride other than 1. TVM's ``cp.async`` injection takes only such a vector's base,
    so the copy would move contiguous elements instead (InjectPTXAsyncCopy, TVM 0.27)."""
    import tvm
    from tvm import tirx

    for scope in statements(body):
        if not (isinstance(scope, tirx.AttrStmt) and scope.attr_key == "async_scope"):
            continue
        for store in statements(scope.body):
            if not (isinstance(store, tirx.BufferStore) and store.buffer.scope().startswith("shared")):
                continue
            value = store.value
            if isinstance(value, tvm.ir.Call) and len(value.args) == 3:  # if_then_else(in bounds, load, 0)
                value = value.args[1]
            indices = [store.indices[-1]] + ([value.indices[-1]] if isinstance(value, tvm.ir.TensorLoad) else [])
            for index in indices:
                ramp = index.a if isinstance(index, tirx.Add) else index  # Add: a base in merged shared memory
                unit = isinstance(ramp, tirx.Ramp) and isinstance(ramp.stride, tirx.IntImm) and ramp.stride.value == 1
                if isinstance(ramp, tirx.Ramp) and not unit:
                    return (f"an asynchronous copy into {store.buffer.name} moves vectors of stride {ramp.stride}, "
                            "which TVM's cp.async lowering would copy contiguously")
    return None


def _grid_violation(mod: Any) -> str | None:
    """Why a loop bound to ``blockIdx`` in the scheduled `mod` exceeds CUDA's grid size, if one does."""
    from tvm import s_tir

    sch = s_tir.Schedule(mod)
    for gvar in mod.get_global_vars():
        sch.work_on(gvar.name_hint)
        pending = [sch.get_sblock("root")]
        while pending:
            block = pending.pop()
            pending.extend(sch.get_child_blocks(block))
            for loop in sch.get_loops(block):
                node = sch.get(loop)
                tag = node.thread_binding.thread_tag if node.thread_binding is not None else ""
                if tag.startswith("blockIdx.") and int(node.extent) > CUDA_MAX_GRID_DIM[tag[-1]]:
                    return f"{tag} extent {int(node.extent)} > {CUDA_MAX_GRID_DIM[tag[-1]]}"
    return None


def _last_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
