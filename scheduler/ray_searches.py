"""The shards' searches of one task as Ray actors: `RaySearches` (a ShardSearches, scheduler.shards)
and its `SearchActor`s, one per shard.

The actors are created with the worker pool (scheduler.ray_pool) and reused for every task: the
shards plan their batches in parallel, each in its own process, while the tuning loop goes on
(proposals are futures), and each model retrained at a round close is put into the Ray object
store once, from where every shard's actor reads it (`RaySearches.set_model`). An actor holds one
search per open RaySearches, under that RaySearches' key, until it is closed: a model job keeps the
searches of several tasks open and comes back to each for its next slice (scheduler.tuner), so a
task's search must still be its own, with what it observed, when the job returns to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from farm.core.costmodel import CostModel, StoredModel
from farm.core.measure import MeasureResult
from farm.core.search import SearchStrategy, parse_search
from farm.core.task import Task
from farm.core.tvm_import import import_tvm
from scheduler.shards import Proposal, proposal, shard_search


class SearchActor:
    """The search strategies of one shard of each open task, in a process of its own (a Ray actor),
    each under its RaySearches' key."""

    def __init__(self) -> None:
        """Imports TVM: a task's space needs it (its template's loop extents), and the actor is
        created with the pool, so the import overlaps the worker actors' start instead of
        delaying the first task's proposals."""
        import_tvm()

        self.strategies: dict[str, SearchStrategy] = {}
        self.model_ids: dict[str, int | None] = {}

    def start(self, key: str, search: str, task_json: str, seed: int, shard: int, shards: int,
              measured: dict[int, float | None]) -> None:
        """Search shard `shard` of `shards` of the task under `key` from now on, skipping `measured`
        (config index -> latency, None: failed)."""
        task = Task.from_json(json.loads(task_json))
        self.strategies[key] = shard_search(search, task, seed, task.space.shards(shards)[shard], measured)
        self.model_ids[key] = None

    def propose(self, key: str, n: int) -> Proposal:
        return proposal(self.strategies[key], n)

    def observe(self, key: str, results: list[MeasureResult]) -> None:
        self.strategies[key].observe(results)

    def set_model(self, key: str, model: bytes | None, model_id: int | None) -> None:
        """Guide the search under `key` with the model saved as `model` (CostModel.to_bytes; None: no
        model). Called with an object reference, so Ray hands in the bytes from its object store."""
        self.strategies[key].set_model(CostModel.from_bytes(model) if model is not None else None)
        self.model_ids[key] = model_id

    def forget(self, key: str) -> None:
        """Drop the search under `key` (its RaySearches was closed)."""
        self.strategies.pop(key, None)
        self.model_ids.pop(key, None)

    def info(self, key: str) -> dict[str, Any]:
        """Which model guides the search under `key` (its store id), and this actor's process id."""
        return {"model_id": self.model_ids.get(key), "pid": os.getpid()}


class RaySearches:
    """The ShardSearches (scheduler.shards) of one task, one `SearchActor` per shard.

    Ray runs an actor's calls in the order they were made, so a shard's `observe` always lands
    before its next `propose`. Proposals to different shards are planned in parallel. Several
    RaySearches may share the actors, each its own searches in them (module docstring).
    """

    def __init__(self, actors: list[Any], search: str, task: Task, seed: int,
                 measured: Mapping[int, float | None]) -> None:
        """FarmError for a bad search spec (raised here, not in the actors)."""
        import ray

        parse_search(search)
        self.actors = actors
        self.key = uuid.uuid4().hex
        done = ray.put(dict(measured))
        task_json = json.dumps(task.to_json(), sort_keys=True)
        ray.get([a.start.remote(self.key, search, task_json, seed, i, len(actors), done)
                 for i, a in enumerate(actors)])

    @property
    def count(self) -> int:
        return len(self.actors)

    def propose(self, requests: Sequence[tuple[int, int]]) -> list[cf.Future[Proposal]]:
        return [self.actors[shard].propose.remote(self.key, n).future() for shard, n in requests]

    def observe(self, shard: int, results: list[MeasureResult]) -> None:
        self.actors[shard].observe.remote(self.key, results)

    def set_model(self, model: StoredModel | None) -> None:
        """Put the model's bytes into the object store once; every shard's actor reads them there.
        Not waited for: an actor runs its calls in order, so its next proposal uses the model."""
        import ray

        ref = ray.put(model.model.to_bytes() if model is not None and model.model.trained else None)
        for a in self.actors:
            a.set_model.remote(self.key, ref, model.model_id if model else None)

    def info(self) -> list[dict[str, Any]]:
        """Each shard actor's `SearchActor.info`."""
        import ray

        return ray.get([a.info.remote(self.key) for a in self.actors])

    def close(self) -> None:
        """Drop this task's searches from the actors, which belong to the pool and serve its next
        tasks. Not waited for: an actor that died has none to drop."""
        for a in self.actors:
            a.forget.remote(self.key)
