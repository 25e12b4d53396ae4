"""PyTorch integration: run a model compiled by the farm on torch tensors, as a module or as a
`torch.compile` backend.

    import farm.torch

    fast = farm.torch.compile(model, example_inputs, best="best.json")      # a torch.nn.Module
    out = fast(x)                                   # what model(x) returns, computed by TVM

    fast = torch.compile(model, backend="farm", dynamic=False,
                         options={"best": "best.json", "db": "postgresql://...", "target": "cuda"})

`compile` exports the module with `torch.export` (in eval mode: the module is switched to it, as
`farm.core.model.load_model` does), builds it with `farm.build_model.compile_model` (the fastest
record of each kernel in the export `best` and the farm's database `db`; TVM's default schedules
for the rest, with a warning) and returns a `FarmModule`. Its `forward(*tensors)` takes tensors
of the example inputs' shapes and dtypes on the device the model was built for (the CPU for
``llvm``, ``cuda:0`` for ``cuda``) and returns what the original module returns (a tensor, a tuple,
any pytree of tensors) without copying: inputs reach TVM through DLPack (a non-contiguous or
misaligned input is copied once, to the contiguous, 64-byte-aligned layout TVM's kernels assume),
and TVM's outputs come back as torch tensors over the same memory. On CUDA the model runs on
PyTorch's current stream, so that it orders with the surrounding torch work as a torch op would.
It is inference only: outputs carry no autograd history. An input of another shape, dtype or
device, or a wrong number of inputs, is a FarmError of one line naming the input. The build is
`FarmModule.compiled` (a `farm.build_model.CompiledModel`: `tuned`, `untuned`,
`export_library`).

The `torch.compile` backend, registered as ``"farm"`` when this module is imported (also
`farm.torch.backend`), compiles each graph TorchDynamo captures the same way. Its options are
torch.compile's own `options` dict, with the keyword arguments of `compile`: ``target``
(default: ``cuda`` when the graph's inputs are on a CUDA device, else ``llvm``), ``best``, ``db``
and ``cuda_graph``; an unknown key is a FarmError. The farm compiles static shapes: pass
``dynamic=False`` to torch.compile, so that a new input shape is a new graph rather than a
symbolic one (a graph with symbolic shapes is refused with a FarmError saying so). A graph break
gives the backend several graphs, each compiled on its own; ``fullgraph=True`` makes a break an
error instead. A graph TVM cannot import or build is a FarmError naming the problem, which
TorchDynamo reports wrapped in its BackendCompilerFailed (the FarmError is its `inner_exception`).

Only this module of the farm imports PyTorch; `import farm` does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from farm.core.errors import FarmError, brief, one_line

if TYPE_CHECKING:
    from farm.build_model import CompiledModel, Records
    from farm.core.model import ModelInput

__all__ = ["BACKEND_OPTIONS", "FarmModule", "backend", "compile"]

# The keys of torch.compile's `options` that the "farm" backend takes: `compile`'s keyword arguments.
BACKEND_OPTIONS = ("target", "best", "db", "cuda_graph")


class FarmModule(torch.nn.Module):
    """A model compiled by the farm, called like the module it was compiled from (module docstring)."""

    def __init__(self, compiled: CompiledModel, out_spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.compiled = compiled
        self._run = _Runner(compiled, out_spec)
        self.train(False)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """The model's outputs for `inputs`, in the structure the original module returns them."""
        return self._run(*inputs)

    def extra_repr(self) -> str:
        """The model, its target and how many of its kernels have tuned records."""
        c = self.compiled
        return (f"{c.model.name} on {c.target.kind}, {len(c.tuned)} of {len(c.tuned) + len(c.untuned)} kernels "
                f"tuned")


def compile(model: torch.nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], *,
            target: str | dict[str, Any] | None = None, best: Records | None = None, db: str | None = None,
            cuda_graph: bool = True) -> FarmModule:
    """`model` compiled by the farm for `target` (None: ``cuda`` if the example inputs are on a CUDA
    device, else ``llvm``) with the records of `best` (a farm.best/1 export: path, document or
    records) and of the database at the URL `db`. FarmError, in one line, for a module that does
    not export or import, bad options, or a model that does not build."""
    if not isinstance(model, torch.nn.Module):
        raise FarmError(f"farm.torch.compile takes a torch.nn.Module, got {type(model).__name__}")
    args = _example_tuple(example_inputs)
    try:
        with torch.no_grad():
            program = torch.export.export(model.eval(), args)
    except Exception as e:  # a shape mismatch in forward, an untraceable construct
        raise FarmError(f"{type(model).__name__} does not export with torch.export on example inputs of "
                        f"{_describe_all(args)}: {one_line(e)}") from None
    return FarmModule(*_build(program, type(model).__name__, args, target, best, db, cuda_graph))


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None,
            mode: str | None = None) -> Callable[..., Any]:
    """The ``"farm"`` backend of `torch.compile`: `gm` compiled by the farm, as a function of torch
    tensors returning what `gm` returns. `options`: torch.compile's, with `BACKEND_OPTIONS` keys."""
    if mode is not None:
        raise FarmError(f"the farm backend has no modes (got mode={mode!r}): pass its settings as "
                        f"options={{...}} with keys {', '.join(BACKEND_OPTIONS)}")
    settings = dict(options or {})
    unknown = sorted(set(settings) - set(BACKEND_OPTIONS))
    if unknown:
        raise FarmError(f"unknown option {brief(unknown[0])} for the farm backend; its options: "
                        f"{', '.join(BACKEND_OPTIONS)}")
    symbolic = [f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else brief(x)
                for x in example_inputs
                if not isinstance(x, torch.Tensor) or any(isinstance(d, torch.SymInt) for d in x.shape)]
    if symbolic:
        raise FarmError(f"the graph has symbolic shapes ({symbolic[0]}) and the farm compiles static shapes: "
                        "call torch.compile(..., backend='farm', dynamic=False)")
    args = tuple(x.detach() for x in example_inputs)
    try:
        with torch.no_grad():
            program = torch.export.export(gm, args)
    except Exception as e:  # an operator or construct torch.export cannot trace
        raise FarmError(f"the graph TorchDynamo captured does not export with torch.export: {one_line(e)}") from None
    return _Runner(*_build(program, "graph", args, settings.get("target"), settings.get("best"),
                           settings.get("db"), bool(settings.get("cuda_graph", True))))


class _Runner:
    """Calls the compiled model's ``main`` on torch tensors: checks, DLPack in, run, DLPack out."""

    def __init__(self, compiled: CompiledModel, out_spec: pytree.TreeSpec) -> None:
        self.compiled, self.out_spec = compiled, out_spec
        self._device = torch.device("cuda", compiled.device.index) if compiled.target.is_gpu else torch.device("cpu")

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The model's outputs for `inputs` (FarmError if they do not match the model's inputs)."""
        from farm.build_model import flatten

        args = [self._argument(spec, x) for spec, x in zip(self._inputs(inputs), inputs, strict=True)]
        with self._stream():
            result = self.compiled.vm["main"](*args)
        return pytree.tree_unflatten([torch.from_dlpack(t) for t in flatten(result)], self.out_spec)

    def _inputs(self, inputs: tuple[Any, ...]) -> list[ModelInput]:
        """The model's input specs, once the number of `inputs` is checked against them."""
        specs = self.compiled.model.inputs
        if len(inputs) != len(specs):
            raise FarmError(f"model {self.compiled.model.name} takes {len(specs)} inputs "
                            f"({', '.join(s.name for s in specs)}), got {len(inputs)}")
        return specs

    def _argument(self, spec: ModelInput, x: Any) -> Any:
        """`x` as a TVM tensor over the same memory, after checking it against the input `spec`."""
        import tvm

        expected = _describe(spec.dtype, spec.shape)
        if not isinstance(x, torch.Tensor):
            raise FarmError(f"input {spec.name}: expected a tensor {expected}, got {type(x).__name__}")
        got = _describe(_dtype(x), tuple(x.shape))
        if got != expected:
            raise FarmError(f"input {spec.name}: expected {expected}, got {got}")
        if x.device != self._device:
            raise FarmError(f"input {spec.name} is on {x.device}; the model runs on {self.compiled.device} "
                            f"(target {self.compiled.target.kind})")
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        if x.data_ptr() % 64:  # a view into a tensor: TVM's kernels assume 64-byte aligned buffers
            x = x.clone()
        return tvm.runtime.from_dlpack(x)

    def _stream(self) -> contextlib.AbstractContextManager[Any]:
        """On CUDA: TVM launches on PyTorch's current stream of the model's device. Elsewhere: nothing."""
        if not self.compiled.target.is_gpu:
            return contextlib.nullcontext()
        import tvm_ffi

        dev = self.compiled.device
        return tvm_ffi.use_raw_stream(dev, torch.cuda.current_stream(dev.index).cuda_stream)


def _build(program: Any, name: str, args: tuple[torch.Tensor, ...], target: str | dict[str, Any] | None,
           best: Records | None, db: str | None, cuda_graph: bool) -> tuple[CompiledModel, pytree.TreeSpec]:
    """The exported `program` built by compile_model, and the structure of its outputs."""
    from farm.build_model import compile_model
    from farm.core.model import load_model

    model = load_model(program, name=name)
    returned = _count_outputs(model.mod["main"].ret_ty)
    out_spec = program.call_spec.out_spec
    if returned != out_spec.num_leaves:
        raise FarmError(f"{name} returns {out_spec.num_leaves} values of which TVM computes {returned}: the farm "
                        "compiles models whose outputs are all tensors computed from the inputs")
    store = None
    if db is not None:
        from db.store import open_store

        store = open_store(db)
    try:
        compiled = compile_model(model, target=_default_target(args) if target is None else target, best=best,
                                 store=store, cuda_graph=cuda_graph)
    finally:
        if store is not None:
            store.close()
    return compiled, out_spec


def _default_target(args: tuple[torch.Tensor, ...]) -> str | dict[str, Any]:
    """``llvm`` for CPU tensors; for CUDA ones, ``cuda`` for the compute capability of their device."""
    devices = {x.device for x in args}
    if len(devices) > 1:
        raise FarmError(f"the example inputs are on several devices ({', '.join(sorted(map(str, devices)))}); "
                        "a model runs on one")
    device = next(iter(devices), torch.device("cpu"))
    if device.type == "cpu":
        return "llvm"
    if device.type != "cuda":
        raise FarmError(f"the farm compiles for the CPU (llvm) and CUDA; the example inputs are on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    return {"kind": "cuda", "arch": f"sm_{major}{minor}"}


def _count_outputs(ty: Any) -> int:
    """How many tensors a Relax function returns, from its return type (a tensor or nested tuples)."""
    from tvm import relax

    if isinstance(ty, relax.TupleType):
        return sum(_count_outputs(f) for f in ty.fields)
    return 1


def _example_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """The example inputs as a tuple of tensors (one tensor, or a sequence of them)."""
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise FarmError(f"example inputs must be a tensor or a sequence of tensors, got "
                        f"{brief([type(a).__name__ for a in args])}")
    return args


def _dtype(x: torch.Tensor) -> str:
    """The tensor's dtype as TVM names it: torch.float32 -> float32."""
    return str(x.dtype).removeprefix("torch.")


def _describe(dtype: str, shape: Sequence[int]) -> str:
    """`float32[2, 3, 8, 8]`: a dtype and shape as the errors print them."""
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _describe_all(args: Sequence[torch.Tensor]) -> str:
    """The example inputs as the errors print them."""
    return ", ".join(_describe(_dtype(a), tuple(a.shape)) for a in args)


def _register() -> None:
    """Register `backend` with TorchDynamo as ``"farm"`` (once: a reload of this module keeps the first)."""
    from torch._dynamo import register_backend

    with contextlib.suppress(AssertionError):  # "duplicate name: farm"
        register_backend(backend, name="farm")


_register()
