"""farm.core.tvm_import: TVM is imported without torch in the farm's processes, and torch stays
importable after it. A stand-in torch package on the path records when it is imported, then
raises ImportError (tvm_ffi takes that as "no torch"; a real torch works as well)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

CHECK = """
import sys
from pathlib import Path
mark = Path(sys.argv[1])
{first}
print("after tvm:", mark.exists())
try:
    import torch
except ImportError as e:
    print("after torch:", mark.exists(), e)
"""


def _run(tmp_path: Path, first: str) -> str:
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(
        "import sys\nfrom pathlib import Path\nPath(sys.argv[1]).write_text('imported')\n"
        "raise ImportError('the stand-in torch')\n")
    mark = tmp_path / "mark"
    mark.unlink(missing_ok=True)
    env = {"PYTHONPATH": f"{tmp_path}:{_REPO}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", CHECK.format(first=first), str(mark)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_tvm_alone_imports_torch_when_it_is_there(tmp_path: Path) -> None:
    # What import_tvm avoids: tvm_ffi imports torch at its own import.
    assert _run(tmp_path, "import tvm").splitlines() == ["after tvm: True", "after torch: True the stand-in torch"]


def test_import_tvm_leaves_torch_out_and_importable(tmp_path: Path) -> None:
    first = "from farm.core.tvm_import import import_tvm\ntvm = import_tvm()\nassert tvm.runtime"
    assert _run(tmp_path, first).splitlines() == ["after tvm: False", "after torch: True the stand-in torch"]


def test_a_worker_actor_imports_tvm_first_even_when_another_thread_imports_it_at_once(tmp_path: Path) -> None:
    """The worker actor's start begins TVM's import in the background (workers.actor); a thread
    that then imports TVM as it comes, as the device's registration does (`from tvm import rpc`),
    waits for that import instead of importing torch with it."""
    first = ("import threading\nfrom workers.actor import _import_tvm_in_background\n"
             "_import_tvm_in_background()\n"
             "def register():\n    from tvm import rpc\n    assert rpc.connect_tracker\n"
             "other = threading.Thread(target=register)\nother.start()\nother.join()\n"
             "import tvm\nassert tvm.rpc.connect_tracker")
    assert _run(tmp_path, first).splitlines() == ["after tvm: False", "after torch: True the stand-in torch"]


INTRINSICS = """
import inspect, sys
import importlib._bootstrap as bootstrap
from farm.core.tvm_import import import_tensor_intrinsics
intrin = import_tensor_intrinsics()
from tvm.s_tir import TensorIntrin
assert TensorIntrin.get(intrin.WMMA_SYNC_16x16x16_f16f16f32_INTRIN) is not None  # registered
frame_file = inspect.getabsfile(bootstrap._find_and_load)
print(inspect.modulesbyfile.get(frame_file), inspect.getmodule(bootstrap._find_and_load.__code__, frame_file).__name__)
assert import_tensor_intrinsics() is intrin  # once per process
"""


def test_tensor_intrinsics_import_with_the_import_machinerys_frames_known_to_inspect() -> None:
    """The intrinsics register, and the import machinery's pseudo-files are in inspect's module
    cache under their own modules, so that none of TVMScript's stack walks scans sys.modules
    for them (what made the import take 20 s)."""
    proc = subprocess.run([sys.executable, "-c", INTRINSICS], capture_output=True, text=True, cwd=_REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["importlib._bootstrap", "importlib._bootstrap"]
