"""The measure stage: built candidates run on a device through TVM RPC.

`Runner` is the seam a Worker measures through (its contract below); `RPCRunner` is the
implementation.

`RPCRunner` keeps one RPC session open across candidates (stock MetaSchedule opens one per
candidate: 4.4 s each on an H200, mostly spawning the session process), uploads each task's
inputs once per session, and for every candidate: uploads the library (and its prebuilt
cubin), loads it, poisons the output with NaN, runs it once and checks the output against
the NumPy reference, then times it with TVM's `time_evaluator`.

A candidate whose single timed run is over `screen_factor` times the best latency this
runner has measured for the workload is recorded with that one timing instead of the full
evaluation (its trial has one latency): random search proposes many such kernels, and timing
each of them `repeat` x `number` times is where a tuning run's device time would go.

Failures are data: a launch error, a server crash, a wrong output or a hang each become a
MeasureResult with a status, and the runner reconnects for the next candidate. A candidate
that runs past `timeout` is abandoned with its session; the server's `session_timeout`
ends the hung session process on the device side, and `on_hang` lets an owner of the
server restart it sooner.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from farm.core.errors import one_line
from farm.core.measure import MeasureResult, Status
from farm.core.task import Task
from workers.builder import BuildResult

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

    def close(self) -> None: ...


class _Session:
    """One open RPC session with the task inputs already on its device."""

    def __init__(self, sess: Any, kind: str, key: str) -> None:
        self.sess = sess
        self.dev = sess.cuda(0) if kind == "cuda" else sess.cpu(0)
        self.opened = time.monotonic()
        self.inputs: dict[str, list[Any]] = {}
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
    ) -> None:
        self.tracker, self.key, self.kind = tracker, key, kind
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

    # --- sessions ---------------------------------------------------------------------

    def _open(self, attempts: int = 5) -> _Session:
        """A new session; retried while the server is coming back (a killed or crashed session
        process takes its server down for a moment, and the tracker may still offer it)."""
        for attempt in range(attempts - 1):
            try:
                return self._connect()
            except Exception as e:
                log.info("opening a session on %s failed (%s); retrying", self.key, one_line(e))
                time.sleep(1.0 + attempt)
        return self._connect()

    def _connect(self) -> _Session:
        from tvm import rpc

        tracker = rpc.connect_tracker(*self.tracker)
        sess = tracker.request(self.key, priority=1, session_timeout=self.session_timeout, max_retry=60)
        opened = _Session(sess, self.kind, self.key)
        self.sessions_opened += 1
        return opened

    def session(self) -> _Session:
        """The open session, renewed before the server's session timeout could end it."""
        s = self._session
        # A candidate started now must finish before the server ends the session.
        if s is not None and time.monotonic() - s.opened + self.timeout + 5 > self.session_timeout:
            self.close()
            s = None
        if s is None:
            s = self._session = self._open()
        return s

    def close(self) -> None:
        self._session = None  # dropping the last reference closes the connection

    # --- measuring --------------------------------------------------------------------

    def _reference(self, task: Task) -> tuple[list[np.ndarray], np.ndarray, float]:
        key = task.workload.key  # inputs and reference depend on the workload alone
        if key not in self._references:
            inputs = task.workload.random_inputs(seed=0)
            self._references[key] = (inputs, task.workload.reference(inputs), task.workload.tolerance())
        return self._references[key]

    def measure(self, task: Task, builds: list[BuildResult]) -> list[MeasureResult]:
        """One MeasureResult per build, in order; build failures pass through as results."""
        return [self.measure_one(task, b) for b in builds]

    def measure_one(self, task: Task, build: BuildResult) -> MeasureResult:
        result = MeasureResult(build.config_index, build.config, Status.OK, build_seconds=build.build_seconds)
        if not build.ok:
            result.status, result.error = build.status or Status.BUILD_ERROR, build.error
            return result
        start = time.perf_counter()
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
        work_result = dataclasses.replace(result)

        def work() -> None:
            try:
                self._run(task, build, work_result)
            except Exception as e:  # the session or the kernel failed: record it
                # Keep only the text: the exception's frames would keep the session open.
                box["error"] = one_line(e)

        thread = threading.Thread(target=work, daemon=True, name="farm-measure")
        thread.start()
        thread.join(self.timeout)
        if not thread.is_alive():
            result = work_result
        result.run_seconds = time.perf_counter() - start
        if thread.is_alive():
            result.status, result.error = Status.TIMEOUT, f"ran longer than {self.timeout:.0f} s"
            log.warning("candidate %d of %s hung; dropping the session", build.config_index, task)
            self.close()
            if self.on_hang:
                self.on_hang()
        elif "error" in box:
            result.status, result.error = Status.RUNTIME_ERROR, box["error"]
            self.close()  # the session may be dead (crashed kernel): reconnect next time
        return result

    def _run(self, task: Task, build: BuildResult, result: MeasureResult) -> None:
        import tvm

        s = self.session()
        result.device = s.device_name
        key = task.workload.key
        if key not in s.inputs:
            inputs, _, _ = self._reference(task)
            s.inputs[key] = [tvm.runtime.tensor(x, s.dev) for x in inputs]
        args = s.inputs[key]
        _, expected, tolerance = self._reference(task)

        self.phases = {}
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
            self._check_and_time(s, task, result, module, args, expected, tolerance, phase)
        finally:
            s.sess.remove(name)
            if build.cubin and s.put_cubin is not None:
                s.sess.remove(Path(build.cubin).name)
            phase("cleanup")
            log.debug("candidate %d phases: %s", build.config_index,
                      " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.phases.items()))

    def _check_and_time(self, s: _Session, task: Task, result: MeasureResult, module: Any, args: list[Any],
                        expected: np.ndarray, tolerance: float, phase: Callable[[str], None]) -> None:
        import tvm

        out = tvm.runtime.tensor(np.full(expected.shape, np.nan, dtype=expected.dtype), s.dev)
        module["main"](*args, out)
        s.dev.sync()
        error = _relative_error(out.numpy(), expected)
        phase("check")
        if not error <= tolerance:  # NaN (unwritten output) fails too
            result.status = Status.WRONG_RESULT
            result.error = f"relative error {error:.3g} > {tolerance:g}"
            return
        key = task.workload.key
        best = self._best.get(key)
        if self.screen_factor and best is not None:
            probe = float(module.time_evaluator("main", s.dev, number=1, repeat=1)(*args, out).results[0])
            phase("probe")
            if probe > self.screen_factor * best:
                # Far slower than the best so far: one timing ranks it well enough, and fully
                # evaluating slow kernels is where a tuning run's device time would go.
                result.latencies = [probe]
                return
        ev = self.evaluator
        timer = module.time_evaluator("main", s.dev, number=ev.number, repeat=ev.repeat,
                                      min_repeat_ms=ev.min_repeat_ms)
        result.latencies = [float(x) for x in timer(*args, out).results]
        phase("evaluate")
        latency = float(np.median(result.latencies))
        self._best[key] = min(latency, best) if best is not None else latency


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    g, e = got.astype(np.float64), expected.astype(np.float64)
    if not np.all(np.isfinite(g)):
        return float("nan")
    denom = float(np.linalg.norm(e)) or 1.0
    return float(np.linalg.norm(g - e)) / denom
