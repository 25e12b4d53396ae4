"""The measure stage: built candidates run on a device through TVM RPC.

`Runner` is the seam a Worker measures through (its contract below); `RPCRunner` is the
implementation.

`RPCRunner` keeps one RPC session open across candidates (stock MetaSchedule opens one per
candidate, each spawning a session process: docs/defaults.md#runner-time-limits). Once per session and
workload it uploads the inputs, the NumPy reference output and the output check
(workers.check: NaN fill and error sums as kernels on the device); then for every candidate it
uploads the library (and its prebuilt cubin), loads it, poisons the output with NaN, runs it
once and checks it against the reference on the device (only two numbers come back), then
times it with TVM's `time_evaluator`. Each result carries its timeline (build, measure, and the
time spent inside timed kernel runs: the device's busy time).

A candidate whose single timed run is over `screen_factor` times the best latency this
runner has measured for the workload is recorded with that one timing instead of the full
evaluation (its trial has one latency): random search proposes many such kernels, and timing
each of them `repeat` x `number` times is where a tuning run's device time would go.

Failures are data: a launch error, a server crash, a wrong output or a hang each become a
MeasureResult with a status, and the runner reconnects for the next candidate. Opening a session
takes at most `open_timeout` seconds, retries included (the tracker or the server coming back);
a candidate that gets none by then is a runtime error saying so. A candidate
that runs past its time limit is abandoned with its session; the server's `session_timeout`
ends the hung session process on the device side, and `on_hang` lets an owner of the
server restart it sooner. The limit is `timeout` until the session holds the workload's inputs
and a best latency is known; then it is what a candidate within `screen_factor` of the best
could take, twice, plus a second (`time_limit`): a hung candidate would otherwise hold its GPU for
the whole `timeout`, where a second or so tells it apart (docs/defaults.md#runner-time-limits).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from farm.core import metrics
from farm.core.backoff import Backoff
from farm.core.errors import one_line
from farm.core.measure import MeasureResult, Status
from farm.core.task import Task
from workers.check import checker_module, relative_error
from workers.compiler import BuildResult, compile_into

log = logging.getLogger("farm.runner")


@dataclass(frozen=True)
class EvaluatorConfig:
    """TVM time_evaluator settings: `repeat` timings, each the mean of `number` runs, where
    `number` grows until one timing lasts `min_repeat_ms` (TVM's semantics)."""

    number: int = 10
    repeat: int = 3
    min_repeat_ms: int = 50

    @classmethod
    def for_target(cls, kind: str) -> EvaluatorConfig:
        # CPU kernels are slow and the CI machine has 2 cores: fewer, shorter timings.
        return cls(number=3, repeat=3, min_repeat_ms=10) if kind == "llvm" else cls()


class Runner(Protocol):
    """Runs built candidates on one device and says how each went.

    Contract: `measure(task, builds)` returns one MeasureResult per build, in order, and never
    raises for a candidate's failure: a build failure passes through with its status; a launch
    error, crash, hang or wrong output becomes a result with its status and error text; a
    correct kernel gets status ok and every repeat's time. Only one `measure` runs at a time
    per device (the Worker serialises them). `close()` releases the device session.
    """

    def measure(self, task: Task, builds: list[BuildResult]) -> list[MeasureResult]: ...

    def warm(self) -> None:
        """Start opening the device session in the background; returns at once."""

    def device_name(self) -> str:
        """The device's name, as each result's ``device`` gives it (opening its session if none is open)."""

    def prepare(self, task: Task) -> None:
        """Get ready for `task`'s candidates (work of this process's CPU, such as the reference
        output); the Worker calls it while they compile. Optional: `measure` does it if needed."""

    def close(self) -> None: ...


@dataclass
class _OnDevice:
    """A workload's tensors and output check on one session's device."""

    inputs: list[Any]
    out: Any
    ref: Any
    err: Any
    checker: Any


class _Session:
    """One open RPC session, with what each workload needs already on its device."""

    def __init__(self, sess: Any, kind: str, key: str) -> None:
        self.sess = sess
        self.dev = sess.cuda(0) if kind == "cuda" else sess.cpu(0)
        self.opened = time.monotonic()
        self.workloads: dict[str, _OnDevice] = {}
        self.workpath = sess.get_function("tvm.rpc.server.workpath")
        try:
            self.put_cubin = sess.get_function("farm.cubin.put")
            self.device_name = str(sess.get_function("farm.device.name")(kind))
        except AttributeError:  # a stock TVM server ("Module has no function"): it compiles device code itself
            self.put_cubin = None
            self.device_name = self._stock_device_name(key)

    def _stock_device_name(self, key: str) -> str:
        try:
            name = self.dev.device_name
        except Exception:
            name = None
        return str(name) if name else f"{self.dev} ({key})"


class RPCRunner:
    """Measures candidates of tasks on the device registered under `key` with a tracker."""

    def __init__(
        self,
        tracker: tuple[str, int],
        key: str,
        kind: str,
        evaluator: EvaluatorConfig | None = None,
        timeout: float = 10.0,
        session_timeout: float = 120.0,
        on_hang: Callable[[], None] | None = None,
        screen_factor: float | None = 10.0,
        name: str | None = None,
        open_timeout: float = 15.0,
    ) -> None:
        """`name`: the worker's, for its metrics (default: the device key). `open_timeout`: the
        longest a candidate waits for a session (see `_open`)."""
        self.tracker, self.key, self.kind = tracker, key, kind
        self.open_timeout = open_timeout
        self.name = name or key
        self.evaluator = evaluator or EvaluatorConfig.for_target(kind)
        # Sessions last several candidate timeouts, or they would be renewed for every candidate.
        self.timeout, self.session_timeout = timeout, max(session_timeout, 4 * timeout + 10)
        self.on_hang = on_hang
        self._session: _Session | None = None
        self._references: dict[str, tuple[list[np.ndarray], np.ndarray, float]] = {}
        self.screen_factor = screen_factor
        self._best: dict[str, float] = {}  # best median latency so far, per workload
        self.sessions_opened = 0
        self.phases: dict[str, float] = {}  # seconds per step of the last candidate measured
        self._lock = threading.Lock()  # one session at a time, also while warm() opens it
        self._checkers: dict[str, BuildResult] = {}  # the compiled output check, per workload
        self._prepare_lock = threading.RLock()  # warm-up and measuring threads prepare alike
        self._dir = tempfile.mkdtemp(prefix="farm-check-")

    # --- sessions ---------------------------------------------------------------------

    def _open(self) -> _Session:
        """A new session within `open_timeout` seconds, else the last error. Retried while the
        server or the tracker is coming back: a killed or crashed session process takes its server
        down for a moment (and the tracker may still offer it), and a tracker that was killed is
        restarted by its owner (workers.rpc_processes.LocalTracker), the servers registering again."""
        deadline = time.monotonic() + self.open_timeout
        backoff = Backoff(0.25, 2.0)
        while True:
            try:
                return self._connect(deadline)
            except Exception as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.info("opening a session on %s failed (%s); retrying", self.key, one_line(e))
                time.sleep(min(backoff.next(), left))

    def _connect(self, deadline: float) -> _Session:
        from tvm import rpc

        start = time.monotonic()
        host, port, matchkey = _request_server(self.tracker, self.key, deadline)
        sess = rpc.connect(host, port, matchkey, session_timeout=self.session_timeout)
        opened = _Session(sess, self.kind, self.key)
        self.sessions_opened += 1
        log.info("session %d on %s open in %.1f s", self.sessions_opened, self.key, time.monotonic() - start)
        return opened

    def session(self) -> _Session:
        """The open session, renewed before the server's session timeout could end it."""
        with self._lock:
            s = self._session
            # A candidate started now must finish before the server ends the session.
            if s is not None and time.monotonic() - s.opened + self.timeout + 5 > self.session_timeout:
                self._session = s = None
                metrics.rpc_session_restart(self.name, "expired")
            if s is None:
                s = self._session = self._open()
            return s

    def warm(self) -> None:
        """Open the session in the background (a cuda session takes seconds to spawn), so the
        first candidate finds it open; a failure here is met again, and recorded, by `measure`."""

        def open_session() -> None:
            try:
                self.session()
            except Exception as e:
                log.info("opening a session on %s ahead of time failed: %s", self.key, one_line(e))

        threading.Thread(target=open_session, daemon=True, name="farm-session-warm").start()

    def device_name(self) -> str:
        return self.session().device_name

    def _drop_session(self) -> None:
        self._session = None  # dropping the last reference closes the connection

    def close(self) -> None:
        """Close the session and remove the compiled output checks (a later use starts afresh)."""
        self._drop_session()
        with self._prepare_lock:
            self._checkers.clear()
            shutil.rmtree(self._dir, ignore_errors=True)

    # --- measuring --------------------------------------------------------------------

    def _reference(self, task: Task) -> tuple[list[np.ndarray], np.ndarray, float]:
        key = task.workload.key  # inputs and reference depend on the workload alone
        with self._prepare_lock:
            if key not in self._references:
                inputs = task.workload.random_inputs(seed=0)
                self._references[key] = (inputs, task.workload.reference(inputs), task.workload.tolerance())
            return self._references[key]

    def prepare(self, task: Task) -> None:
        """Compute the task's reference output and compile its output check, once per workload
        (this process's CPU; the Worker calls it while the task's first candidates compile)."""
        self._reference(task)
        self._checker(task)

    def _checker(self, task: Task) -> BuildResult:
        key = task.workload.key
        with self._prepare_lock:
            if key not in self._checkers:
                built = BuildResult(-1, {})
                Path(self._dir).mkdir(parents=True, exist_ok=True)
                stem = Path(self._dir) / f"check{len(self._checkers)}"
                compile_into(checker_module(task.workload, task.target), task.target, stem, built)
                if not built.ok:  # the farm's own kernel: a failure here is a bug, not a candidate's
                    raise RuntimeError(f"the output check of {task.workload} did not build: {built.error}")
                self._checkers[key] = built
            return self._checkers[key]

    def _on_device(self, s: _Session, task: Task) -> _OnDevice:
        """The workload's inputs, reference, output buffer and check on the session's device."""
        import tvm

        key = task.workload.key
        if key not in s.workloads:
            inputs, expected, _ = self._reference(task)
            checker = self._checker(task)
            name = Path(checker.library).name
            s.sess.upload(checker.library, name)
            if checker.cubin and s.put_cubin is not None:
                s.sess.upload(checker.cubin, Path(checker.cubin).name)
                s.put_cubin(checker.source_sha, s.workpath(Path(checker.cubin).name))
            s.workloads[key] = _OnDevice(
                inputs=[tvm.runtime.tensor(x, s.dev) for x in inputs],
                out=tvm.runtime.empty(expected.shape, str(expected.dtype), s.dev),
                ref=tvm.runtime.tensor(expected.astype(task.workload.dtype), s.dev),
                err=tvm.runtime.empty((2,), "float64", s.dev),
                checker=s.sess.load_module(name))
        return s.workloads[key]

    def measure(self, task: Task, builds: list[BuildResult]) -> list[MeasureResult]:
        """One MeasureResult per build, in order; build failures pass through as results."""
        return [self.measure_one(task, b) for b in builds]

    def measure_one(self, task: Task, build: BuildResult) -> MeasureResult:
        """`build` measured (see the module docstring), and counted in the worker's metrics."""
        self.phases = {}
        result = self._measure_one(task, build)
        steps = self.phases
        timed = sum(b - a for a, b in result.timeline.get("timed", []))
        metrics.observe_trial(self.name, result.status.value, self.kind, result.build_seconds,
                              steps["upload"] + steps.get("load", 0.0) if "upload" in steps else None,
                              timed if "timed" in result.timeline else None, steps.get("check"))
        return result

    def _measure_one(self, task: Task, build: BuildResult) -> MeasureResult:
        result = MeasureResult(build.config_index, build.config, Status.OK, build_seconds=build.build_seconds,
                               timeline=dict(build.timeline))
        if not build.ok:
            result.status, result.error = build.status or Status.BUILD_ERROR, build.error
            return result
        start, started = time.perf_counter(), time.time()
        try:
            # Outside the candidate's time limit: a server coming back after another
            # candidate's crash or hang is not this candidate's fault.
            self.session()
        except Exception as e:
            result.status, result.error = Status.RUNTIME_ERROR, f"no session on {self.key}: {one_line(e)}"
            result.run_seconds = time.perf_counter() - start
            return result
        box: dict[str, Any] = {}
        # The thread fills its own copy: after a timeout it may still finish, and must not
        # change the result already reported.
        work_result = dataclasses.replace(result, timeline=dict(result.timeline))

        def work() -> None:
            try:
                self._run(task, build, work_result)
            except Exception as e:  # the session or the kernel failed: record it
                # Keep only the text: the exception's frames would keep the session open.
                box["error"] = one_line(e)

        limit = self.time_limit(task)
        thread = threading.Thread(target=work, daemon=True, name="farm-measure")
        thread.start()
        thread.join(limit)
        if not thread.is_alive():
            result = work_result
        result.run_seconds = time.perf_counter() - start
        result.timeline["measure"] = [started, time.time()]
        if thread.is_alive():
            result.status, result.error = Status.TIMEOUT, f"ran longer than {limit:.1f} s"
            log.warning("candidate %d of %s hung; dropping the session", build.config_index, task)
            self._drop_session()
            metrics.rpc_session_restart(self.name, "timeout")
            if self.on_hang:
                self.on_hang()
        elif "error" in box:
            result.status, result.error = Status.RUNTIME_ERROR, box["error"]
            self._drop_session()  # the session may be dead (crashed kernel): reconnect next time
            metrics.rpc_session_restart(self.name, "error")
        return result

    def time_limit(self, task: Task) -> float:
        """Seconds a candidate of `task` may take on the device (see the module docstring): with
        the workload's inputs on the open session and a best latency B known, a candidate within
        `screen_factor` of B runs at most (2 + repeat x number) x screen_factor x B seconds, plus
        repeat x min_repeat_ms; one slower than that is screened after two runs, so twice that
        plus a second is ample, and `timeout` bounds it."""
        key = task.workload.key
        best, s = self._best.get(key), self._session
        if best is None or self.screen_factor is None or s is None or key not in s.workloads:
            return self.timeout  # uploads to a new session, or no yardstick yet
        ev = self.evaluator
        normal = (2 + ev.repeat * ev.number) * self.screen_factor * best + ev.repeat * ev.min_repeat_ms / 1e3
        return min(self.timeout, 1.0 + 2 * normal)

    def _run(self, task: Task, build: BuildResult, result: MeasureResult) -> None:
        s = self.session()
        result.device = s.device_name
        on_device = self._on_device(s, task)
        _, _, tolerance = self._reference(task)

        clock = [time.perf_counter()]

        def phase(name: str) -> None:
            now = time.perf_counter()
            self.phases[name] = now - clock[0]
            clock[0] = now

        name = Path(build.library).name
        s.sess.upload(build.library, name)
        if build.cubin and s.put_cubin is not None:
            cubin = Path(build.cubin).name
            s.sess.upload(build.cubin, cubin)
            s.put_cubin(build.source_sha, s.workpath(cubin))
        phase("upload")
        try:
            module = s.sess.load_module(name)
            phase("load")
            self._check_and_time(s, task, result, module, on_device, tolerance, phase)
        finally:
            s.sess.remove(name)
            if build.cubin and s.put_cubin is not None:
                s.sess.remove(Path(build.cubin).name)
            phase("cleanup")
            log.debug("candidate %d phases: %s", build.config_index,
                      " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.phases.items()))

    def _check_and_time(self, s: _Session, task: Task, result: MeasureResult, module: Any, on_device: _OnDevice,
                        tolerance: float, phase: Callable[[str], None]) -> None:
        args, out = on_device.inputs, on_device.out
        on_device.checker["fill"](out)
        module["main"](*args, out)
        on_device.checker["check"](out, on_device.ref, on_device.err)
        error = relative_error(on_device.err.numpy())
        phase("check")
        if not error <= tolerance:  # NaN (unwritten output) fails too
            result.status = Status.WRONG_RESULT
            result.error = f"relative error {error:.3g} > {tolerance:g}"
            return
        key = task.workload.key
        best = self._best.get(key)
        timed = result.timeline.setdefault("timed", [])  # [start, end] of each timed call: the busy time
        if self.screen_factor and best is not None:
            start = time.time()
            probe = float(module.time_evaluator("main", s.dev, number=1, repeat=1)(*args, out).results[0])
            timed.append([start, time.time()])
            phase("probe")
            if probe > self.screen_factor * best:
                # Far slower than the best so far: one timing ranks it well enough, and fully
                # evaluating slow kernels is where a tuning run's device time would go.
                result.latencies = [probe]
                return
        ev = self.evaluator
        timer = module.time_evaluator("main", s.dev, number=ev.number, repeat=ev.repeat,
                                      min_repeat_ms=ev.min_repeat_ms)
        start = time.time()
        result.latencies = [float(x) for x in timer(*args, out).results]
        timed.append([start, time.time()])
        phase("evaluate")
        latency = float(np.median(result.latencies))
        self._best[key] = min(latency, best) if best is not None else latency


def _request_server(tracker: tuple[str, int], key: str, deadline: float) -> tuple[str, int, str]:
    """(host, port, match key) of a free server registered under `key`, from the tracker at
    `tracker`, by `deadline` (time.monotonic()); an OSError (a timeout, a refused connection) or a
    RuntimeError if not.

    TVM's own client (rpc.connect_tracker(...).request) cannot be bounded: it retries connecting
    to the tracker for 60 s, then waits for a free server for as long as it takes. This speaks the
    same protocol (TVM's tracker messages) with a deadline on every step.
    """
    from tvm.rpc import base

    def left() -> float:
        return max(0.05, deadline - time.monotonic())

    where = f"the RPC tracker at {tracker[0]}:{tracker[1]}"
    try:
        sock = socket.create_connection(tracker, timeout=left())
    except OSError as e:
        raise OSError(f"cannot reach {where}: {e.strerror or e}") from None
    with sock:
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        sock.settimeout(left())
        if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
            raise RuntimeError(f"{tracker[0]}:{tracker[1]} is not an RPC tracker")
        base.sendjson(sock, [base.TrackerCode.REQUEST, key, "", 1])
        sock.settimeout(left())  # the tracker answers when a server under `key` is free
        try:
            value = base.recvjson(sock)
        except TimeoutError:
            raise TimeoutError(f"no server registered under {key} was free at {where} in time") from None
    if value[0] != base.TrackerCode.SUCCESS:
        raise RuntimeError(f"{where} refused a server of {key}: {value!r}")
    host, port, matchkey = value[1]
    return str(host), int(port), str(matchkey)
