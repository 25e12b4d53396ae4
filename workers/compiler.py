"""Compilation of one candidate: TVM's module compiled into a library, its device code by nvcc.

For cuda, every candidate's device code is compiled once, by `nvcc --cubin -arch=<target arch>`
on the build node; ptxas's resource report is read, and kernels that cannot launch (registers x
threads over the register file) are rejected there, not on the GPU node. Where TVM's CUDA
runtime is loaded (a GPU node), `tvm.compile` compiles the device code itself, through the
global function `tvm_callback_cuda_compile` (NVRTC, by default): a build process answers that
call with its nvcc's cubin (`_DeviceCode`), which the library then holds. Where it is not (a
CPU-only build node), the TVM 0.27 wheel only emits CUDA source (fmt "cuda"): the build runs
nvcc on it and ships the cubin beside the library, and our RPC server (workers.rpc_server)
hands it to the runtime instead of compiling on the GPU node. TVM's GPU-code verification
(threads, shared memory, vthreads) runs on the lowered module before any of that.

`compile_into` is what every build (workers.builder) and every measurement's rebuild
(workers.runner) compiles through; `compile_module` is the same compile for `farm.build`
(farm.apply). `BuildResult` is what one candidate's build gives: `compile_into` fills it in.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.core.measure import Status
from farm.core.targets import TargetSpec
from farm.core.templates.base import compile_scheduled

# nvcc's ptxas report: "Used 72 registers, used 1 barriers, 2368 bytes smem"
_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
# A kernel's declaration in TVM's CUDA source: extern "C" __global__ void __launch_bounds__(128) main_kernel(
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\((\d+)\)\s+(\w+)\s*\(")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores")


@dataclass
class BuildResult:
    """A built candidate (`status` None) or why it could not be built."""

    config_index: int
    config: dict[str, Any]
    status: Status | None = None
    error: str = ""
    library: str = ""  # exported shared library, loadable by TVM's runtime
    cubin: str = ""  # cuda: device code compiled on the build node
    source_sha: str = ""  # cuda: sha256 of the CUDA source the cubin was compiled from
    build_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)  # registers, spills, ...
    # When and where it was built: {"build": [start, end] (epoch seconds), "slot": "host:pid"}
    timeline: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is None


def compile_module(mod: Any, target: TargetSpec) -> Any:
    """`tvm.compile(mod, target)` as `compile_scheduled` makes it, with the device code compiled
    as every measured candidate's is (`_DeviceCode`: nvcc -O3 for the target's arch), so that a
    kernel built from an export (`farm.build`, `farm build`) is the code the farm measured. TVM's
    own compiler (NVRTC, with fast math and its own ptxas options) made different code of the
    same schedule: one conv2d config ran 52.5 µs built that way and 32.0 µs as the farm measured
    it (H100). Where TVM's CUDA runtime is not loaded (a machine without a GPU), the library holds
    CUDA source, compiled by the runtime where it is loaded; without nvcc, TVM's own compiler:
    either way a warning says that the kernel may not be the one measured."""

    with tempfile.TemporaryDirectory(prefix="farm-build-") as tmp, _DeviceCode.into(Path(tmp) / "kernel", target):
        lib = compile_scheduled(mod, target)
        by_nvcc = _DeviceCode.done is not None
    if target.is_gpu and not by_nvcc:
        why = "nvcc was not found" if shutil.which("nvcc") is None else "TVM's CUDA runtime is not loaded here (no GPU)"
        warnings.warn(f"{why}: this CUDA code is compiled by TVM (NVRTC, fast math), not by the nvcc -O3 run the "
                      "farm measured, and may run slower; build on a machine with the GPU and nvcc to get the "
                      "measured kernel", stacklevel=3)
    return lib


def compile_into(mod: Any, target: TargetSpec, stem: Path, result: BuildResult) -> None:
    """Compile `mod` for `target` into the library `stem`.so (with its device code, see the module
    docstring, for cuda); sets `result`'s library (cubin, source_sha) or its failure status.
    Raises what TVM raises for a module it cannot compile."""

    with _DeviceCode.into(stem, target):
        try:
            lib = compile_scheduled(mod, target)
        except Exception:
            done = _DeviceCode.done
            if done is not None and done.returncode != 0:  # nvcc refused TVM's source: the candidate's error
                result.status, result.error = Status.BUILD_ERROR, "nvcc: " + _first_error(done.stderr)
                return
            raise
        done = _DeviceCode.done
    if target.is_gpu:
        _compile_device_code(lib, target, stem, result, done)
        if not result.ok:
            return
    library = f"{stem}.so"
    lib.export_library(library)
    result.library = library


@dataclass
class _Nvcc:
    """One nvcc run on a CUDA source: its exit status, stderr (ptxas's report) and cubin."""

    source: str
    returncode: int
    stderr: str
    cubin: str


def _nvcc(source: str, arch: str, stem: Path) -> _Nvcc:
    cu, cubin = f"{stem}.cu", f"{stem}.cubin"
    Path(cu).write_text(source)
    proc = subprocess.run([shutil.which("nvcc") or "nvcc", "--cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v",
                           "-o", cubin, cu], capture_output=True, text=True, timeout=120)
    return _Nvcc(source, proc.returncode, proc.stderr, cubin)


class _DeviceCode:
    """TVM's `tvm_callback_cuda_compile` in a process that builds candidates (one at a time):
    while `compile_into` runs, the device code TVM asks for is the farm's nvcc run into `stem`,
    kept in `done` for the resource checks; outside it (or without nvcc), TVM's own compiler."""

    arch: str = ""
    stem: Path | None = None
    done: _Nvcc | None = None
    _installed = False
    _lock = threading.Lock()  # one compile at a time per process (a user's threads may build)

    @classmethod
    @contextmanager
    def into(cls, stem: Path, target: TargetSpec) -> Iterator[None]:
        """For the length of the block, TVM's device-code compiles go to nvcc, into `stem`."""
        with cls._lock:
            cls.install()
            cls.arch, cls.stem, cls.done = target.arch if target.is_gpu else "", stem, None
            try:
                yield
            finally:
                cls.stem = None

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import tvm_ffi
        from tvm.support import nvcc  # noqa: F401 - registers TVM's own callback first, which this overrides

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", cls.compile, override=True)
        cls._installed = True

    @classmethod
    def compile(cls, code: str, *_: object) -> bytes:
        """The cubin of `code` (TVM calls this with the target too); raises if nvcc refuses it."""
        if cls.stem is None or not cls.arch or shutil.which("nvcc") is None:
            from tvm.support import nvcc

            return bytes(nvcc.tvm_callback_cuda_compile(code))
        cls.done = _nvcc(code, cls.arch, cls.stem)
        if cls.done.returncode != 0:
            raise RuntimeError("nvcc: " + _first_error(cls.done.stderr))
        return Path(cls.done.cubin).read_bytes()


def _compile_device_code(lib: Any, target: TargetSpec, stem: Path, result: BuildResult, done: _Nvcc | None) -> None:
    """Check the candidate's device code and set result fields: `done`, the nvcc run that TVM's
    compile asked for (the library holds its cubin), or else nvcc run here on the module's CUDA
    source (the cubin is shipped beside the library)."""
    source = _cuda_source(lib)
    result.source_sha = hashlib.sha256(source.encode()).hexdigest()
    in_library = done is not None and done.source == source
    if not in_library:
        if shutil.which("nvcc") is None:
            # Without nvcc the GPU node's runtime compiles the source at load time (NVRTC).
            result.info["device_code"] = "deferred to the GPU node: nvcc not found on the build node"
            return
        done = _nvcc(source, target.arch, stem)
    assert done is not None
    if done.returncode != 0:
        result.status = Status.BUILD_ERROR
        result.error = "nvcc: " + _first_error(done.stderr)
        return
    registers, threads = _registers_per_kernel(done.stderr), _threads_per_kernel(source)
    spills = max((int(m) for m in _PTXAS_SPILL.findall(done.stderr)), default=0)
    result.info.update(registers=max(registers.values(), default=0), spill_bytes=spills,
                       threads=max(threads.values(), default=1))
    # A launch needs registers for every thread of the block from one SM's register file: each
    # kernel of the module with its own block (a design space's kernels differ).
    for kernel, used in sorted(registers.items()):
        block = threads.get(kernel, 1)
        if used * block > target.limit("registers_per_block"):
            result.status = Status.INVALID
            result.error = (f"{used} registers x {block} threads > {target.limit('registers_per_block')} "
                            f"registers per block" + (f" ({kernel})" if len(registers) > 1 else ""))
            return
    if not in_library:  # the runtime gets it from the RPC server instead of compiling the source
        result.cubin = done.cubin


def _cuda_source(lib: Any) -> str:
    """The CUDA C source of the library's device module.

    Without a GPU the module holds only source (fmt "cuda"); where TVM's CUDA runtime is
    loaded the source sits beside the compiled code, under "cu".
    """
    module = lib.mod.imports[0]
    for fmt in ("cuda", "cu", ""):
        source = module.inspect_source(fmt)
        if "__global__" in source:
            return source
    raise RuntimeError("the compiled library holds no CUDA source")


def _threads_per_kernel(source: str) -> dict[str, int]:
    """Threads per block of each kernel, from its __launch_bounds__ (TVM emits it for every kernel)."""
    return {name: int(bound) for bound, name in _LAUNCH_BOUNDS.findall(source)}


def _registers_per_kernel(stderr: str) -> dict[str, int]:
    """Registers per thread of each kernel, from ptxas's report (-v): each "Compiling entry function
    'NAME'" is followed by its "Used N registers"."""
    out: dict[str, int] = {}
    kernel = None
    for line in stderr.splitlines():
        if (entry := _PTXAS_ENTRY.search(line)) is not None:
            kernel = entry.group(1)
        elif kernel is not None and (used := _PTXAS_USAGE.search(line)) is not None:
            out[kernel] = int(used.group(1))
    return out


def _first_error(stderr: str) -> str:
    for line in stderr.splitlines():
        if "error" in line:
            return line.strip()[:400]
    return stderr.strip().splitlines()[-1][:400] if stderr.strip() else "failed"


def warm_nvcc() -> float | None:
    """Compile an empty kernel with nvcc, so that the builds after it find its toolchain (nvcc,
    cicc, ptxas, the CUDA headers) in the page cache: the first nvcc run on a machine took ~12 s
    while they came off disk. Its seconds, None without nvcc."""
    compiler = shutil.which("nvcc")
    if compiler is None:
        return None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="farm-warm-") as d:
        Path(d, "k.cu").write_text('extern "C" __global__ void k() {}\n')
        subprocess.run([compiler, "--cubin", "-o", f"{d}/k.cubin", f"{d}/k.cu"], capture_output=True, timeout=120)
    return time.perf_counter() - start
