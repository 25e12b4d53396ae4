"""Where a job's batches run: the `WorkerPool` seam of the tuning loop, and its factory.

Two implementations: `scheduler.ray_pool.RayWorkerPool` (one Ray actor per device, anywhere
on the cluster; what `farm scheduler`, `farm tune` and the embedded client use) and
`scheduler.local_pool.LocalWorkerPool` (workers in this process: tests, benchmarks, `farm
predict --measure`, and any caller that hands the loop workers of its own).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from farm.core.measure import MeasureResult
from farm.core.task import Task
from scheduler.shards import ShardSearches

# Batches queued per worker: one running, one waiting behind it, so a device never idles
# while the scheduler writes results and proposes (Kernel Tuner's parallel runner does the same).
QUEUE_DEPTH = 2


class WorkerPool(Protocol):
    """The devices one job measures on, and the searches of its tasks' shards.

    Contract: `submit` returns a future of one MeasureResult per index, in order (a worker that
    fails as a whole fails the future; the loop records that); a worker runs at most
    QUEUE_DEPTH batches at once. `searches` gives one search per worker's shard, none
    proposing `measured`. `close` stops every process the pool started.
    """

    @property
    def size(self) -> int: ...

    @property
    def names(self) -> list[str]:
        """Each worker's name (its metrics and trials carry it), in worker order."""

    def submit(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]: ...

    def searches(self, search: str, task: Task, seed: int, measured: Iterable[int]) -> ShardSearches: ...

    def close(self) -> None: ...


# (target kind, device count, RPC keys of devices that run only a TVM server) -> a pool.
PoolFactory = Callable[[str, int, Sequence[str]], WorkerPool]
