"""Where a task's shard searches live, and how each new cost model reaches them.

The tuning loop (scheduler.tuner) talks to one `ShardSearches` per task: one search strategy
per shard (farm.core.search), asked for batches, told the results, and handed the cost model that
is retrained when a round closes. This module holds the contract and what both implementations
share (`shard_search`, `proposal`); the implementations stand side by side:

- `scheduler.local_searches.LocalSearches`: the strategies are objects of the scheduler's process
  (unit tests, benchmarks that need no cluster).
- `scheduler.ray_searches.RaySearches`: one Ray actor per shard. A new model is put into the Ray
  object store once and every shard's actor reads it from there; the shards plan their
  batches in parallel, each in its own process, anywhere on the cluster, while the tuning loop
  goes on (proposals are futures).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from typing import Protocol

from farm.core.costmodel import StoredModel
from farm.core.measure import MeasureResult
from farm.core.search import SearchStrategy, make_search
from farm.core.space import Shard
from farm.core.task import Task

# A shard's answer to a request: (config index, what proposed it: SearchStrategy.origin) per config.
Proposal = list[tuple[int, str]]


class ShardSearches(Protocol):
    """The searches of every shard of one task (see the module docstring)."""

    @property
    def count(self) -> int:
        """How many shards."""

    def propose(self, requests: Sequence[tuple[int, int]]) -> list[cf.Future[Proposal]]:
        """For each (shard, n): a future of up to n new config indices of that shard, each with
        its origin (the SearchStrategy contract: valid, never proposed or measured before; fewer
        only when the shard is out). A shard plans its requests in the order they were made, after
        every `observe` and `set_model` made before; different shards may plan in parallel."""

    def observe(self, shard: int, results: list[MeasureResult]) -> None:
        """Feed back results measured from `shard`; seen by that shard before its next proposal."""

    def set_model(self, model: StoredModel | None) -> None:
        """Hand every shard the model to guide its next proposals (None: no model); may return
        before the shards have it (their next proposals still use it)."""

    def close(self) -> None:
        """Release what the searches hold (processes, actors)."""


def shard_search(search: str, task: Task, seed: int, shard: Shard,
                 measured: Mapping[int, float | None]) -> SearchStrategy:
    """The strategy `search` for one shard, told which configs are measured already and their
    latencies (None: failed)."""
    strategy = make_search(search, task, shard, seed)
    strategy.mark_measured(measured)
    return strategy


def proposal(strategy: SearchStrategy, n: int) -> Proposal:
    """`strategy`'s next `n` configs, each with its origin: the task's baseline first where the
    shard has it to propose (`SearchStrategy.baseline`)."""
    first = [(index, "baseline") for index in strategy.baseline()][:n]
    return first + [(index, strategy.origin(index)) for index in strategy.propose(n - len(first))]
