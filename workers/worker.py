"""A worker: one device's builder and runner, pipelined so the device never waits.

`Worker.build_and_measure(task, indices)` builds the candidates in chunks (workers.builder.Builder) and
measures each chunk on the device (workers.runner.Runner) while the next chunk compiles. It is
thread-safe: two batches processed at once compile concurrently, but only one measures at a
time (a shared device would distort both timings). The same class runs inside a Ray worker
actor (scheduler.ray_pool) and in this process (scheduler.local_pool).

Where the kernels run on the CPU that builds (llvm), the builds are stopped while a candidate is
measured (`quiet_builds`): at full speed beside its measurements, a 48-trial job of matmul 256³
on 2 cores measured 5 to 13 of its configs more than a tenth slower than with nothing building,
and once its best at 1147 µs instead of 742 (bench/build_contention.py). A GPU kernel only needs
the CPU to launch it, and builds beside its measurements are what keep the GPU busy.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from farm.core import metrics
from farm.core.measure import MeasureResult
from farm.core.task import Task
from workers.builder import Builder, ProcessPoolBuilder
from workers.compiler import BuildResult
from workers.runner import EvaluatorConfig, RPCRunner, Runner

# A candidate's build (schedule, compile, nvcc) taking longer than this is recorded as a timeout.
BUILD_TIMEOUT_S = 60.0
# How soon a call waiting for its candidates' builds notices `Worker.cancel`.
STOP_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker reaches its device and how it builds and measures."""

    name: str
    tracker: tuple[str, int]
    key: str
    kind: str
    build_workers: int | None = None
    build_timeout: float = BUILD_TIMEOUT_S
    run_timeout: float = 10.0
    # A session opens in ~4.7 s on a GPU server (a spawned process): a long one amortises that
    # to ~1% of the measuring time. A hang still ends at once on a server the worker owns (on_hang).
    session_timeout: float = 600.0
    evaluator: EvaluatorConfig | None = None


class Worker:
    """Builds and measures batches of one task's candidates on one device."""

    def __init__(self, name: str, builder: Builder, runner: Runner, ready: cf.Future[None] | None = None,
                 quiet_builds: bool = False) -> None:
        """The worker owns `builder` and `runner` from now on (`close` closes them). Candidates
        compile at once; measuring waits for `ready` (its device coming up), and a `ready` that
        failed fails every `build_and_measure` call with its exception. With `quiet_builds` the builds are
        stopped while a candidate is measured (see the module docstring)."""
        self.name, self.builder, self.runner, self.ready = name, builder, runner, ready
        self.quiet_builds = quiet_builds
        self.busy_seconds = 0.0  # time spent measuring (device busy), for utilisation metrics
        self._device = threading.Lock()
        self._generation = 0  # `cancel` counts up: a call stops once it differs from its start's
        self._preparing = cf.ThreadPoolExecutor(1, thread_name_prefix="farm-prepare")

    @classmethod
    def create(cls, config: WorkerConfig, on_hang: Callable[[], None] | None = None,
               ready: cf.Future[None] | None = None) -> Worker:
        """The farm's worker: a process-pool builder on this node and an RPC runner on the device
        registered under `config.key`; `on_hang` restarts that device's server after a hang;
        `ready` as in `Worker`."""
        builder = ProcessPoolBuilder(config.build_workers, config.build_timeout)
        runner = RPCRunner(config.tracker, config.key, config.kind, config.evaluator, timeout=config.run_timeout,
                           session_timeout=config.session_timeout, on_hang=on_hang, name=config.name)
        return cls(config.name, builder, runner, ready, quiet_builds=config.kind == "llvm")

    def build_and_measure(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        """Build and measure `indices`; one result per index, in order. Each candidate is measured
        as soon as it is built, while the others still compile. A call that `cancel` stops returns
        the results of the candidates it measured before, fewer than `indices`."""
        generation = self._generation
        builds = self.builder.start(task, indices)
        metrics.add_build_backlog(self.name, len(builds))
        for f in builds:
            f.add_done_callback(lambda _: metrics.add_build_backlog(self.name, -1))
        # The reference output and the output check are made on this CPU while the first candidates compile.
        prepared = self._preparing.submit(self.runner.prepare, task)
        position = {id(f): i for i, f in enumerate(builds)}
        results: list[MeasureResult | None] = [None] * len(indices)
        built: list[cf.Future[BuildResult]] = []  # built, not yet measured
        pending = set(builds)
        try:
            while (pending or built) and self._generation == generation:
                if not built:
                    done, pending = cf.wait(pending, timeout=STOP_POLL_SECONDS, return_when=cf.FIRST_COMPLETED)
                    built += done
                    continue
                done = built.pop(0)
                build = done.result()
                prepared.result()
                if self.ready is not None:
                    self.ready.result()
                with self._device, self.builder.paused() if self.quiet_builds else contextlib.nullcontext():
                    if self._generation != generation:  # cancelled while it waited for the device
                        break
                    start = time.perf_counter()
                    (measured,) = self.runner.measure(task, [build])
                    self.busy_seconds += time.perf_counter() - start
                measured.worker, measured.shard, measured.round = self.name, shard, round_
                results[position[id(done)]] = measured
        finally:
            for f in builds:  # a stopped call's candidates still queued are never built
                f.cancel()
        return [r for r in results if r is not None]

    def device_name(self) -> str:
        """The name of the device it measures on (its results' ``device``), once the device is ready."""
        if self.ready is not None:
            self.ready.result()
        return self.runner.device_name()

    def cancel(self) -> None:
        """Stop every call in flight: each returns as soon as the candidate it is measuring (if any)
        is measured, with the results measured so far; its candidates not yet built are dropped
        (those compiling finish, unused). Calls made after this one are not affected."""
        self._generation += 1  # one writer at a time: the pool's cancel, one call per worker

    def close(self) -> None:
        self._preparing.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
        self.builder.close()
