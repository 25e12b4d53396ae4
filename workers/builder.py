"""The build stage: candidates compiled in a pool of processes into exported libraries.

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

`Builder` is the seam a Worker builds through (its contract below); `ProcessPoolBuilder`,
compiling in a pool of processes on this node (forked warm, TVM imported), is the implementation.
Every failure is data: a `BuildResult` with a status, never an exception out of `build`.
A build that hangs or crashes its process is recorded and the pool is replaced.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

from farm.core.errors import one_line
from farm.core.host import usable_cores
from farm.core.measure import Status
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.templates.base import compile_scheduled
from farm.core.tvm_import import import_tvm
from farm.core.workloads import make_workload

log = logging.getLogger("farm.builder")

# nvcc's ptxas report: "Used 72 registers, used 1 barriers, 2368 bytes smem"
_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
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


@lru_cache(maxsize=32)
def _task(task_json: str) -> Task:
    import json

    return Task.from_json(json.loads(task_json))


@lru_cache(maxsize=32)
def _tag(task_json: str) -> str:
    """A short name for the task (its JSON's hash)."""
    import hashlib

    return hashlib.sha256(task_json.encode()).hexdigest()[:10]


def build_one(task_json: str, index: int, out_dir: str) -> BuildResult:
    """Build config `index` of the task into `out_dir` (runs in a pool process)."""
    start, started = time.perf_counter(), time.time()
    task = _task(task_json)
    config = task.space.get(index)
    result = BuildResult(index, config.to_json())
    try:
        reason = task.check(config)
        if reason:
            result.status, result.error = Status.INVALID, reason
            return result
        sch = task.schedule(config)
        if task.target.is_gpu:
            from farm.core.templates.verify import verify_gpu

            reason = verify_gpu(sch.mod, task.target)
            if reason:
                result.status, result.error = Status.INVALID, reason
                return result
        # Named by task and config: a job's tasks share the build directory, and the RPC server
        # loads each library by its file name (dlopen hands back a library still loaded under
        # the same path, so a name reused across tasks ran the other task's kernel).
        compile_into(sch.mod, task.target, Path(out_dir) / f"c{_tag(task_json)}-{index}", result)
    except Exception as e:  # a template or compiler failure is this candidate's result
        result.status = Status.BUILD_ERROR
        result.error = one_line(e)
        result.info["traceback"] = traceback.format_exc(limit=4)
    finally:
        result.build_seconds = time.perf_counter() - start
        result.timeline = {"build": [started, time.time()], "slot": f"{socket.gethostname()}:{os.getpid()}"}
    return result


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
    registers = max((int(m) for m in _PTXAS_USAGE.findall(done.stderr)), default=0)
    spills = max((int(m) for m in _PTXAS_SPILL.findall(done.stderr)), default=0)
    threads = _threads_per_block(source)
    result.info.update(registers=registers, spill_bytes=spills, threads=threads)
    # A launch needs registers for every thread of the block from one SM's register file.
    if registers * threads > target.limit("registers_per_block"):
        result.status = Status.INVALID
        result.error = (f"{registers} registers x {threads} threads > "
                        f"{target.limit('registers_per_block')} registers per block")
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


def _threads_per_block(source: str) -> int:
    """Threads per block from the kernel's __launch_bounds__ (TVM emits it for every kernel)."""
    found = re.findall(r"__launch_bounds__\((\d+)\)", source)
    return max((int(x) for x in found), default=1)


def _first_error(stderr: str) -> str:
    for line in stderr.splitlines():
        if "error" in line:
            return line.strip()[:400]
    return stderr.strip().splitlines()[-1][:400] if stderr.strip() else "failed"


def _init_pool_process() -> None:
    """A build process's start: TVM imported (without torch: farm.core.tvm_import), single-threaded
    (the pool provides the parallelism)."""
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    import_tvm()


@lru_cache(maxsize=1)
def _build_process_context(kind: str) -> multiprocessing.context.BaseContext:
    """How build processes start: forked from a fork server that has imported TVM once
    (workers.build_preload) and, for a cuda builder, built one small cuda kernel
    (workers.build_preload_cuda). Each of a node's 16-32 build slots then starts warm at once,
    instead of importing TVM in a process of its own, beside the first candidates' builds (8 slots
    were all warm after 3.0 s against 6.3 s on 2 cores: bench/first_builds.py), and its first
    cuda candidate builds as fast as its later ones (see build_preload_cuda). Not forked from this
    process, whose TVM thread pool may be alive: forking it can deadlock.

    The fork server is one per process and starts with the first build process, so the first
    builder to start a slot sets its preload; a builder of another kind in the same process (a
    service running llvm and cuda jobs) shares that server as it started (a cuda builder after an
    llvm one: slots without the cuda build). The server ends when this process does, and a build
    process when its slot's pipe closes."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["workers.build_preload_cuda" if kind == "cuda" else "workers.build_preload"])
    return ctx


def warm_build(kind: str) -> BuildResult:
    """Build one small kernel for `kind` in this process (a 16x16x16 float32 matmul, its
    template's first valid config; for cuda, nvcc included) and return its result: whatever a
    first build sets up once per process is then set up for the processes forked from this one.
    A failure (cuda without nvcc) is the result's status, as for any candidate."""
    task = Task(make_workload("matmul", {"M": 16, "N": 16, "K": 16}), parse_target(kind))
    with tempfile.TemporaryDirectory(prefix="farm-warm-") as out:
        return build_one(json.dumps(task.to_json(), sort_keys=True), task.default_config().index, out)


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


class Builder(Protocol):
    """Compiles candidates of a task into libraries a Runner can load.

    Contract: `submit(task, indices)` returns at once one future per index, in order, each
    resolving to that candidate's BuildResult as soon as it is built (in any order), never to an
    exception for a candidate's failure (compile error, invalid config, timeout, crash: each is
    a BuildResult with its status); a future cancelled before its build starts is never built.
    `build` waits for them all. Candidates are built in the
    order they were submitted, `workers` at a time. Thread-safe; `close()` releases its
    processes and artifacts.
    """

    @property
    def workers(self) -> int: ...

    def warm(self, kind: str) -> None:
        """Start what building `kind` kernels needs (processes, imports, compilers) in the
        background; returns at once."""

    def submit(self, task: Task, indices: list[int]) -> list[cf.Future[BuildResult]]: ...

    def build(self, task: Task, indices: list[int]) -> list[BuildResult]: ...

    def paused(self) -> AbstractContextManager[None]:
        """Every build stopped while the block runs (a kernel timed on this node's CPU then has
        its cores), each build's time limit extended by the pause; builds go on after it."""

    def close(self) -> None: ...


@dataclass
class _Request:
    """One candidate waiting for a build slot."""

    task: Task
    task_json: str
    index: int
    future: cf.Future[BuildResult]


BuildFunction = Callable[[str, int, str], BuildResult]


def _serve(conn: Connection, build: BuildFunction) -> None:
    """A build process: `build` each (task_json, index, out_dir) it is sent and send the
    BuildResult back; "warm" answers once TVM is imported; None ends it. It leads a process group
    of its own, which the compilers it runs join, so that `ProcessPoolBuilder.paused` stops them
    with it."""
    os.setpgid(0, 0)
    _init_pool_process()
    while (message := conn.recv()) is not None:
        conn.send(None if message == "warm" else build(*message))


def _signal_group(group: int, sig: signal.Signals) -> bool:
    """Send `sig` to the process group `group`; False where it has gone (a process replaced or
    ended meanwhile)."""
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False


# A task's stragglers: once STRAGGLER_SAMPLES of its candidates have built, one that takes more
# than STRAGGLER_FACTOR times their median (and more than the builder's floor: 30 s, MetaSchedule's
# own build timeout, so that a build slowed by a busy machine is not taken for a slow config) is
# stopped: the slowest builds were of no fast config, and one held a job's end with its GPU idle
# (docs/defaults.md#straggler-deadline).
STRAGGLER_SAMPLES = 16
STRAGGLER_FACTOR = 10.0
STRAGGLER_WINDOW = 256  # the task's latest builds that the median is taken over


class ProcessPoolBuilder:
    """The Builder of this node: `workers` build slots, each a thread of this process driving one
    long-lived build process (forked with TVM imported, the compiler warm:
    `_build_process_context`), one candidate at a time from a shared queue.

    A candidate's time limit counts from when its slot starts it, not from when it was queued:
    `timeout`, or, once its task has STRAGGLER_SAMPLES builds, STRAGGLER_FACTOR times the median
    of its latest ones but at least `floor` (`deadline`). A candidate past it is recorded as TIMEOUT and only
    its own process is killed and replaced; one that crashes its process (a segfault in the
    compiler) is recorded as BUILD_ERROR, and its process is replaced. Other candidates never
    notice. Artifacts go to a private temporary directory removed by `close()`.
    """

    def __init__(self, workers: int | None = None, timeout: float = 60.0, build: BuildFunction = build_one,
                 floor: float = 30.0) -> None:
        """`build` (a module-level function, run in the build processes) builds one candidate:
        `build_one`, unless a test injects failures."""
        self._build = build
        self._workers = workers or usable_cores()
        self.timeout, self.floor = timeout, floor
        self._seconds: dict[str, deque[float]] = {}  # task -> its latest candidates' build seconds
        self.dir = tempfile.mkdtemp(prefix="farm-build-")
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._slots: list[threading.Thread] = []
        self._procs: dict[int, BaseProcess] = {}  # slot -> its build process
        self._lock = threading.Lock()
        self._kind = ""  # what the slots will build, once warm() says: their fork server's preload
        self._paused = 0.0  # seconds the builds have been stopped by `paused`, ended pauses
        self._pause_start: float | None = None  # monotonic start of the pause under way

    @property
    def workers(self) -> int:
        return self._workers

    def warm(self, kind: str) -> None:
        self._kind = kind
        self._start_slots()

    def _start_slots(self) -> None:
        with self._lock:
            if self._slots:
                return
            for slot in range(self._workers):
                thread = threading.Thread(target=self._run_slot, args=(slot,), daemon=True,
                                          name=f"farm-build-slot-{slot}")
                thread.start()
                self._slots.append(thread)

    def submit(self, task: Task, indices: list[int]) -> list[cf.Future[BuildResult]]:
        self._start_slots()
        task_json = json.dumps(task.to_json(), sort_keys=True)
        futures: list[cf.Future[BuildResult]] = []
        for index in indices:
            futures.append(cf.Future())
            self._queue.put(_Request(task, task_json, index, futures[-1]))
        return futures

    def build(self, task: Task, indices: list[int]) -> list[BuildResult]:
        return [f.result() for f in self.submit(task, indices)]

    def _spawn(self, slot: int) -> tuple[BaseProcess, Connection]:
        ctx = _build_process_context(self._kind)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self._build), daemon=True, name=f"farm-build-{slot}")
        proc.start()
        child.close()
        self._procs[slot] = proc
        parent.send("warm")
        return proc, parent

    def _run_slot(self, slot: int) -> None:
        """One slot: once its process is warm, take candidates off the queue until close(), each
        built in this slot's process. A cold slot takes no candidate: a warm one builds it sooner."""
        start = time.monotonic()
        proc, conn = self._spawn(slot)
        warming = True  # the process answers its warm-up first
        try:
            proc, conn = self._ready(slot, proc, conn)
            warming = False
            log.info("build slot %d warm in %.1f s", slot, time.monotonic() - start)
        except Exception as e:  # met again, and recorded, with the slot's first candidate
            log.warning("build slot %d did not start: %s", slot, one_line(e))
        while (request := self._queue.get()) is not None:
            if not request.future.set_running_or_notify_cancel():
                continue  # its call was stopped (Worker.cancel): never built
            try:
                if warming or not proc.is_alive():
                    proc, conn = self._ready(slot, proc, conn)
                    warming = False
                result, replace = self._build_in(proc, conn, request)
            except Exception as e:  # its process could not be started or talked to
                result = BuildResult(request.index, request.task.space.get(request.index).to_json(),
                                     Status.BUILD_ERROR, f"the build process failed: {one_line(e)}")
                replace = True
            if replace:
                proc.kill()
                proc.join()
                proc, conn = self._spawn(slot)
                warming = True
            request.future.set_result(result)
        proc.kill()

    def _ready(self, slot: int, proc: BaseProcess, conn: Connection) -> tuple[BaseProcess, Connection]:
        """The slot's process once it has answered its warm-up; a new one if it died."""
        if proc.is_alive():
            try:
                conn.recv()
                return proc, conn
            except EOFError:
                pass
        proc, conn = self._spawn(slot)
        conn.recv()
        return proc, conn

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every build process stopped (SIGSTOP to its process group: the compilers it runs too)
        while the block runs, continued after it. Builds' time limits do not count the pause
        (`_build_in`); their own build seconds do. A process started during the pause is not
        stopped. Not reentrant: one pause at a time (the worker's device lock holds it)."""
        with self._lock:
            groups = [proc.pid for proc in self._procs.values() if proc.pid is not None and proc.is_alive()]
            self._pause_start = time.monotonic()
        stopped = [group for group in groups if _signal_group(group, signal.SIGSTOP)]
        try:
            yield
        finally:
            for group in stopped:
                _signal_group(group, signal.SIGCONT)
            with self._lock:
                assert self._pause_start is not None
                self._paused += time.monotonic() - self._pause_start
                self._pause_start = None

    def _paused_so_far(self) -> float:
        """Seconds the builds have been stopped, the pause under way included."""
        with self._lock:
            return self._paused + (time.monotonic() - self._pause_start if self._pause_start is not None else 0.0)

    def deadline(self, task_json: str) -> tuple[float, str]:
        """A build of the task's time limit, and why it is that."""
        with self._lock:
            seconds = list(self._seconds.get(task_json, ()))
        if len(seconds) < STRAGGLER_SAMPLES:
            return self.timeout, f"{self.timeout:.0f} s"
        median = statistics.median(seconds)
        limit = min(self.timeout, max(self.floor, STRAGGLER_FACTOR * median))
        return limit, f"{limit:.0f} s ({STRAGGLER_FACTOR:.0f}x this task's median build of {median:.1f} s)"

    def _build_in(self, proc: BaseProcess, conn: Connection, request: _Request) -> tuple[BuildResult, bool]:
        """The candidate's result from the slot's process, and whether that process must be replaced."""
        limit, why = self.deadline(request.task_json)
        start, paused_before = time.monotonic(), self._paused_so_far()
        conn.send((request.task_json, request.index, self.dir))
        config = request.task.space.get(request.index).to_json()

        def building() -> float:  # seconds this build has run, pauses left out
            return time.monotonic() - start - (self._paused_so_far() - paused_before)

        while not conn.poll(max(0.05, limit - building())):  # a pause under way: poll again, not spin
            if building() >= limit:
                return BuildResult(request.index, config, Status.TIMEOUT, f"build took longer than {why}"), True
        try:
            result = conn.recv()
        except EOFError:
            return BuildResult(request.index, config, Status.BUILD_ERROR,
                               "the compiler process crashed building this config"), True
        if result.ok:
            seconds = building()  # before the lock: building() takes it
            with self._lock:
                window = self._seconds.setdefault(request.task_json, deque(maxlen=STRAGGLER_WINDOW))
                window.append(seconds)
        return result, False

    def close(self) -> None:
        for _ in self._slots:
            self._queue.put(None)
        for proc in list(self._procs.values()):
            proc.kill()
        for thread in self._slots:
            thread.join(timeout=5)
        self._slots.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ProcessPoolBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
