"""Models: a PyTorch or ONNX network imported into Relax, and the kernels (tasks) the farm tunes of it.

`load_model` takes what a user has: a `torch.nn.Module` with example inputs, a
`torch.export.ExportedProgram`, a saved export (``.pt2``), an ONNX file (``.onnx``), a Python file
that builds the model (``.py``: it defines ``model`` and ``example_inputs``), or a Relax `IRModule`.
It imports the model with TVM's own frontends (`from_exported_program`, `from_onnx`), binds its
weights as constants, folds each batch norm into the convolution before it (its scale and shift
into the weights and bias: conv + batch norm + ReLU becomes one kernel of a conv, a bias and a
ReLU) and decomposes the other inference-only operators. Shapes must
be static: a model whose inputs have symbolic dimensions is refused, with what to do instead.

`Model.tasks(target)` legalizes and fuses the model the way MetaSchedule's `compile_relax` does
(`FUSE_PASSES` after the target's library dispatch), so that the kernels tuned here are the very
functions a build later looks up in the database, and extracts them with
`ms.relax_integration.extract_tasks`: one `ModelTask` per distinct kernel (structural equality),
with its weight, the number of calls of it per inference. A kernel the farm cannot take as a
workload (several outputs, say) is listed in `Model.untunable` with the reason: a build schedules
it with TVM's defaults.

Every refusal is one line (FarmError): a file that does not exist or does not parse, an operator
the frontend does not support (named), dynamic shapes, example inputs the model does not accept.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import runpy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from farm.core.errors import FarmError, brief, one_line
from farm.core.jobspec import JobRequest
from farm.core.targets import TargetSpec, parse_target
from farm.core.tir import TirWorkload, tir_workload

MODEL_SUFFIXES = (".onnx", ".pt2", ".py")


@dataclass(frozen=True)
class ModelTask:
    """One distinct kernel of a model: Relax's name for it, the workload, and calls per inference."""

    name: str
    workload: TirWorkload
    weight: int


@dataclass(frozen=True)
class ModelInput:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Model:
    """A model imported into Relax: `mod` holds ``main`` with the weights bound as constants."""

    name: str
    mod: Any  # tvm.IRModule
    inputs: list[ModelInput]
    untunable: list[tuple[str, str]] = field(default_factory=list)  # (kernel, why), after `tasks`
    # The model run by its own framework (NumPy inputs -> outputs), and that framework's name: what a
    # build's outputs are checked against. None for a model given as Relax.
    framework: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None
    framework_name: str = ""

    @cached_property
    def hash(self) -> str:
        """The model's identity: the structural hash of its Relax program, weights included."""
        import tvm_ffi

        return f"{tvm_ffi.structural_hash(self.mod) & (2**64 - 1):016x}"

    def fused(self, target: TargetSpec) -> Any:
        """The model legalized and fused for `target` as `compile_relax` does it before it applies a database."""
        import tvm

        return tvm.transform.Sequential(fuse_passes(target))(self.mod)

    def tasks(self, target: TargetSpec) -> list[ModelTask]:
        """The model's distinct kernels for `target`, heaviest first (weight x flops); sets `untunable`."""
        from tvm.s_tir import meta_schedule as ms

        extracted = ms.relax_integration.extract_tasks(self.fused(target), target.tvm())
        tasks: dict[str, ModelTask] = {}
        self.untunable = []
        for task in extracted:
            try:
                workload = tir_workload(task.dispatched[0]["main"], task.task_name)
            except FarmError as e:
                self.untunable.append((task.task_name, str(e)))
                continue
            known = tasks.get(workload.key)
            weight = int(task.weight) + (known.weight if known else 0)
            tasks[workload.key] = ModelTask(known.name if known else task.task_name, workload, weight)
        return sorted(tasks.values(), key=lambda t: (-t.weight * t.workload.flops(), t.name))

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Inputs of the model's shapes and types, from `seed`: floats in [-1, 1), integers in [0, 8)."""
        rng = np.random.default_rng(seed)
        out = []
        for spec in self.inputs:
            if spec.dtype.startswith(("int", "uint")):
                out.append(rng.integers(0, 8, spec.shape).astype(spec.dtype))
            elif spec.dtype == "bool":
                out.append(rng.integers(0, 2, spec.shape).astype(bool))
            else:
                out.append(rng.uniform(-1, 1, spec.shape).astype(spec.dtype))
        return out


def model_job(model: Model, target: str | dict[str, Any] | TargetSpec, trials: int, *, skip: Sequence[str] = (),
              budgets: dict[str, int] | None = None, retune: bool = False, **options: Any) -> JobRequest:
    """The one job that tunes `model`'s kernels on `target` (farm.core.jobspec.JobRequest).

    Every kernel is a task weighted by its calls per inference; the budget is handed out by
    gradient (farm.core.allocation) but for the kernels `budgets` names (a kernel name or a
    shell-style pattern -> trials); `skip` leaves the kernels its patterns match out (a build
    schedules them with TVM's defaults); `retune` tunes kernels tuned before again. `options` are
    JobRequest.build's. FarmError if a name or pattern matches no kernel, or nothing is left."""
    spec = parse_target(target) if not isinstance(target, TargetSpec) else target
    tasks = model.tasks(spec)
    if not tasks:
        raise FarmError(f"model {model.name} has no kernel to tune (TVM found no task in it)")
    names = [t.name for t in tasks]
    for pattern in [*skip, *(budgets or {})]:
        if not fnmatch.filter(names, pattern):
            raise FarmError(f"{pattern!r} matches no kernel of model {model.name}; its kernels: {', '.join(names)}")
    kept = [t for t in tasks if not any(fnmatch.fnmatchcase(t.name, p) for p in skip)]
    if not kept:
        raise FarmError(f"--skip leaves no kernel of model {model.name} to tune")

    def budget(task: ModelTask) -> int | None:
        return next((n for p, n in (budgets or {}).items() if fnmatch.fnmatchcase(task.name, p)), None)

    record = {"name": model.name, "hash": model.hash,
              "inputs": [[i.name, list(i.shape), i.dtype] for i in model.inputs],
              "kernels": [[t.name, t.weight] for t in tasks],
              "skipped": [t.name for t in tasks if t not in kept],
              "untunable": [[name, why] for name, why in model.untunable]}
    options.setdefault("name", f"model {model.name}")
    return JobRequest.build([t.workload for t in kept], spec, trials, weights=[t.weight for t in kept],
                            budgets=[budget(t) for t in kept], allocation="gradient", retune=retune, model=record,
                            **options)


def fuse_passes(target: TargetSpec) -> list[Any]:
    """The passes `compile_relax` runs before `MetaScheduleApplyDatabase`, for `target`: the
    target's library dispatch, then legalization and fusion."""
    from tvm import relax

    return [*relax_passes(target, "library_dispatch_passes"), relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(), relax.transform.FuseOps(),
            relax.transform.FuseTIR()]


def relax_passes(target: TargetSpec, stage: str) -> list[Any]:
    """Relax's passes of one `stage` of its pipeline for `target` (``library_dispatch_passes``,
    ``dataflow_lower_passes``, ``finalize_passes``), from the target's backend itself: TVM 0.27's
    `tvm.relax.pipeline` dispatches the last two to backend attributes its packages do not export."""
    import importlib

    name = "cuda" if target.kind == "cuda" else "cpu_generic"
    backend = importlib.import_module(f"tvm.relax.backend.{name}.pipeline")
    return list(getattr(backend, stage)(target.tvm()))


def load_model(source: Any, example_inputs: Sequence[Any] | None = None, *, name: str | None = None,
               input_shapes: dict[str, Sequence[int]] | None = None) -> Model:
    """Import `source` (module docstring) into Relax.

    `example_inputs`: the inputs of a `torch.nn.Module` (a tensor or a sequence of them), which fix
    the model's shapes; `input_shapes`: for an ONNX model whose inputs have symbolic dimensions,
    the shape of each input by name. FarmError, in one line, for anything that does not import."""
    from farm.core.tvm_import import import_tvm

    import_tvm()
    if isinstance(source, str | Path):
        return _load_file(Path(source), example_inputs, name, input_shapes)
    kind = type(source).__name__
    if kind == "IRModule":
        return _relax_model(source, name or "model")
    if kind == "ExportedProgram":
        return _from_exported(source, name or "model")
    if hasattr(source, "forward") and hasattr(source, "parameters"):  # a torch.nn.Module
        return _from_module(source, example_inputs, name or type(source).__name__)
    if kind == "ModelProto":
        return _from_onnx(source, name or "model", input_shapes)
    raise FarmError(f"a model is a torch.nn.Module with example inputs, a torch.export program, an ONNX model, a "
                    f"Relax IRModule, or a file ({', '.join(MODEL_SUFFIXES)}); got {type(source).__name__}")


def _load_file(path: Path, example_inputs: Sequence[Any] | None, name: str | None,
               input_shapes: dict[str, Sequence[int]] | None) -> Model:
    if not path.exists():
        raise FarmError(f"model file {path} does not exist")
    if not path.is_file():
        raise FarmError(f"{path} is not a file")
    name = name or path.stem
    if path.suffix == ".onnx":
        import onnx

        try:
            proto = onnx.load(str(path))
        except Exception as e:  # protobuf's DecodeError and friends
            raise FarmError(f"{path} is not an ONNX model ({one_line(e)})") from None
        return _from_onnx(proto, name, input_shapes)
    if path.suffix == ".pt2":
        torch = _torch()
        try:
            with _quiet_torch():
                program = torch.export.load(str(path))
        except Exception as e:  # a zip that is not an export, a file that is no zip
            raise FarmError(f"{path} is not a saved torch.export program ({one_line(e)})") from None
        return _from_exported(program, name)
    if path.suffix == ".py":
        try:
            scope = runpy.run_path(str(path))
        except SystemExit as e:
            raise FarmError(f"{path} exited ({e.code}) while building the model") from None
        except Exception as e:  # the user's code failed: say where
            raise FarmError(f"{path} failed while building the model: {one_line(e)}") from None
        missing = [n for n in ("model", "example_inputs") if n not in scope]
        if missing:
            raise FarmError(f"{path} must define `model` (a torch.nn.Module) and `example_inputs` (its inputs); "
                            f"it does not define {' or '.join(missing)}")
        return _from_module(scope["model"], example_inputs or scope["example_inputs"], name)
    raise FarmError(f"{path}: a model file ends in {', '.join(MODEL_SUFFIXES)} (ONNX, a saved torch.export "
                    "program, or a Python file defining `model` and `example_inputs`)")


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise FarmError("PyTorch models need torch: pip install torch") from None
    return torch


def _from_module(module: Any, example_inputs: Any, name: str) -> Model:
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise FarmError(f"`model` must be a torch.nn.Module, got {type(module).__name__}")
    if example_inputs is None:
        raise FarmError("a PyTorch module needs example inputs (they fix the model's shapes)")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise FarmError(f"example inputs must be tensors, got {brief([type(a).__name__ for a in args])}")
    try:
        with torch.no_grad(), _quiet_torch():
            program = torch.export.export(module.eval(), args)
    except Exception as e:  # a shape mismatch in forward, an untraceable construct
        shapes = ", ".join("x".join(map(str, a.shape)) for a in args)
        raise FarmError(f"the model does not run on example inputs of shape {shapes}: {one_line(e)}") from None
    return _from_exported(program, name)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """PyTorch's loggers muted: a failed export or load logs its traceback before it raises, and the
    farm says it in one line instead."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _torch_runner(module: Any) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """`module` run eagerly on CPU tensors of NumPy inputs, its outputs flattened to NumPy arrays."""
    torch = _torch()

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            result = module(*[torch.from_numpy(np.ascontiguousarray(x)) for x in inputs])
        leaves = torch.utils._pytree.tree_leaves(result)
        return [t.detach().cpu().numpy() for t in leaves if isinstance(t, torch.Tensor)]

    return run


def _from_exported(program: Any, name: str) -> Model:
    from tvm.relax.frontend.torch import from_exported_program

    from farm.core.half_import import HALF_CONVERTERS

    try:
        mod = from_exported_program(program, custom_convert_map=HALF_CONVERTERS)
    except AssertionError as e:  # the frontend's "Unsupported function types [...]"
        raise FarmError(f"the model does not import into TVM Relax: {_unsupported(e)}") from None
    except Exception as e:
        raise FarmError(f"the model does not import into TVM Relax: {one_line(e)}") from None
    model = _relax_model(mod, name)
    model.framework, model.framework_name = _torch_runner(program.module()), "PyTorch eager"
    return model


def _from_onnx(proto: Any, name: str, input_shapes: dict[str, Sequence[int]] | None) -> Model:
    from tvm.relax.frontend.onnx import from_onnx

    try:
        mod = from_onnx(proto, shape_dict={k: list(v) for k, v in (input_shapes or {}).items()} or None)
    except Exception as e:  # OpNotImplemented names the operators
        raise FarmError(f"the ONNX model does not import into TVM Relax: {one_line(e)}") from None
    model = _relax_model(mod, name)
    weights = {init.name for init in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in weights]
    model.framework, model.framework_name = _onnx_runner(proto, names), "onnxruntime"
    return model


def _onnx_runner(proto: Any, names: list[str]) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """The ONNX model run by onnxruntime on the CPU (imported when first run: only checks need it)."""

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        try:
            import onnxruntime
        except ImportError:
            raise FarmError("checking an ONNX model's outputs needs onnxruntime: pip install onnxruntime") from None
        session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return list(session.run(None, dict(zip(names, inputs, strict=True))))

    return run


def _unsupported(e: Exception) -> str:
    text = one_line(e)
    return text.replace("Unsupported function types", "unsupported operators") if text else "unsupported operator"


def _relax_model(mod: Any, name: str) -> Model:
    """The Relax module as a Model: static shapes checked, batch norms folded into the convolutions
    before them (cast ones too: farm.core.half_import), the other inference-only operators decomposed."""
    from tvm import relax
    from tvm.tirx import IntImm

    from farm.core.half_import import fold_batch_norms

    if "main" not in [gv.name_hint for gv in mod.functions]:
        raise FarmError("the Relax module has no `main` function")
    inputs = []
    for param in mod["main"].params:
        ty = param.ty
        try:
            dims = list(ty.shape)
        except (AttributeError, TypeError):  # not a tensor, or one of unknown rank
            raise FarmError(f"model input {param.name} is not a tensor of known rank ({ty})") from None
        if not all(isinstance(d, IntImm) for d in dims):
            raise FarmError(f"model input {param.name} has dynamic shape {ty}: the farm tunes static shapes; export "
                            "the model with fixed shapes (ONNX: give each input's shape)")
        inputs.append(ModelInput(param.name, tuple(int(d) for d in dims), str(ty.dtype)))
    mod = fold_batch_norms(relax.transform.FoldBatchnormToConv2D()(mod))
    mod = relax.transform.DecomposeOpsForInference()(mod)
    return Model(name, mod, inputs)
