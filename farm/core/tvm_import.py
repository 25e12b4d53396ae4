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

import sys
from types import ModuleType


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
