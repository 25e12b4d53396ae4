"""Where a job's batches run: the `WorkerPool` seam of the tuning loop, and its factory.

Two implementations: `scheduler.ray_pool.RayWorkerPool` (one Ray actor per device, anywhere
on the cluster; what `farm scheduler`, `farm tune` and the embedded client use) and
`scheduler.local_pool.LocalWorkerPool` (workers in this process: tests, benchmarks, `farm
predict --measure`, and any caller that hands the loop workers of its own).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from farm.core.measure import MeasureResult
from farm.core.task import Task
from scheduler.shards import ShardSearches

# The most candidates in flight per worker, in batches (of the job's batch_size); a worker whose
# builds keep up with its device has fewer (`Lead`; docs/defaults.md#queue-depth).
QUEUE_DEPTH = 2
# Calls a worker runs at once: the tuning loop hands out work in chunks of a few candidates
# (scheduler.tuner.CHUNK), so a worker with QUEUE_DEPTH batches in flight has many calls open.
MAX_CALLS = 64


class Lead:
    """How many candidates one worker keeps in flight: as many as its builds need to keep its device
    busy, and no more, so that each proposal is made as late as it can be, by the newest model.

    A candidate in flight is being proposed, compiled, waiting for the device or measured. With the
    device the bottleneck, it measures a candidate every `device` seconds (the mean of the recent
    results' run_seconds, 0 for those that never reached it), and by Little's law `build / device`
    candidates are compiling at once (`build`: the mean build_seconds); two chunks more are the one
    being measured and the next one, built and waiting. Where builds are the bottleneck (a CPU
    device, few cores) that count is large, and the cap holds. Until `chunk` results have come back
    the lead is the cap (`most`); it is never under two chunks (or `most`).

    Why: a proposal's model is as old as the candidates in flight ahead of it (plus part of a
    round), and the model-guided search is as good as its model's age allows; a fixed two batches
    in flight kept that lag where the device, not the builds, set the pace (docs/defaults.md#lead).
    """

    def __init__(self, chunk: int, most: int, window: int = 32) -> None:
        self.chunk, self.most = chunk, most
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)  # (build_seconds, run_seconds)

    def observe(self, results: Iterable[MeasureResult]) -> None:
        """Take in a worker's returned results (their build and device seconds)."""
        self._recent.extend((r.build_seconds, r.run_seconds) for r in results)

    @property
    def size(self) -> int:
        """Candidates to keep in flight now (see the class docstring)."""
        least = min(self.most, 2 * self.chunk)
        device = sum(run for _, run in self._recent) / max(1, len(self._recent))
        if len(self._recent) < self.chunk or device <= 0:
            return self.most
        build = sum(b for b, _ in self._recent) / len(self._recent)
        return max(least, min(self.most, math.ceil(build / device) + 2 * self.chunk))


class WorkerPool(Protocol):
    """The devices one job measures on, and the searches of its tasks' shards.

    Contract: `dispatch` returns a future of one MeasureResult per index, in order; a worker
    that fails as a whole (its process died) fails the future, and the pool starts a new worker
    in its place for later calls (the loop measures the configs again). `cancel` stops the calls in
    flight (a job cancelled or interrupted): each of their futures resolves as soon as the
    candidate being measured is, to the results measured so far (fewer than its indices), and
    their candidates not yet built are dropped; it returns once every worker is told, so calls
    submitted after it run in full. A worker runs up to
    MAX_CALLS calls at once. `searches` gives one search per worker's shard, none proposing
    `measured`. `grow` adds workers on devices that joined since (a GPU node joining the
    cluster mid-job); workers are only ever added, at the end of the worker order. `ready` says
    whether a worker can take work now (not while a dead worker's replacement waits for a
    device: its node left the cluster). `close` stops every process the pool started.
    """

    @property
    def size(self) -> int: ...

    @property
    def names(self) -> list[str]:
        """Each worker's name (its metrics and trials carry it), in worker order."""

    def dispatch(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]: ...

    def cancel(self) -> None: ...

    def devices(self, timeout: float) -> set[str]:
        """The devices the ready workers measure on, named as their trials name them; a worker that
        does not answer within `timeout` seconds (its device still coming up, or failing) is left out."""

    def searches(self, search: str, task: Task, seed: int, measured: Mapping[int, float | None]) -> ShardSearches: ...

    def grow(self) -> int:
        """Add the workers whose devices joined since the last call and are up; how many."""

    def ready(self, worker: int) -> bool:
        """Whether worker `worker` can take work now."""

    def close(self) -> None: ...


# (target kind, device count, RPC keys of devices that run only a TVM server) -> a pool.
PoolFactory = Callable[[str, int, Sequence[str]], WorkerPool]
