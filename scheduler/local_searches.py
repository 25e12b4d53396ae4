"""The shards' searches of one task in this process: `LocalSearches` (a ShardSearches,
scheduler.shards), every shard's strategy an object of the scheduler's process (unit tests,
benchmarks that need no cluster, the in-process worker pool: scheduler.local_pool).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence

from farm.core.costmodel import StoredModel
from farm.core.measure import MeasureResult
from farm.core.task import Task
from scheduler.shards import Proposal, proposal, shard_search


class LocalSearches:
    """Every shard's strategy as an object of this process."""

    def __init__(self, search: str, task: Task, seed: int, shards: int,
                 measured: Mapping[int, float | None] | None = None) -> None:
        """FarmError for a bad search spec. `measured`: configs no shard may propose, with their
        latencies (None: failed)."""
        done = dict(measured or {})
        self.strategies = [shard_search(search, task, seed, s, done) for s in task.space.shards(shards)]

    @property
    def count(self) -> int:
        return len(self.strategies)

    def propose(self, requests: Sequence[tuple[int, int]]) -> list[cf.Future[Proposal]]:
        """Planned here and now, in order: the futures are done when they are returned."""
        futures: list[cf.Future[Proposal]] = []
        for shard, n in requests:
            future: cf.Future[Proposal] = cf.Future()
            future.set_result(proposal(self.strategies[shard], n))
            futures.append(future)
        return futures

    def observe(self, shard: int, results: list[MeasureResult]) -> None:
        self.strategies[shard].observe(results)

    def set_model(self, model: StoredModel | None) -> None:
        for strategy in self.strategies:
            strategy.set_model(model.model if model else None)

    def close(self) -> None:
        self.strategies.clear()
