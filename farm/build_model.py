"""Compile a whole model with the farm's tuned kernels: `compile_model` and `CompiledModel`.

    compiled = farm.compile_model("resnet.onnx", target="cuda", best="best.json")
    compiled.export_library("resnet.so")       # TVM's runtime loads it: relax.VirtualMachine
    outputs = compiled(*numpy_inputs)

The model is imported and fused as for tuning (farm.core.model: the same passes, so its kernels are
the very functions that were tuned), then built by Relax with a MetaSchedule database holding the
fastest record the farm has of each kernel for the target: from an export (`best`, farm.best/1,
as `farm export` writes it), from a job, or from the farm's database itself (`db`: every job's
trials, the fastest per kernel, as Lorien's and TopHub's databases serve later builds). A kernel
with no record, or one whose record MetaSchedule cannot replay, is scheduled by TVM's defaults
(DLight on GPUs) and named in a warning; `tuned` and `untuned` say which kernels are which. A
kernel whose fastest record is its task's baseline, TVM's own schedule measured beside the
configs (farm.core.task.Task.baseline_index), is built by that default path too (`defaults`).

On CUDA the model's kernel launches are captured in a CUDA graph (Relax's
``relax.backend.use_cuda_graph``) unless `cuda_graph` is false: a model of many small kernels at
batch 1 is bound by launches as much as by its kernels.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from db.store import ResultStore
from farm.core.errors import FarmError, one_line
from farm.core.model import Model, ModelTask, fuse_passes, load_model, relax_passes
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import BASELINE, Task
from farm.core.templates.base import register_default_pipeline, with_async_copies
from farm.core.templates.tvm_default import default_gpu_rules
from farm.core.workloads import workload_from_json
from farm.export import commit, export_document, load, metaschedule_schedule, record, validate

# Where the tuned configs come from: an export file or its path, one record, or a list of records.
Records = str | Path | dict[str, Any] | list[dict[str, Any]]


class CompiledModel:
    """A model built for one target: call it on NumPy arrays (or TVM tensors) of the model's inputs."""

    def __init__(self, model: Model, target: TargetSpec, executable: Any, tuned: list[str],
                 untuned: list[str], defaults: list[str]) -> None:
        self.model, self.target, self.executable = model, target, executable
        # Kernel names: those built as their fastest record says, those without a record (TVM's
        # default schedules), and those of `tuned` whose fastest record is TVM's default schedule
        # itself (a task's baseline, which no config beat).
        self.tuned, self.untuned, self.defaults = tuned, untuned, defaults
        self._vm: Any = None

    @property
    def device(self) -> Any:
        import tvm

        return tvm.cuda(0) if self.target.is_gpu else tvm.cpu(0)

    @property
    def vm(self) -> Any:
        """The Relax virtual machine running the model on `device` (made on first use)."""
        if self._vm is None:
            from tvm import relax

            self._vm = relax.VirtualMachine(self.executable, self.device)
        return self._vm

    def __call__(self, *inputs: Any) -> list[np.ndarray]:
        """The model's outputs, as NumPy arrays, for `inputs` (arrays of the model's input shapes)."""
        import tvm

        if len(inputs) != len(self.model.inputs):
            raise FarmError(f"model {self.model.name} takes {len(self.model.inputs)} inputs, got {len(inputs)}")
        args = [x if isinstance(x, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(x), self.device)
                for x in inputs]
        return [np.asarray(t.numpy()) for t in flatten(self.vm["main"](*args))]

    def check(self, seed: int = 0) -> float:
        """The largest relative error (max |ours - theirs| / max |theirs|, per output) of the compiled
        model's outputs against the model's own framework's (PyTorch eager, onnxruntime) on the same
        random inputs. FarmError when the model came without its framework, or outputs differ in number
        or shape."""
        if self.model.framework is None:
            raise FarmError(f"model {self.model.name} was given as Relax: there is no framework to check it against")
        inputs = self.model.random_inputs(seed)
        ours, theirs = self(*inputs), self.model.framework(inputs)
        if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
            raise FarmError(f"the compiled model returns {[a.shape for a in ours]}, {self.model.framework_name} "
                            f"{[b.shape for b in theirs]}")
        return max(float(np.max(np.abs(a.astype(np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-30))
                   for a, b in zip(ours, theirs, strict=True))

    def export_library(self, path: str | Path) -> Path:
        """Write the compiled model as a shared library (`tvm.runtime.load_module` and
        `relax.VirtualMachine` run it)."""
        from farm.core.files import replacing

        with replacing(path) as tmp:
            self.executable.export_library(str(tmp))
        return Path(path)


def flatten(value: Any) -> list[Any]:
    """A Relax function's result as a flat list of tensors (models return tuples, nested or not)."""
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return [t for item in value for t in flatten(item)]


def compile_model(model: Any, example_inputs: Sequence[Any] | None = None, *,
                  target: str | dict[str, Any] | TargetSpec = "cuda", best: Records | None = None,
                  store: ResultStore | None = None, cuda_graph: bool = True,
                  input_shapes: dict[str, Sequence[int]] | None = None) -> CompiledModel:
    """Build `model` (anything farm.core.model.load_model takes, or a Model) for `target` with the
    fastest record of each kernel in `best` (an export: a path, a loaded document or its records)
    and in `store` (the farm's database: every job's trials). FarmError when neither holds a record
    of any of the model's kernels, or for a model that does not import."""
    spec = target if isinstance(target, TargetSpec) else parse_target(target)
    m = model if isinstance(model, Model) else load_model(model, example_inputs, input_shapes=input_shapes)
    tasks = m.tasks(spec)
    records = _records_for(tasks, spec, best, store)
    if (best is not None or store is not None) and not records:
        where = " and ".join(w for w, given in (("the export", best is not None), ("the database", store is not None))
                             if given)
        raise FarmError(f"{where} holds no record of any kernel of model {m.name} on {spec.kind}: tune it first "
                        f"(farm tune-model)")
    scheduled, refused, defaults = [], [], []
    for task in tasks:
        rec = records.get(task.workload.key)
        if rec is None:
            continue
        if rec["config"] == BASELINE:
            # TVM's own schedule measured fastest: the build's default path makes that very schedule.
            defaults.append(task.name)
            continue
        try:
            scheduled.append(metaschedule_schedule(rec))
        except FarmError as e:
            refused.append(f"{task.name} ({e})")
    applied: set[str] = set()  # the kernels MetaScheduleApplyDatabase scheduled
    executable = _build(m, spec, scheduled, cuda_graph, applied, defaults)
    tuned = [t.name for t in tasks if t.name in applied or t.name in defaults]
    untuned = [t.name for t in tasks if t.name not in tuned] + [name for name, _ in m.untunable]
    if untuned:
        warnings.warn(f"{len(untuned)} of {len(tasks) + len(m.untunable)} kernels of {m.name} have no tuned record "
                      f"and use TVM's default schedules: {', '.join(untuned)}", stacklevel=2)
    for why in refused:
        warnings.warn(f"a record MetaSchedule cannot replay: {why}", stacklevel=2)
    return CompiledModel(m, spec, executable, tuned, untuned, defaults)


def _records_for(tasks: list[ModelTask], target: TargetSpec, best: Records | None,
                 store: ResultStore | None) -> dict[str, dict[str, Any]]:
    """workload key -> the fastest record of the kernel for `target` in the export and the store."""
    keys = {t.workload.key for t in tasks}
    found: list[dict[str, Any]] = []
    if best is not None:
        doc = export_document(best) if isinstance(best, list) else best
        found += [r for r in (validate(doc) if isinstance(doc, dict) else load(doc))["records"]
                  if _for_target(r, target) and workload_from_json(r["workload"]).key in keys]
    if store is not None:
        for task in tasks:
            for trial in store.prior_best(task.workload.key, target.kind):
                if _for_target(trial, target):
                    try:
                        current = Task.from_json(trial)
                    except FarmError:  # a template this farm no longer has
                        continue
                    if current.template.version == trial["template_version"]:
                        found.append(record(current, trial, trial["template_version"]))
    fastest: dict[str, dict[str, Any]] = {}
    for rec in found:
        key = workload_from_json(rec["workload"]).key
        if key not in fastest or rec["latency_us"] < fastest[key]["latency_us"]:
            fastest[key] = rec
    return fastest


def _for_target(rec: dict[str, Any], target: TargetSpec) -> bool:
    spec = parse_target(rec["target"])
    return spec.kind == target.kind and (not spec.is_gpu or spec.arch == target.arch)


def _build(model: Model, target: TargetSpec, scheduled: list[tuple[dict[str, Any], Task, Any]],
           cuda_graph: bool, applied: set[str], defaults: list[str]) -> Any:
    """Relax's build of the model with the records applied: the fusion passes of tuning, the database,
    DLight for the rest on GPUs, then Relax's own lowering (as `compile_relax` does), the kernels
    lowered by the TIR pipeline of the tuning builds and with their options (base.DEFAULT_PIPELINE,
    base.with_async_copies for the kernels the database scheduled and for `defaults`, those whose
    measured record is TVM's own schedule). Adds to `applied` the kernels the database scheduled."""
    import tvm
    from tvm import relax
    from tvm.s_tir import dlight as dl
    from tvm.s_tir import meta_schedule as ms

    database = ms.database.MemoryDatabase()
    commit(database, scheduled)
    tvm_target = target.tvm()

    @tvm.transform.module_pass(opt_level=3)
    def farm_pipeline(mod: Any, _ctx: Any) -> Any:
        mod = tvm.transform.Sequential(fuse_passes(target))(mod)
        mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        applied.update(gv.name_hint for gv, func in mod.functions.items()
                       if func.attrs is not None and "tirx.is_scheduled" in func.attrs)
        mod = with_async_copies(mod, applied | set(defaults))
        if target.is_gpu:
            mod = dl.ApplyDefaultSchedule(*default_gpu_rules())(mod)
        passes = [*relax_passes(target, "dataflow_lower_passes"), *relax_passes(target, "finalize_passes")]
        return tvm.transform.Sequential(passes)(mod)

    config = {"relax.backend.use_cuda_graph": bool(cuda_graph and target.kind == "cuda")}
    try:
        with tvm_target, database, tvm.transform.PassContext(opt_level=3, config=config):
            return relax.build(model.mod, target=tvm_target, relax_pipeline=farm_pipeline,
                               tir_pipeline=register_default_pipeline())
    except Exception as e:  # TVM's build errors: the model cannot be built for this target
        raise FarmError(f"model {model.name} does not build for {target.kind}: {one_line(e)}") from None
