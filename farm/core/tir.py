"""Workloads that are any TIR PrimFunc: a fused kernel of a model, or one a user wrote in TVMScript.

A `TirWorkload` is the workload named ``tir``: its parameters are the function's name (``func``,
for people), its structural hash (``hash``, its identity: two structurally equal functions are
one workload) and its IR (``ir``: TVM's JSON serialization of the PrimFunc, `tvm.ir.save_json`).
The IR travels with the workload wherever it goes (job spec, task rows, trials, exports), so any
process on any node rebuilds the same function from it, and loading it runs no Python code
(TVMScript is Python: a script is parsed only where the user hands it over, on their machine).

The function is normalized before it is hashed: its ``global_symbol`` is ``main``, the name every
farm module gives the kernel it schedules and MetaSchedule's databases give a task's workload.

Its contract is the farm's: arguments ``inputs..., output``, exactly one output (the one
parameter its blocks write, the last), static shapes. The reference output of the check is the
unscheduled function itself, compiled for this CPU and run on the same random inputs.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from farm.core.errors import FarmError, brief, one_line
from farm.core.workloads import Workload

TIR = "tir"
# The IR of one kernel is tens of KB (a fused conv2d with its epilogue: about 40 KB); a bound
# keeps a stray megabyte-sized document from riding along with every trial.
MAX_IR_BYTES = 4 * 2**20
PARAM_NAMES = ("func", "hash", "ir")
# A function's name, as it appears in keys and family keys (VARCHAR(300) with the template's).
NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}", re.ASCII)


@dataclass(frozen=True)
class TirWorkload(Workload):
    """A PrimFunc as a workload (see the module docstring). Made by `tir_workload`, which validates."""

    def __post_init__(self) -> None:
        if self.name != TIR or tuple(k for k, _ in self.params) != PARAM_NAMES:
            raise ValueError(f"a TirWorkload has name {TIR!r} and parameters {PARAM_NAMES}")

    @property
    def func_name(self) -> str:
        return self.p["func"]

    @property
    def hash(self) -> str:
        return self.p["hash"]

    @property
    def key(self) -> str:
        # The hash is the identity; the IR (tens of KB) stays out of keys.
        return json.dumps({"name": TIR, "params": {"func": self.func_name, "hash": self.hash}}, sort_keys=True)

    @cached_property
    def family(self) -> str:
        """``tir:NAME@DIGEST``, DIGEST a hash of the function's TVMScript with every number taken
        out: the shapes of one kernel (a layer norm of any width) are one family, and share a
        cost model."""
        text = re.sub(r"\b\d+(\.\d*)?(e[-+]?\d+)?\b", "#", self._func.script())
        return f"{TIR}:{self.func_name}@{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    @cached_property
    def _func(self) -> Any:
        import tvm

        return tvm.ir.load_json(self.p["ir"])

    def prim_func(self) -> Any:
        return self._func

    @cached_property
    def _signature(self) -> _Signature:
        return _signature(self._func, self.func_name)

    def input_shapes(self) -> list[tuple[int, ...]]:
        return [shape for shape, _ in self._signature.inputs]

    def input_dtypes(self) -> list[str]:
        return [dtype for _, dtype in self._signature.inputs]

    def output_shape(self) -> tuple[int, ...]:
        return self._signature.output[0]

    @property
    def dtype(self) -> str:
        """The output's dtype."""
        return self._signature.output[1]

    def build_te(self) -> list[Any]:
        raise FarmError(f"{self} is a TIR function, not a TE definition")

    def compute_extents(self) -> tuple[int, ...]:
        raise FarmError(f"{self} is a TIR function: it has no single compute stage of the farm's operators")

    def flops(self) -> int:
        """TVM's estimate of the function's floating-point operations (at least 1)."""
        return self._flops

    @cached_property
    def _flops(self) -> int:
        import tvm
        from tvm.s_tir.analysis import estimate_tir_flops

        return max(1, int(estimate_tir_flops(tvm.IRModule({"main": self._func}))))

    def bytes(self) -> int:
        shapes = [*self._signature.inputs, self._signature.output]
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in shapes)

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Floats from U(-1, 1) (never zeros: they hide unwritten outputs); integers 0 or 1 and
        booleans at random (integer inputs are often indices, and 0 and 1 are valid ones)."""
        rng = np.random.default_rng(seed)
        out = []
        for shape, dtype in self._signature.inputs:
            if np.issubdtype(np.dtype(dtype), np.floating):
                out.append(rng.uniform(-1.0, 1.0, size=shape).astype(dtype))
            else:
                out.append(rng.integers(0, 2, size=shape).astype(dtype))
        return out

    def reference(self, inputs: list[np.ndarray]) -> np.ndarray:
        """The unscheduled function's output on `inputs`, compiled for and run on this CPU."""
        import tvm

        lib = _reference_library(self.hash, self._func)
        dev = tvm.cpu()
        args = [tvm.runtime.tensor(x, dev) for x in inputs]
        out = tvm.runtime.empty(self.output_shape(), self.dtype, dev)
        lib["main"](*args, out)
        return out.numpy()

    def tolerance(self) -> float:
        half = any(d in ("float16", "bfloat16") for d in [*self.input_dtypes(), self.dtype])
        return 2e-2 if half else 1e-4

    def __str__(self) -> str:
        return f"{TIR}:{self.func_name}@{self.hash[:10]}"


@dataclass(frozen=True)
class _Signature:
    inputs: list[tuple[tuple[int, ...], str]]
    output: tuple[tuple[int, ...], str]


_LIBRARIES: dict[str, Any] = {}


def _reference_library(key: str, func: Any) -> Any:
    if key not in _LIBRARIES:
        import tvm

        _LIBRARIES[key] = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target("llvm"))
    return _LIBRARIES[key]


def _signature(func: Any, name: str) -> _Signature:
    """The function's inputs and output (shapes, dtypes); FarmError where it breaks the contract."""
    from tvm import tirx

    shapes: list[tuple[tuple[int, ...], str]] = []
    for param in func.params:
        shape = getattr(param, "shape", None)
        if shape is None:
            raise FarmError(f"TIR function {name}: parameter {param} is a scalar; the farm tunes functions whose "
                            "parameters are all buffers (bind scalars to constants first)")
        if not all(isinstance(dim, tirx.IntImm) for dim in shape):
            raise FarmError(f"TIR function {name}: buffer {param.name} has the dynamic shape "
                            f"{brief([str(d) for d in shape])}; the farm tunes static shapes only")
        shapes.append((tuple(int(d) for d in shape), str(param.dtype)))
    written = _written_params(func, name)
    if len(written) != 1:
        what = f"writes {len(written)} of its parameters ({', '.join(written)})" if written else \
            "writes none of its parameters"
        raise FarmError(f"TIR function {name} {what}; the farm tunes functions with one output")
    last = func.params[-1].name if func.params else None
    if written[0] != last:
        raise FarmError(f"TIR function {name}: its output {written[0]} must be its last parameter (inputs..., output)")
    return _Signature(shapes[:-1], shapes[-1])


def _written_params(func: Any, name: str) -> list[str]:
    """Names of the parameters some block writes; FarmError if the function has no block."""
    import tvm
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    except Exception as e:  # TVM's errors for a function a schedule cannot be made of
        raise FarmError(f"TIR function {name} cannot be scheduled ({one_line(e)}); write it with T.sblock blocks, "
                        "as te.create_prim_func or Relax's LegalizeOps make it") from None
    try:
        pending = list(sch.get_child_blocks(sch.get_sblock("root")))
    except Exception:  # no root block: a body of plain statements
        pending = []
    if not pending:
        raise FarmError(f"TIR function {name} has nothing to schedule: it holds no T.sblock block (write its "
                        "computation in blocks, as te.create_prim_func or Relax's LegalizeOps make it)")
    params = {p.name for p in func.params}
    written: list[str] = []
    while pending:
        block = pending.pop()
        for region in sch.get(block).writes:
            buffer = region.source.name
            if buffer in params and buffer not in written:
                written.append(buffer)
        pending.extend(sch.get_child_blocks(block))
    return sorted(written)


def tir_workload(func: Any, name: str | None = None) -> TirWorkload:
    """The workload of a PrimFunc, or of an IRModule holding one (or the one called `name`).

    FarmError, in one line, for anything else, a function with dynamic shapes, scalar parameters,
    no block, or other than one output, its last parameter."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from farm.core.tvm_import import import_tvm

    import_tvm()
    if isinstance(func, tvm.IRModule):
        funcs = {gv.name_hint: f for gv, f in func.functions.items() if isinstance(f, tirx.PrimFunc)}
        if name is not None:
            if name not in funcs:
                raise FarmError(f"the module has no TIR function {name!r}; it has {', '.join(sorted(funcs)) or 'none'}")
            func = funcs[name]
        elif len(funcs) != 1:
            raise FarmError(f"the module holds {len(funcs)} TIR functions ({', '.join(sorted(funcs))}): "
                            "name the one to tune")
        else:
            name, func = next(iter(funcs.items()))
    if not isinstance(func, tirx.PrimFunc):
        raise FarmError(f"a TIR workload is a PrimFunc or an IRModule holding one, got {type(func).__name__}")
    name = name or (str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main")
    if not NAME.fullmatch(name):
        raise FarmError(f"a TIR function's name is 1 to 100 letters, digits or _.- characters, got {brief(name)}")
    func = func.with_attr("global_symbol", "main")
    _signature(func, name)
    ir = tvm.ir.save_json(func)
    if len(ir) > MAX_IR_BYTES:
        raise FarmError(f"TIR function {name} is {len(ir):,} bytes of IR, more than the farm's bound of "
                        f"{MAX_IR_BYTES:,}")
    digest = f"{tvm_ffi.structural_hash(func) & (2**64 - 1):016x}"
    return TirWorkload(TIR, (("func", name), ("hash", digest), ("ir", ir)))


def tir_from_params(params: dict[str, Any]) -> TirWorkload:
    """The workload whose parameters are `params` (`TirWorkload.to_json`'s), validated again: the IR
    must load, keep the contract, and hash to ``hash``."""
    if set(params) != set(PARAM_NAMES) or not all(isinstance(params[k], str) for k in PARAM_NAMES):
        raise FarmError(f"a tir workload's parameters are {', '.join(PARAM_NAMES)} (strings), got "
                        f"{brief(sorted(params))}; make one with farm.tir_workload or farm tune --tir FILE")
    if len(params["ir"]) > MAX_IR_BYTES:
        raise FarmError(f"tir workload {brief(params['func'])}: {len(params['ir']):,} bytes of IR, more than the "
                        f"farm's bound of {MAX_IR_BYTES:,}")
    from farm.core.tvm_import import import_tvm

    tvm = import_tvm()
    try:
        func = tvm.ir.load_json(params["ir"])
    except Exception as e:  # TVM's errors for JSON that is not a serialized object
        raise FarmError(f"tir workload {brief(params['func'])}: its IR does not load ({one_line(e)})") from None
    workload = tir_workload(func, params["func"])
    if workload.hash != params["hash"]:
        raise FarmError(f"tir workload {brief(params['func'])}: its IR hashes to {workload.hash}, not "
                        f"{brief(params['hash'])} (edited by hand, or another TVM version)")
    return workload


def is_script(word: str) -> bool:
    """Whether a workload word of the command line names a TVMScript file (``FILE.py`` or
    ``FILE.py:NAME``) rather than a workload or preset."""
    return word.endswith(".py") or ".py:" in word


def tir_from_file(spec: str) -> TirWorkload:
    """The workload of a TVMScript file: ``FILE`` holding one ``@T.prim_func`` (or an
    ``@I.ir_module`` class with one), or ``FILE:NAME`` to pick one of several.

    Only the decorated definitions are parsed, by TVMScript's parser (with ``T`` and ``I`` bound):
    the rest of the file (imports, code) is not run."""
    path_text, _, name = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    path = Path(path_text)
    if not path.is_file():
        raise FarmError(f"TVMScript file {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise FarmError(f"cannot read {path}: {e}") from None
    except SyntaxError as e:
        raise FarmError(f"{path} is not Python/TVMScript: {e.msg} at line {e.lineno}") from None
    candidates = [node for node in tree.body
                  if isinstance(node, ast.FunctionDef | ast.ClassDef)
                  and any(_decorator_name(d) in ("prim_func", "ir_module") for d in node.decorator_list)]
    inner = None  # the function to take from an @I.ir_module class
    if name:
        named = [node for node in candidates if node.name == name]
        candidates, inner = (named, None) if named else ([n for n in candidates if isinstance(n, ast.ClassDef)], name)
    if not candidates:
        raise FarmError(f"{path} holds no @T.prim_func or @I.ir_module definition" + (f" of {name}" if name else ""))
    if len(candidates) > 1:
        names = ", ".join(node.name for node in candidates)
        raise FarmError(f"{path} holds {len(candidates)} definitions ({names}): name one as {path}:NAME")
    node = candidates[0]
    lines = source.splitlines()
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    text = "\n".join(lines[start:node.end_lineno])
    from farm.core.tvm_import import import_tvm

    import_tvm()
    from tvm.script import ir as I
    from tvm.script import tirx as T
    from tvm.script.parser import parse

    try:
        parsed = parse(text, extra_vars={"T": T, "I": I})
    except Exception as e:  # the parser's diagnostics: a DiagnosticError with the offending line
        raise FarmError(f"{path}: {node.name} does not parse as TVMScript ({one_line(e)})") from None
    return tir_workload(parsed, inner if isinstance(node, ast.ClassDef) else node.name)


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
