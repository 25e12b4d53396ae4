"""TVM's import in the farm's own processes, without PyTorch's.

TVM's FFI package (tvm_ffi 0.1) imports torch at its own import whenever torch is installed, to
exchange tensors with it through DLPack, which the farm never does. On a GPU host with PyTorch
installed, that import is 4.1 s of the 6 s `import tvm` takes (`python -X importtime`, 2 x H200),
and every process that imports TVM paid it: `farm tune` and `farm submit` checking a job, each
build process, RPC tracker, RPC server and session process, each search actor.

`import_tvm` imports TVM with `import torch` failing for the duration (a None entry in
sys.modules makes an import raise ImportError, which tvm_ffi takes as "no torch"), then removes
that entry: torch stays importable in the process afterwards, but TVM's FFI in it does not know
torch. So it is called only in processes of the farm's own, at their start, before any other
thread could import TVM: the `farm` commands that check or run jobs, worker and search actors,
build processes, the RPC tracker, servers and session processes. Never by library code a user's
process runs (farm.Client): there TVM is imported as the user's environment has it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from collections.abc import Iterator
from types import ModuleType

_INTRINSICS = "tvm.s_tir.tensor_intrin"
# Held while the tensor intrinsics are imported, and while a placeholder stands in for them
# (`without_tensor_intrinsics`): no thread imports them meanwhile and gets the placeholder.
_INTRINSICS_LOCK = threading.RLock()


def import_tvm() -> ModuleType:
    """TVM, imported now without torch unless this process imported either already (then as is)."""
    if "tvm" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            import tvm
        finally:
            del sys.modules["torch"]
    import tvm

    return tvm


def import_tensor_intrinsics() -> ModuleType:
    """TVM's CUDA tensor intrinsics (`tvm.s_tir.tensor_intrin.cuda`: WMMA, mma.sync, ldmatrix),
    imported once per process, in about a third of the time a plain import takes.

    Importing them parses about 500 TVMScript functions, and TVMScript's `T.prim_func` takes
    `inspect.stack()` of each. For each frame, `inspect.getmodule` looks the frame's file up in
    its cache `inspect.modulesbyfile`, and on a miss scans all of sys.modules. The import
    machinery's frames (`<frozen importlib._bootstrap>`, `..._external`), about ten in each of
    those stacks, name no file that any module has, so every lookup of theirs missed. A plain
    import took 20.9-25.4 s on the 2-core CPU machine in a process with TVM imported, and every
    build slot's first tensor-core build paid that. With those two files entered into the cache
    first (under their own modules, where their frames' code is from) it took 5.9-7.0 s, most of
    it TVMScript's parsing.
    """
    with _INTRINSICS_LOCK:
        if f"{_INTRINSICS}.cuda" not in sys.modules:
            import_tvm()
            for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
                module = sys.modules[name]
                some_function = next(v for v in vars(module).values() if inspect.isfunction(v))
                # The key getmodule computes for a frame of this module (its pseudo-file made absolute
                # against the current directory, which stays as it is for the import below).
                inspect.modulesbyfile.setdefault(inspect.getabsfile(some_function), name)
        return importlib.import_module(f"{_INTRINSICS}.cuda")


@contextlib.contextmanager
def without_tensor_intrinsics() -> Iterator[None]:
    """Within this block, `import tvm.s_tir.tensor_intrin` imports nothing, unless the intrinsics
    were imported before (then it is theirs, as usual).

    MetaSchedule's TuneContext imports all of TVM's tensor intrinsics when it is made, whatever its
    rules use: seconds of TVMScript parsing (`import_tensor_intrinsics`) in every process that
    makes one. A design space whose rules use none (farm.core.templates.design_space) makes its
    context here. An empty module stands in for the package meanwhile, and is removed after.
    """
    with _INTRINSICS_LOCK:
        if _INTRINSICS in sys.modules:
            yield
            return
        placeholder = sys.modules[_INTRINSICS] = ModuleType(_INTRINSICS)
        try:
            yield
        finally:
            if sys.modules.get(_INTRINSICS) is placeholder:
                del sys.modules[_INTRINSICS]
