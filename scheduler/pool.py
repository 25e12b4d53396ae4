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

# Candidates in flight per worker, in batches (of the job's batch_size): enough that built
# candidates wait for the device while the next ones compile and the search plans more, and few
# enough that proposals are guided by a recent model.
QUEUE_DEPTH = 2
# Calls a worker runs at once: the tuning loop hands out work in chunks of a few candidates
# (scheduler.tuner.CHUNK), so a worker with QUEUE_DEPTH batches in flight has many calls open.
MAX_CALLS = 64


class WorkerPool(Protocol):
    """The devices one job measures on, and the searches of its tasks' shards.

    Contract: `submit` returns a future of one MeasureResult per index, in order; a worker
    that fails as a whole (its process died) fails the future, and the pool starts a new worker
    in its place for later calls (the loop measures the configs again). A worker runs up to
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

    def submit(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]: ...

    def searches(self, search: str, task: Task, seed: int, measured: Iterable[int]) -> ShardSearches: ...

    def grow(self) -> int:
        """Add the workers whose devices joined since the last call and are up; how many."""

    def ready(self, worker: int) -> bool:
        """Whether worker `worker` can take work now."""

    def close(self) -> None: ...


# (target kind, device count, RPC keys of devices that run only a TVM server) -> a pool.
PoolFactory = Callable[[str, int, Sequence[str]], WorkerPool]
