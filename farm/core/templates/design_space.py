"""A template for any TIR PrimFunc: MetaSchedule's design spaces, their decisions as knobs.

MetaSchedule's `PostOrderApply` turns a PrimFunc into a few sketches (schedules whose traces
hold sampling instructions: `SamplePerfectTile`, `SamplePartitionedTile`, `SampleCategorical`,
`SampleComputeLocation`) and a list of postprocessors that finish a schedule or reject it. The
farm's space of such a workload is the disjoint union over sketches (knob ``sketch``) of the
product of each sampling instruction's domain, in the trace's order:

- ``tileN`` (a TileKnob): the factorizations of the loop's extent into the instruction's parts,
  the innermost at most its ``max_innermost_factor`` (and, partitioned, the inner parts a multiple
  of its ``innerpart_factor``);
- ``choiceN`` (a ChoiceKnob): the candidates of a `SampleCategorical`;
- ``locN`` (a ChoiceKnob): a compute location: -2 (inline), -1 (root) or the position of a loop
  above the block's first consumer, every position the sketch has. Which of them are valid
  depends on the other decisions (a loop a tile made of extent 1 is none).

So every index is one list of decisions and back, and the space's size is exact. A config is
valid when the sketch's trace, replayed with its decisions, keeps every one of them (TVM's
replay silently replaces a decision that does not fit: a tile that does not divide its loop, a
location that is not one; the farm refuses those instead) and every postprocessor accepts the
schedule (VerifyGPUCode among them on GPUs): `check` is that, and `schedule` builds the same.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from farm.core.errors import FarmError, one_line
from farm.core.space import ChoiceKnob, Config, ConfigSpace, Knob, TileKnob, UnionSpace
from farm.core.targets import TargetSpec
from farm.core.templates.base import Template
from farm.core.workloads import Workload

SKETCH = "sketch"
# MetaSchedule's random state when it makes the sketches (any fixed value: every process must make the same).
DESIGN_SEED = 1
# Lowered random configs beyond the unknowns that a sketch's shared-memory fit must reproduce exactly.
FIT_PROBES = 12
# Checks remembered per design space (a few MB), so that a search asking again pays nothing.
MAX_VERDICTS = 100_000
SAMPLING = ("SamplePerfectTile", "SamplePartitionedTile", "SampleCategorical", "SampleComputeLocation")
# Types no tensor intrinsic of TVM's takes (its tensor cores' and VNNI's take 8- and 16-bit
# types): a kernel of these alone gets its target kind's plain rules (`plain_rules`).
PLAIN_DTYPES = frozenset({"float32", "float64", "int32", "int64", "uint32", "uint64", "bool"})
# A type's name in TVMScript: "float16" in a buffer or cast, T.int64(...) for a constant.
_DTYPE = re.compile(r"\b(bool|u?int\d+|b?float\d+\w*)\b")


def plain_rules(prim_func: Any, target: TargetSpec) -> str | None:
    """The rule set MetaSchedule's `PostOrderApply` takes for `prim_func` ("cuda" or "llvm"), where
    it needs no tensor intrinsic and makes the same sketches as the target's own rules; None where
    only the target's own will do: a type that tensor intrinsics take anywhere in the kernel (its
    buffers, casts, constants), or an llvm target that names its CPU or its features (whose own
    rules may be another set).

    The target's own rules for an sm_70+ GPU ("cuda-tensorcore") are the plain ones plus tensor-core
    tiling and its postprocessor, which need TVM's tensor intrinsics imported: seconds in each
    process that makes the space (a job's scheduler, search actors and build processes), for
    kernels whose types no tensor core takes (tests/test_tir_workloads.py checks the sketches agree).
    """
    if target.kind not in ("cuda", "llvm") or (target.kind == "llvm" and {"mcpu", "mattr"} & set(target.doc)):
        return None
    dtypes = set(_DTYPE.findall(prim_func.script()))
    return target.kind if dtypes <= PLAIN_DTYPES else None


@dataclass(frozen=True)
class _Buffer:
    """A shared buffer's elements: `scale` times the product of tile factors (slot, position) to
    their exponents; `itemsize` bytes each."""

    scale: float
    factors: tuple[tuple[int, int, int], ...]
    itemsize: int


@dataclass(frozen=True)
class _Kernel:
    """One kernel's shared buffers, as functions of a sketch's decisions. `dynamic`: they are the
    function's dynamic shared buffers as compacted, before lowering pipelines and merges them (and
    may reuse one's memory for another): their largest then bounds the kernel's allocation from
    below."""

    name: str
    buffers: tuple[_Buffer, ...]
    dynamic: bool = False

    def bytes(self, config: Config, slots: list[_Slot]) -> int:
        """The kernel's shared memory: its buffers' total, or, `dynamic`, at least this much."""
        sizes = [round(b.scale * math.prod(config[slots[j].knob.name][p] ** e for j, p, e in b.factors)) * b.itemsize
                 for b in self.buffers]
        return max(sizes) if self.dynamic else sum(sizes)


@dataclass(frozen=True)
class _Slot:
    """One sampling instruction of a sketch: its knob and how a knob value becomes its decision."""

    knob: Knob
    extent: int | None  # a tile's loop extent, as the sketch has it
    decision: Callable[[Any], Any]  # knob value -> decision


class DesignSpace:
    """The sketches and postprocessors of one TIR workload on one target, and the union space of
    their decisions (see the module docstring). Building one for a kernel of 8- or 16-bit types
    imports TVM's tensor intrinsics (seconds, once per process; `plain_rules`); replaying is
    milliseconds. Thread-safe: replays are serialized."""

    def __init__(self, workload: Workload, target: TargetSpec) -> None:
        import tvm
        from tvm.s_tir import meta_schedule as ms

        from farm.core.tvm_import import import_tensor_intrinsics, without_tensor_intrinsics

        self.mod = tvm.IRModule({"main": workload.prim_func()})
        rules = plain_rules(self.mod["main"], target) or "from-target"
        if rules == "from-target":
            import_tensor_intrinsics()
        with without_tensor_intrinsics():
            self._context = ms.TuneContext(mod=self.mod, target=target.tvm(),
                                           space_generator=ms.space_generator.PostOrderApply(
                                               sch_rules=rules, postprocs=rules, mutator_probs=rules),
                                           task_name=str(workload), num_threads=1,
                                           # The sketches' own decisions, which the space's structure
                                           # follows: the same in every process.
                                           rand_state=DESIGN_SEED)
        try:
            sketches = list(self._context.generate_design_space())
        except Exception as e:  # TVM's errors for a function its rules cannot schedule
            raise FarmError(f"MetaSchedule found no design space for {workload} on {target.kind}: "
                            f"{one_line(e)}") from None
        self.postprocs = list(self._context.space_generator.postprocs)
        self.traces = [sketch.trace for sketch in sketches]
        self.slots = [self._slots(trace) for trace in self.traces]
        self.bounds = [_thread_bounds(trace, target) for trace in self.traces]
        if not self.traces:
            raise FarmError(f"MetaSchedule found no design space for {workload} on {target.kind}")
        self.space = UnionSpace([ConfigSpace([slot.knob for slot in slots]) for slots in self.slots], SKETCH)
        self._lock = threading.Lock()
        self._verdicts: dict[int, str | None] = {}  # config index -> `check`'s answer
        self._target = target
        # Per sketch: its kernels' shared memory as exact functions of the tile decisions
        # (`_fit_footprints`), fitted when first needed; None where no exact one was found.
        self._footprints: dict[int, list[_Kernel] | None] = {}

    def check(self, config: Config) -> str | None:
        """None if `config` is valid, else why not (`replay`'s answer, remembered)."""
        if config.index not in self._verdicts:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[config.index] = self.replay(config)[1]
        return self._verdicts[config.index]

    def _slots(self, trace: Any) -> list[_Slot]:
        """The sketch's sampling instructions as knobs, found by replaying it.

        The replay takes each tile's most spread-out factorization (the most factors above 1), so
        that no loop has extent 1, and asks TVM which compute locations it accepts there: a loop of
        extent 1 is never a location, and those of any other config are among these."""
        from tvm import s_tir

        slots: list[_Slot] = []
        sch = s_tir.Schedule(self.mod, debug_mask="none")

        def provide(inst: Any, inputs: list[Any], attrs: list[Any], decision: Any) -> Any:
            kind, name = inst.kind.name, f"{len(slots)}"
            if kind in ("SamplePerfectTile", "SamplePartitionedTile"):
                parts, extent = int(attrs[0]), int(sch.get(inputs[0]).extent)
                if kind == "SamplePerfectTile":
                    innermost = int(attrs[1])
                    knob = TileKnob(f"tile{name}", extent, parts, innermost if innermost > 0 else None)
                else:
                    knob = TileKnob(f"tile{name}", extent, parts, None, int(attrs[1]), int(attrs[2]))
                if not len(knob):
                    raise FarmError(f"a loop of {extent} has no split that {kind} {list(map(int, attrs))} allows")
                slots.append(_Slot(knob, extent, list))
                return list(max(knob.values, key=lambda f: (sum(x > 1 for x in f), -max(f))))
            if kind == "SampleCategorical":
                candidates = [_plain(c) for c in attrs[0]]
                values = candidates if len(set(map(repr, candidates))) == len(candidates) else \
                    list(range(len(candidates)))
                slots.append(_Slot(ChoiceKnob(f"choice{name}", values), None, values.index))
                return decision
            if kind == "SampleComputeLocation":
                consumers = sch.get_consumers(inputs[0])
                loops = len(sch.get_loops(consumers[0])) if consumers else 0
                valid = [v for v in range(-2, loops) if _location_kept(sch, inputs[0], v)]
                slots.append(_Slot(ChoiceKnob(f"loc{name}", valid), None, int))
                return decision if int(decision) in valid else valid[-1]
            if kind.startswith("Sample"):
                raise FarmError(f"the design space samples with {kind}, which the farm cannot enumerate")
            return decision

        trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=provide)
        return slots

    def bound_error(self, config: Config, fit: bool = True) -> str | None:
        """Why `config` binds more threads to a block than `target` allows, or asks for more shared
        memory, from its decisions alone (microseconds; VerifyGPUCode, after a replay, decides the
        rest). The shared memory's model is fitted on first use (`_fit_footprints`: seconds for a
        tensor-core sketch), with `fit` only: a process that builds configs a search checked would
        gain nothing by it."""
        sketch = config[SKETCH]
        slots = self.slots[sketch]
        for axis, factors, limit in self.bounds[sketch]:
            extent = math.prod(config[slots[slot].knob.name][position] for slot, position in factors)
            if extent > limit:
                return f"{extent} {axis} > {limit}"
        if self._target.is_gpu:
            if fit and sketch not in self._footprints:
                self._footprints[sketch] = self._fit_footprints(sketch)
            # The replay's VerifyGPUCode holds static and dynamic shared memory alike to this limit.
            limit = self._target.limit("max_shared_memory_per_block")
            for kernel in self._footprints.get(sketch) or []:
                used = kernel.bytes(config, slots)
                if used > limit:
                    what = "a dynamic shared buffer of" if kernel.dynamic else "shared memory"
                    return f"kernel {kernel.name}: {used} bytes of {what} > {limit}"
        return None

    def _fit_footprints(self, sketch: int) -> list[_Kernel] | None:
        """Each kernel's shared buffers of `sketch` as exact monomials of its tile decisions, or None.

        The bytes a shared buffer gets are known only once the schedule is lowered (about 10 ms a
        config), yet they decide most GPU configs' validity (VerifyGPUCode). For MultiLevelTiling's
        copies of an affine access the size is a product of tile factors, so a least-squares fit of
        log2 elements on log2 factors over `FIT_PROBES` lowered random configs, kept only when it
        has integer exponents and reproduces every probe exactly, computes it in microseconds.
        Where it does not (a convolution's halo), the replay alone decides.

        A sketch whose stages live in dynamic shared memory (tensor-core sketches: the trace names
        the scope) is fitted on its buffers as compacted, a few passes short of lowering
        (`_dynamic_buffers`): lowering merges them into one, which no monomial fits."""
        import numpy as np

        dynamic = "shared.dyn" in str(self.traces[sketch])
        probe = self._dynamic_buffers if dynamic else self._shared_buffers
        slots = self.slots[sketch]
        # A tile's outermost factor is the extent over the others: a regressor of its own would
        # make the fit's solution one of many (and not the integer one).
        positions = [(j, p) for j, slot in enumerate(slots) if isinstance(slot.knob, TileKnob)
                     for p in range(1, slot.knob.parts)]
        if not positions:
            return None
        rng = random.Random(DESIGN_SEED + sketch)
        part, offset = self.space.parts[sketch], self.space.offsets[sketch]
        rows: list[list[float]] = []
        sizes: list[dict[tuple[str, str], tuple[int, int]]] = []
        wanted = len(positions) + FIT_PROBES
        for _ in range(20 * wanted):
            if len(rows) >= wanted:
                break
            config = self.space.get(offset + rng.randrange(part.size))
            # Every categorical decision at its first candidate: no unrolling (a probe's lowering of
            # a fully unrolled kernel takes a second), the tiles, which the sizes follow, random.
            config = self.space.get(self.space.index({k: (knob.values[0] if isinstance(knob, ChoiceKnob)
                                                          and k.startswith("choice") else v)
                                                      for (k, v), knob in zip(config.values, [None, *part.knobs],
                                                                              strict=True)}))
            found = probe(config)
            if found is None:
                continue
            if sizes and set(found) != set(sizes[0]):
                return None  # the kernels or their buffers change with the decisions
            rows.append([math.log2(config[slots[j].knob.name][p]) for j, p in positions])
            sizes.append(found)
        if len(rows) < wanted:
            return None
        x = np.column_stack([np.array(rows), np.ones(len(rows))])
        kernels: dict[str, list[_Buffer]] = {}
        for key in sizes[0]:
            y = np.array([math.log2(found[key][0]) for found in sizes])
            coefficients = np.linalg.lstsq(x, y, rcond=None)[0]
            exponents = np.round(coefficients[:-1])
            if np.abs(x[:, :-1] @ exponents + coefficients[-1] - y).max() > 1e-6:
                return None
            factors = tuple((j, p, int(e)) for (j, p), e in zip(positions, exponents, strict=True) if e)
            kernels.setdefault(key[0], []).append(
                _Buffer(float(2 ** coefficients[-1]), factors, sizes[0][key][1]))
        return [_Kernel(name, tuple(buffers), dynamic) for name, buffers in sorted(kernels.items())]

    def _dynamic_buffers(self, config: Config) -> dict[tuple[str, str], tuple[int, int]] | None:
        """{("main", buffer): (elements, bytes per element)} of the dynamic shared buffers of
        `config`'s schedule, each compacted to the region it holds (TVM's default TIR pipeline up to
        CompactBufferAllocation: milliseconds); None if it does not replay or allocates none."""
        import tvm

        from farm.core.templates.base import statements
        from farm.core.templates.verify import itemsize

        sch = self._unverified(config)
        if sch is None:
            return None
        try:
            with tvm.transform.PassContext():
                func = _compact_buffers()(sch.mod)["main"]
        except Exception:  # a schedule TVM cannot lower: no probe
            return None
        found = {("main", buffer.name): (math.prod(int(d) for d in buffer.shape), itemsize(str(buffer.dtype)))
                 for stmt in statements(func.body) for buffer in getattr(stmt, "alloc_buffers", ())
                 if buffer.scope() == "shared.dyn"}
        return found or None

    def _shared_buffers(self, config: Config) -> dict[tuple[str, str], tuple[int, int]] | None:
        """{(kernel, buffer): (elements, bytes per element)} of every shared buffer of `config`'s
        lowered kernels; None if it does not lower, or holds dynamic shared memory."""
        from farm.core.templates.verify import lower, shared_allocations

        sch = self._unverified(config)
        if sch is None:
            return None
        try:
            return shared_allocations(lower(sch.mod, self._target))
        except Exception:  # a schedule TVM cannot lower: no probe
            return None

    def _unverified(self, config: Config) -> Any | None:
        """`config`'s schedule with every postprocessor but VerifyGPUCode (a probe of its shared
        memory, which VerifyGPUCode would refuse where it is too large), or None."""
        return self.replay(config, postprocs=[p for p in self.postprocs if type(p).__name__ != "VerifyGPUCode"],
                           bounds=False)[0]

    def replay(self, config: Config, postprocs: list[Any] | None = None,
               bounds: bool = True) -> tuple[Any | None, str | None]:
        """(the schedule of `config`, None), or (None, why it is invalid); `postprocs`: those to
        apply (default: all), `bounds`: whether `bound_error` decides first (with the shared memory's
        model where a precheck has fitted it)."""
        from tvm import s_tir

        why = self.bound_error(config, fit=False) if bounds else None
        if why is not None:
            return None, why
        sketch = config[SKETCH]
        slots = self.slots[sketch]
        wanted = [slot.decision(config[slot.knob.name]) for slot in slots]
        trouble: list[str] = []
        with self._lock:
            sch = s_tir.Schedule(self.mod, debug_mask="none")
            position = iter(range(len(slots)))

            def provide(inst: Any, inputs: list[Any], attrs: list[Any], decision: Any) -> Any:
                if inst.kind.name not in SAMPLING:
                    return decision
                i = next(position)
                slot = slots[i]
                if slot.extent is not None and int(sch.get(inputs[0]).extent) != slot.extent and not trouble:
                    trouble.append(f"{slot.knob.name} splits a loop of {int(sch.get(inputs[0]).extent)}, "
                                   f"not {slot.extent}")
                return wanted[i]

            try:
                self.traces[sketch].apply_to_schedule(sch, remove_postproc=True, decision_provider=provide)
            except Exception as e:  # a decision a schedule primitive refuses
                return None, f"sketch {sketch} does not replay: {one_line(e)}"
            if trouble:
                return None, trouble[0]
            replayed = sch.trace
            got = [inst for inst in replayed.insts if inst.kind.name in SAMPLING]
            for slot, inst, want in zip(slots, got, wanted, strict=True):
                have = _plain(replayed.decisions[inst])
                if have != want:
                    return None, f"{slot.knob.name}={config[slot.knob.name]} is not valid here (TVM would take {have})"
            sch.enter_postproc()
            for postproc in self.postprocs if postprocs is None else postprocs:
                try:
                    accepted = postproc.apply(sch)
                except Exception as e:  # a postprocessor that raises rather than returns False
                    return None, f"{type(postproc).__name__}: {one_line(e)}"
                if not accepted:
                    return None, f"{type(postproc).__name__} rejects it"
        return sch, None


def _thread_bounds(trace: Any, target: TargetSpec) -> list[tuple[str, list[tuple[int, int]], int]]:
    """(axis, factors, limit) for each loop the sketch binds to a thread axis whose extent is a
    product of tile decisions: `factors` as (sampling slot, position)."""
    if not target.is_gpu:
        return []
    limits = {"threadIdx": target.limit("max_threads_per_block")}
    factor_of: dict[Any, tuple[int, int]] = {}  # a sampled factor's RV -> (slot, position)
    loop_factors: dict[Any, list[tuple[int, int]]] = {}  # a loop's RV -> the factors of its extent
    bounds = []
    slot = 0
    for inst in trace.insts:
        kind = inst.kind.name
        if kind in SAMPLING:
            if kind in ("SamplePerfectTile", "SamplePartitionedTile"):
                factor_of.update({rv: (slot, i) for i, rv in enumerate(inst.outputs)})
            slot += 1
        elif kind == "Split":
            for rv, loop in zip(inst.inputs[1:], inst.outputs, strict=True):
                if rv is not None and rv in factor_of:
                    loop_factors[loop] = [factor_of[rv]]
        elif kind == "Fuse":
            parts = [loop_factors.get(loop) for loop in inst.inputs]
            if all(p is not None for p in parts):
                loop_factors[inst.outputs[0]] = [f for p in parts for f in p]  # type: ignore[union-attr]
        elif kind == "Bind":
            axis = str(inst.attrs[0]).split(".")[0]
            factors = loop_factors.get(inst.inputs[0])
            if axis in limits and factors is not None:
                bounds.append((axis, factors, limits[axis]))
    return bounds


@lru_cache(maxsize=1)
def _compact_buffers() -> Any:
    """TVM's default TIR pipeline up to CompactBufferAllocation: each buffer shrunk to the region it
    holds, before buffers are pipelined, flattened or merged."""
    import tvm
    from tvm import s_tir

    t = s_tir.transform
    return tvm.transform.Sequential([
        t.CanonicalizeLoop(), t.LowerCrossThreadReduction(), t.LowerInitBlock(),
        t.PlanAndUpdateBufferAllocationLocation(), t.ConvertBlocksToOpaque(), t.LiftThreadBinding(),
        t.ManifestSharedMemoryLocalStage(), t.CompactBufferAllocation()])


def _location_kept(sch: Any, block: Any, location: int) -> bool:
    """Whether TVM keeps `location` as the compute location of `block` in `sch` as it stands."""
    trial = sch.copy()
    trial.sample_compute_location(block, decision=location)
    return int(trial.trace.decisions[trial.trace.insts[-1]]) == location


def _plain(value: Any) -> Any:
    """A decision or a candidate as plain Python (TVM gives IntImm, FloatImm, StringImm, arrays)."""
    if isinstance(value, str | int | float):
        return value
    if hasattr(value, "value"):  # IntImm, FloatImm, StringImm
        return _plain(value.value)
    return [_plain(v) for v in value]


@lru_cache(maxsize=64)
def design_space(workload: Workload, target: TargetSpec) -> DesignSpace:
    """The (cached) design space of `workload` on `target`."""
    return DesignSpace(workload, target)


class _DesignSpaceTemplate(Template, name="ms", kind="", workloads=()):
    """MetaSchedule's design spaces of any TIR workload (see the module docstring)."""

    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        return design_space(wl, target).space

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        return design_space(wl, target).check(config)

    def precheck(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        return design_space(wl, target).bound_error(config)

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        sch, why = design_space(wl, target).replay(config)
        if sch is None:
            raise ValueError(f"config {config.index} is not valid: {why}")
        return sch

    @cached_property
    def version(self) -> str:
        """The template's source, and TVM's version: its rules make the design spaces."""
        import tvm

        return hashlib.sha256((super().version + tvm.__version__).encode()).hexdigest()[:12]


class CudaDesignSpace(_DesignSpaceTemplate, name="ms.cuda", kind="cuda", workloads=("tir",)):
    pass


class LlvmDesignSpace(_DesignSpaceTemplate, name="ms.llvm", kind="llvm", workloads=("tir",)):
    pass
