"""The template interface: a config space per (workload, target) and a schedule per config.

A template is a pure function of (workload, target, config): `space` lists the knobs,
`check` rejects configs that cannot run (too many threads, too much shared memory, too many
vthreads) without compiling anything, and `schedule` returns the scheduled `s_tir.Schedule`.
Its module is compiled by TVM's default TIR pipeline unless it names another
(`TIR_PIPELINE_ATTR`: a kernel written in TIRx script is lowered by ``tirx``).
Its `version` is a hash of the template's source, so a config tuned against an older template
is never applied silently to a changed one.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from farm.core.space import Columns, Config, ConfigSpace
from farm.core.targets import TargetSpec
from farm.core.workloads import Workload

# A template's validity rules over `Columns`: for each rule, which configs break it, and why the
# i-th does. `first_error` makes them a `check` of one config, `passing` a precheck of many.
Rules = Iterator[tuple[np.ndarray, Callable[[int], str]]]
# CUDA's limits on each dimension of a thread block and of the grid (compute capability >= 3.0).
CUDA_MAX_BLOCK_DIM = {"x": 1024, "y": 1024, "z": 64}
CUDA_MAX_GRID_DIM = {"x": 2**31 - 1, "y": 65535, "z": 65535}


class Template(ABC):
    """A tunable schedule for some workloads on one target kind.

    A template declares what it is in its class statement:
    ``class CudaPool(Template, name="cuda.pool", kind="cuda", workloads=("pool2d",))``.
    """

    name: ClassVar[str]
    kind: ClassVar[str]  # "cuda" or "llvm"
    workloads: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, name: str, kind: str, workloads: Sequence[str], **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name, cls.kind, cls.workloads = name, kind, tuple(workloads)

    def applies(self, wl: Workload, target: TargetSpec) -> bool:
        """Whether this template can schedule `wl` (one of its `workloads`) for `target`, e.g. its
        dtype and shape, or the target's arch."""
        return True

    @abstractmethod
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        """The knobs for this workload's shape (a pure function of its arguments)."""

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        """None if `config` may run on `target`, else why not (checked before building)."""
        return None

    def precheck(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        """A necessary condition of `check`, cheap enough for every step of a search's annealing
        (microseconds); `check` itself unless the template's check is costly."""
        return self.check(wl, target, config)

    def precheck_columns(self, wl: Workload, target: TargetSpec, configs: Columns) -> np.ndarray | None:
        """`precheck` of many configs at once, True where it passes (exactly, config by config), or
        None where the template has no such form: a search's annealing then prechecks its moves
        one at a time."""
        return None

    @abstractmethod
    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        """The `tvm.s_tir.Schedule` of `wl` with `config` applied."""

    @cached_property
    def version(self) -> str:
        """Hash of the source of the module that defines this template and of this base."""
        text = inspect.getsource(sys.modules[type(self).__module__])
        text += inspect.getsource(sys.modules[__name__])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# The IRModule attribute naming the TIR pipeline (`tvm.compile`'s ``tir_pipeline``) that lowers a
# scheduled module; without it, the farm's (`DEFAULT_PIPELINE`).
TIR_PIPELINE_ATTR = "farm.tir_pipeline"
# TVM's default TIR pipeline, with options per kernel (`lowering_options`): the one that lowers
# every build of a config the farm makes, a tuning candidate's, its verification's and a model's,
# so that a model runs the code that was measured.
DEFAULT_PIPELINE = "farm.default"
# A PrimFunc attribute: lower the kernel with ``tirx.use_async_copy`` on, as `compile_scheduled`
# lowers every candidate (a model's build marks the kernels the farm's records schedule).
ASYNC_COPY_ATTR = "farm.async_copy"


def tir_pipeline(mod: Any) -> str:
    """The TIR pipeline that lowers the scheduled module `mod` (`TIR_PIPELINE_ATTR`)."""
    attrs = mod.attrs
    return str(attrs[TIR_PIPELINE_ATTR]) if attrs is not None and TIR_PIPELINE_ATTR in attrs else DEFAULT_PIPELINE


def statements(stmt: Any) -> Iterator[Any]:
    """`stmt` and every statement nested in it, outermost first, through scheduled blocks too (TVM
    0.27 has no Python visitor for TIR statements)."""
    from tvm import tirx

    yield stmt
    children = list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [
        getattr(stmt, field, None) for field in ("block", "body", "then_case", "else_case")]  # any kind that nests
    for child in children:
        if isinstance(child, tirx.Stmt):
            yield from statements(child)


def needs_plain_storage(func: Any) -> bool:
    """Whether the scheduled PrimFunc `func` must be lowered without TVM's StorageRewrite: where its
    dynamic shared memory holds buffers of more than one type. TVM 0.27's StorageRewrite lets such
    a buffer reuse the memory of one of another type, and a tensor intrinsic's typed pointer into
    it then fails LowerIntrin's check (``tvm_access_ptr element type must match the source
    buffer``): WMMA's store of float32 sums into memory of float16 operands, in every config of a
    float16 convolution that sums in float32. MergeSharedMemoryAllocations, later in the
    pipeline, still lets such buffers share dynamic shared memory."""
    dtypes = {str(buffer.dtype) for stmt in statements(func.body)
              for buffer in getattr(stmt, "alloc_buffers", ()) if buffer.scope() == "shared.dyn"}
    return len(dtypes) > 1


def lowering_options(func: Any) -> dict[str, bool]:
    """The PassContext options `DEFAULT_PIPELINE` lowers the PrimFunc `func` with, beyond its
    caller's: StorageRewrite off where it breaks the kernel (`needs_plain_storage`), asynchronous
    copies where `func` asks for them (`ASYNC_COPY_ATTR`)."""
    options = {"tirx.disable_storage_rewrite": True} if needs_plain_storage(func) else {}
    if func.attrs is not None and func.attrs.get(ASYNC_COPY_ATTR, False):
        options["tirx.use_async_copy"] = True
    return options


def _default_pipeline() -> tuple[Any, Any, Any]:
    """`DEFAULT_PIPELINE`'s factory (TVM's form: the pipeline and its host and device finalizers):
    the module's kernels lowered by TVM's default pipeline in groups of equal `lowering_options`."""
    import tvm
    from tvm import tirx

    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

    @tvm.transform.module_pass(opt_level=0, name=DEFAULT_PIPELINE)
    def lower(mod: Any, ctx: Any) -> Any:
        groups: dict[tuple[tuple[str, bool], ...], dict[Any, Any]] = {}
        for gvar, func in mod.functions.items():
            options = lowering_options(func) if isinstance(func, tirx.PrimFunc) else {}
            groups.setdefault(tuple(sorted(options.items())), {})[gvar] = func
        if not any(groups):  # no kernel with options of its own (or none at all)
            return pipeline(mod)
        # The pipeline names a module's only function its entry (AnnotateEntryFunc): once for the
        # whole module, not again for a group of it that holds one.
        mod = tirx.transform.AnnotateEntryFunc()(mod)
        entries = {gvar.name_hint for gvar, func in mod.functions.items()
                   if func.attrs is not None and func.attrs.get("tirx.is_entry_func", False)}
        lowered = None
        for options, functions in groups.items():
            part = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
            config = {**dict(ctx.config.items()), **dict(options)}
            with tvm.transform.PassContext(opt_level=ctx.opt_level, config=config):
                part = pipeline(part)
            if lowered is None:
                lowered = part
            else:
                lowered.update(part)
        for gvar, func in list(lowered.functions.items()):
            if gvar.name_hint not in entries and func.attrs is not None and func.attrs.get("tirx.is_entry_func", False):
                lowered[gvar] = func.with_attr("tirx.is_entry_func", False)
        return lowered

    return lower, finalize_host, finalize_device


def compile_scheduled(mod: Any, target: TargetSpec) -> Any:
    """``tvm.compile`` of the scheduled module `mod` for `target`, as every build of the farm
    compiles it (so that every build of a config makes the code that was measured): through the
    TIR pipeline the module names (`tir_pipeline`) and, on the farm's default one, with
    ``tirx.use_async_copy`` on for its kernels (`ASYNC_COPY_ATTR`).

    That option makes the copies of a `pipeline` stage marked asynchronous ``cp.async``. TVM
    leaves it off, and without it those copies stay ordinary loads and stores (wait_group calls
    around them, waiting for nothing), which is what the first `pipeline` >= 2 kernels measured had
    (docs/defaults.md#async-copies). Two limits of TVM 0.27's lowering with it on, which templates keep clear of
    (`verify.verify_gpu` rejects the first): its ``cp.async`` injection copies a vector from the
    base of its index, whatever the stride (a strided vector copy comes out contiguous, wrong);
    and a loop in which one thread copies a contiguous run becomes a DMA call that CUDA cannot
    compile."""
    import tvm

    pipeline = register_default_pipeline(tir_pipeline(mod))
    if pipeline == DEFAULT_PIPELINE:
        mod = with_async_copies(mod, [gvar.name_hint for gvar in mod.get_global_vars()])
    return tvm.compile(mod, target=target.tvm(), tir_pipeline=pipeline)


def with_async_copies(mod: Any, names: Collection[str]) -> Any:
    """A copy of `mod` whose PrimFuncs named in `names` are marked to be lowered with asynchronous
    copies (`ASYNC_COPY_ATTR`), as the farm measures its kernels."""
    import tvm
    from tvm import tirx

    return tvm.IRModule({gvar: func.with_attr(ASYNC_COPY_ATTR, True)
                         if isinstance(func, tirx.PrimFunc) and gvar.name_hint in names else func
                         for gvar, func in mod.functions.items()}, attrs=mod.attrs, global_infos=mod.global_infos)


def register_default_pipeline(name: str = DEFAULT_PIPELINE) -> str:
    """`name`, with `DEFAULT_PIPELINE` registered among TVM's TIR pipelines (once per process)
    where it is that one: TVM looks a pipeline up by name."""
    from tvm.tirx.compilation_pipeline import PIPELINE_MAP, register_tir_pipeline

    if name == DEFAULT_PIPELINE and name not in PIPELINE_MAP:
        register_tir_pipeline(DEFAULT_PIPELINE, _default_pipeline)
    return name


def new_schedule(wl: Workload, func: Any = None) -> Any:
    """A fresh schedule of the workload's function (its blocks per `Workload.stage`), prepared as the
    workload asks (a TIR kernel's elementwise blocks inlined: farm.core.fused), or of `func`, a
    PrimFunc of the same computation and arguments written another way."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": wl.prim_func() if func is None else func}))
    if func is None and hasattr(wl, "prepare"):
        wl.prepare(sch)
    return sch


# TVM's CUDA runtime (CUDAWrappedFunc) opts a kernel in to more shared memory from this much
# dynamic shared memory on.
DYNAMIC_OPTIN_BYTES = 48 * 1024


def first_error(rules: Rules) -> str | None:
    """Why the one config of `rules`' columns is invalid (the first rule it breaks; the later ones
    are not computed), None if it is valid."""
    for bad, why in rules:
        if bad[0]:
            return why(0)
    return None


def passing(rules: Rules, n: int) -> np.ndarray:
    """Which of the `n` configs of `rules`' columns break none of them."""
    ok = np.ones(n, dtype=bool)
    for bad, _ in rules:
        ok &= ~bad
    return ok


def shared_memory_error(static: int, target: TargetSpec, dynamic: int = 0) -> str | None:
    """Why a block with `static` bytes of shared memory (fixed in the kernel) and `dynamic` bytes
    (``shared.dyn``, sized at launch) cannot launch on `target`, None if it can
    (`shared_memory_rules`)."""
    return first_error(shared_memory_rules(np.array([static]), target, np.array([dynamic])))


def shared_memory_rules(static: np.ndarray, target: TargetSpec, dynamic: np.ndarray | int = 0) -> Rules:
    """`Rules` of blocks with `static` and `dynamic` bytes of shared memory. TVM's CUDA runtime
    opts a kernel in to more than `max_shared_memory_per_block` (48 KiB) only when its dynamic
    part alone reaches 48 KiB (it then raises the kernel's dynamic limit to exactly that part);
    the block may then use up to the target's opt-in limit in all."""
    limit, total = target.limit("max_shared_memory_per_block"), static + dynamic
    yield static > limit, lambda i: f"{static[i]} bytes of static shared memory > {limit}"
    small = np.asarray(dynamic) < DYNAMIC_OPTIN_BYTES
    yield small & (total > limit), lambda i: f"{total[i]} bytes of shared memory > {limit}"
    optin = target.max_shared_memory_optin
    yield ~small & (total > optin), \
        lambda i: f"{total[i]} bytes of shared memory > {optin} ({target.arch}'s opt-in limit)"


# Software pipelining of a reduction's outer loop whose body copies two input tiles into shared
# memory and then computes on them (the `pipeline` knob of the cuda templates): 0, none; 1, the
# next step's tiles load into a second buffer, with ordinary loads, while this step computes;
# n >= 2, n buffers filled by asynchronous copies (cp.async, sm_80 and later, as
# `compile_scheduled` compiles them): n - 1 steps' tiles in flight while one computes, the loads
# needing no registers.
PIPELINE = (0, 1, 2, 3, 4)


def pipeline_buffers(pipeline: Any) -> Any:
    """Copies of each shared tile that `pipeline` keeps (an int, or an array of them)."""
    buffers = np.where(np.asarray(pipeline) == 0, 1, np.maximum(2, pipeline))
    return int(buffers) if np.ndim(buffers) == 0 else buffers


def pipeline_error(pipeline: int, steps: int, target: TargetSpec, implicit_unroll: bool = False) -> str | None:
    """Why `pipeline` cannot pipeline a loop of `steps` on `target`, None if it can
    (`pipeline_rules`)."""
    return first_error(pipeline_rules(np.array([pipeline]), np.array([steps]), target, np.array([implicit_unroll])))


def pipeline_rules(pipeline: np.ndarray, steps: np.ndarray, target: TargetSpec,
                   implicit_unroll: np.ndarray | bool = False) -> Rules:
    """`Rules` of `pipeline` on loops of `steps` on `target`; `implicit_unroll`: the kernel is
    unrolled by `#pragma unroll` (auto-unrolling without ``unroll_explicit``)."""
    buffers = pipeline_buffers(pipeline)
    yield (pipeline > 0) & (steps < buffers), \
        lambda i: f"{buffers[i]} pipeline buffers need as many outer steps of the reduction, not {steps[i]}"
    yield (pipeline >= 2) & (target.compute_capability < 80), \
        lambda i: f"asynchronous copies need sm_80 or later, not {target.arch}"
    # The pipeline's epilogue then becomes a `#pragma unroll` loop whose cp.async wait counts
    # depend on its variable, which TVM 0.27's CUDA codegen rejects: such candidates failed to
    # build (docs/defaults.md#async-copies).
    yield (buffers > 2) & implicit_unroll, \
        lambda i: "3 or more pipeline buffers need explicit unrolling (unroll_explicit=1) or none"


def pipeline_loop(sch: Any, loop: Any, pipeline: int) -> None:
    """Pipeline `loop` as `pipeline` says; its body is the two shared copies (stage 0) and then
    the computation on them (the last stage: it runs buffers - 1 steps behind the copies)."""
    if not pipeline:
        return
    sch.annotate(loop, "software_pipeline_stage", [0, 0, pipeline_buffers(pipeline) - 1])
    sch.annotate(loop, "software_pipeline_order", [0, 1, 2])
    if pipeline >= 2:
        sch.annotate(loop, "software_pipeline_async_stages", [0])


def axis_extents(wl: Workload, axes: Sequence[str]) -> dict[str, int]:
    """The extents of the workload's compute axes (Workload.compute_extents: no TVM), keyed by `axes`' names."""
    return dict(zip(axes, wl.compute_extents(), strict=True))


def has_block(sch: Any, name: str) -> bool:
    """Whether the schedule has a block called `name` (e.g. ``pad`` or ``avg``)."""
    try:
        sch.get_sblock(name)
    except Exception:  # s_tir raises a ScheduleError subclass of TVMError
        return False
    return True


def has_stage(sch: Any, wl: Workload, role: str) -> bool:
    """Whether the schedule has the workload's block playing `role` (`Workload.stage`)."""
    name = wl.stage(role)
    return name is not None and has_block(sch, name)


def fold_epilogue(sch: Any, wl: Workload, writer: Any | None, loop: Any) -> None:
    """Put the workload's ``epilogue`` stage, if it has one (see farm.core.workloads), into the
    kernel that computes its input: inlined into `writer` when one is given (the spatial block
    that copies the ``compute`` stage's accumulators out of registers, which then stores the
    output directly, in its dtype, and the accumulators never reach global memory); otherwise
    computed under `loop`, right after the reduction that fills them, which then go to local
    memory: left in global scope, they would be a buffer of the whole output that no kernel
    argument holds, which a CUDA kernel cannot allocate (TVM refuses to build it)."""
    if not has_stage(sch, wl, "epilogue"):
        return
    epilogue = sch.get_sblock(wl.stage("epilogue"))
    if writer is not None:
        sch.reverse_compute_inline(epilogue)
    else:
        sch.reverse_compute_at(epilogue, loop)
        sch.set_scope(sch.get_producers(epilogue)[0], 0, "local")


def split_skipping_units(
    sch: Any, loop: Any, factors: Sequence[int | None], keep: Sequence[int] = ()
) -> list[Any | None]:
    """Split `loop` by `factors` (outermost first; one may be None, i.e. inferred) without
    creating loops of extent 1, except at the positions in `keep` (loops to be bound).

    Returns one entry per factor: the loop, or None where no loop was created. If every factor
    is 1 and none is kept, the unsplit loop stands at position 0. Unit loops change nothing in
    the generated code, but leaving them out keeps the scheduled module identical to a
    hand-written schedule that never split (see the depthwise template's v4 test).
    """
    positions = [i for i, f in enumerate(factors) if f != 1 or i in keep] or [0]
    out: list[Any | None] = [None] * len(factors)
    if len(positions) == 1:
        out[positions[0]] = loop
    else:
        for i, part in zip(positions, sch.split(loop, [factors[i] for i in positions]), strict=True):
            out[i] = part
    return out


def cooperative_fetch(
    sch: Any, block: Any, thread_extents: Sequence[int], dims: Sequence[str], *, threads_outer: bool,
    vector: int = 1,
) -> None:
    """All threads of the block copy the tile `block` fills: fuse its copy loops and split them
    over the threads (`thread_extents` bound to ``threadIdx.{dims}``, outermost first).

    `threads_outer` puts the thread loops outside the per-thread loop, so each thread copies a
    contiguous run (AutoTVM's `split(nparts=...)`); otherwise they go inside it, so consecutive
    threads copy consecutive elements (coalesced loads, conflict-free shared stores), `vector`
    of them at a time (one 64- or 128-bit load per thread: the caller makes sure the tile's rows
    and the source's rows are multiples of `vector`, so every vector is aligned).
    """
    # compute_at gave the copy block one loop per dimension of the buffer it fills.
    ndim = len(sch.get(block).writes[0].region)
    fused = sch.fuse(*sch.get_loops(block)[-ndim:])
    if threads_outer:
        threads = sch.split(fused, [*thread_extents, None])[:-1]
    elif vector > 1:
        *threads, lanes = sch.split(fused, [None, *thread_extents, vector])[1:]
        sch.vectorize(lanes)
    else:
        threads = sch.split(fused, [None, *thread_extents])[1:]
    for loop, dim in zip(threads, dims, strict=True):
        sch.bind(loop, f"threadIdx.{dim}")


def annotate_unroll(sch: Any, loop: Any, max_step: int, explicit: int) -> None:
    """Ask TVM's unroller to unroll loops under `loop` up to `max_step` iterations."""
    if max_step > 0:
        sch.annotate(loop, "pragma_auto_unroll_max_step", max_step)
        sch.annotate(loop, "pragma_unroll_explicit", explicit)


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "float16": 2}[dtype]


def prod(xs: Any) -> int:
    return int(math.prod(xs))
