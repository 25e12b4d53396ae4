"""The build stage: candidates compiled in a pool of processes into exported libraries.

Each candidate is checked, scheduled and compiled (`build_one`) through workers.compiler, which
holds the compilation itself: TVM's compile, the device code by nvcc and ptxas's resource checks.

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
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

from farm.core.errors import one_line
from farm.core.host import usable_cores
from farm.core.measure import Status
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.tvm_import import import_tvm
from farm.core.workloads import make_workload
from workers.compiler import BuildResult, compile_into

log = logging.getLogger("farm.builder")

@lru_cache(maxsize=32)
def _task(task_json: str) -> Task:
    import json

    return Task.from_json(json.loads(task_json))


@lru_cache(maxsize=32)
def _tag(task_json: str) -> str:
    """A short name for the task (its JSON's hash)."""

    return hashlib.sha256(task_json.encode()).hexdigest()[:10]


def build_one(task_json: str, index: int, out_dir: str) -> BuildResult:
    """Build config `index` of the task into `out_dir` (runs in a pool process)."""
    start, started = time.perf_counter(), time.time()
    task = _task(task_json)
    config = task.config(index)
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



class Builder(Protocol):
    """Compiles candidates of a task into libraries a Runner can load.

    Contract: `start(task, indices)` starts building them and returns at once one future per
    index, in order, each resolving to that candidate's BuildResult as soon as it is built (in any
    order), never to an exception for a candidate's failure (compile error, invalid config,
    timeout, crash: each is a BuildResult with its status); a future cancelled before its build
    starts is never built. `build` waits for them all. Candidates are built in the order they
    were started, `workers` at a time. Thread-safe; `close()` releases its
    processes and artifacts.
    """

    @property
    def workers(self) -> int: ...

    def warm(self, kind: str) -> None:
        """Start what building `kind` kernels needs (processes, imports, compilers) in the
        background; returns at once."""

    def start(self, task: Task, indices: list[int]) -> list[cf.Future[BuildResult]]: ...

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

    def start(self, task: Task, indices: list[int]) -> list[cf.Future[BuildResult]]:
        self._start_slots()
        task_json = json.dumps(task.to_json(), sort_keys=True)
        futures: list[cf.Future[BuildResult]] = []
        for index in indices:
            futures.append(cf.Future())
            self._queue.put(_Request(task, task_json, index, futures[-1]))
        return futures

    def build(self, task: Task, indices: list[int]) -> list[BuildResult]:
        return [f.result() for f in self.start(task, indices)]

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
                result = BuildResult(request.index, request.task.config(request.index).to_json(),
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
        config = request.task.config(request.index).to_json()

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
