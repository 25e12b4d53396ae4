"""Worker actors on a Ray cluster, as the scheduler's WorkerPool, and the shards' searches as
Ray actors beside them.

One worker actor per device (`num_gpus=1` each), or one per named RPC key for devices that run only
a TVM RPC server (`num_gpus=0`: the actor compiles and drives the remote board). Each actor
runs up to QUEUE_DEPTH batches at once (one measuring, one compiling behind it), so calls
are made with `max_concurrency` above that.

Each shard's search strategy runs in a `SearchActor` of its own (one per worker, created with
the pool and reused for every task): the shards plan their batches in parallel, and each model
retrained at a round close is put into the Ray object store once, from where every shard's
actor reads it (`RaySearches.set_model`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from farm.core.costmodel import CostModel, StoredModel
from farm.core.errors import one_line
from farm.core.measure import MeasureResult
from farm.core.search import SearchStrategy, search_class
from farm.core.task import Task
from scheduler.pool import QUEUE_DEPTH
from scheduler.shards import shard_search
from workers.actor import WorkerActor

log = logging.getLogger("farm.scheduler")


class RayWorkerPool:
    """`count` device actors (or one actor per entry of `rpc_keys`) measuring `kind` kernels."""

    def __init__(self, tracker: tuple[str, int], kind: str, count: int = 1, rpc_keys: list[str] | None = None,
                 build_workers: int | None = None, log_dir: str | None = None, name: str = "worker") -> None:
        import ray

        remote = ray.remote(WorkerActor)
        self.actors: list[Any] = []
        if rpc_keys:
            for i, key in enumerate(rpc_keys):
                self.actors.append(remote.options(num_gpus=0, num_cpus=0, max_concurrency=QUEUE_DEPTH + 2).remote(
                    f"{name}-{i}", tracker, kind, key=key, own_server=False, build_workers=build_workers))
        else:
            for i in range(count):
                self.actors.append(remote.options(num_gpus=1, num_cpus=0, max_concurrency=QUEUE_DEPTH + 2).remote(
                    f"{name}-{i}", tracker, kind, build_workers=build_workers, log_dir=log_dir))
        # The shards' search actors start beside the worker actors, not after them.
        self._search_actors: list[Any] = self._new_search_actors()
        self.infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in self.actors], timeout=180)

    @property
    def size(self) -> int:
        return len(self.actors)

    @property
    def names(self) -> list[str]:
        return [info["name"] for info in self.infos]

    def submit(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]:
        task_json = json.dumps(task.to_json(), sort_keys=True)
        raw = self.actors[worker].process.remote(task_json, indices, shard, round_).future()
        out: cf.Future[list[MeasureResult]] = cf.Future()

        def done(f: cf.Future[list[dict[str, Any]]]) -> None:
            try:
                out.set_result([MeasureResult.from_json(d) for d in f.result()])
            except Exception as e:  # the actor died: the scheduler records the batch as failed
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def searches(self, search: str, task: Task, seed: int, measured: Iterable[int]) -> RaySearches:
        """One search per worker's shard of `task`, in this pool's search actors (see RaySearches)."""
        import ray

        measured = list(measured)
        try:
            return RaySearches(self._search_actors, search, task, seed, measured)
        except ray.exceptions.RayActorError as e:  # one died since the last task: start them afresh
            log.warning("a search actor died (%s); starting new ones", one_line(e))
            for a in self._search_actors:
                ray.kill(a)
            self._search_actors = self._new_search_actors()
            return RaySearches(self._search_actors, search, task, seed, measured)

    def _new_search_actors(self) -> list[Any]:
        """One new SearchActor per worker."""
        import ray

        remote = ray.remote(SearchActor).options(num_cpus=0)
        return [remote.remote() for _ in self.actors]

    def close(self) -> None:
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as e:  # an actor that died has nothing left to close
            log.warning("closing worker actors: %s", e)
        for a in self.actors + self._search_actors:
            ray.kill(a)
        self.actors.clear()
        self._search_actors.clear()


class SearchActor:
    """One shard's search strategy, in a process of its own (a Ray actor), for one task at a time."""

    def __init__(self) -> None:
        self.strategy: SearchStrategy | None = None
        self.model_id: int | None = None

    def start(self, search: str, task_json: str, seed: int, shard: int, shards: int, measured: list[int]) -> None:
        """Search shard `shard` of `shards` of the task from now on, skipping `measured`."""
        task = Task.from_json(json.loads(task_json))
        self.strategy = shard_search(search, task, seed, task.space.shards(shards)[shard], measured)
        self.model_id = None

    def propose(self, n: int) -> list[int]:
        assert self.strategy is not None, "start() first"
        return self.strategy.propose(n)

    def observe(self, results: list[MeasureResult]) -> None:
        assert self.strategy is not None, "start() first"
        self.strategy.observe(results)

    def set_model(self, model: bytes | None, model_id: int | None) -> None:
        """Guide the search with the model saved as `model` (CostModel.to_bytes; None: no model).
        Called with an object reference, so Ray hands in the bytes from its object store."""
        assert self.strategy is not None, "start() first"
        self.strategy.set_model(CostModel.from_bytes(model) if model is not None else None)
        self.model_id = model_id

    def info(self) -> dict[str, Any]:
        """Which model guides this shard (its store id), and this actor's process id."""
        return {"model_id": self.model_id, "pid": os.getpid()}


class RaySearches:
    """The ShardSearches (scheduler.shards) of one task, one `SearchActor` per shard.

    Ray runs an actor's calls in the order they were made, so a shard's `observe` always lands
    before its next `propose`. Proposals to different shards are planned in parallel.
    """

    def __init__(self, actors: list[Any], search: str, task: Task, seed: int, measured: Iterable[int]) -> None:
        """FarmError for an unknown search name (raised here, not in the actors)."""
        import ray

        search_class(search)
        self.actors = actors
        done = ray.put(sorted(set(measured)))
        task_json = json.dumps(task.to_json(), sort_keys=True)
        ray.get([a.start.remote(search, task_json, seed, i, len(actors), done) for i, a in enumerate(actors)])

    @property
    def count(self) -> int:
        return len(self.actors)

    def propose(self, requests: Sequence[tuple[int, int]]) -> list[list[int]]:
        import ray

        return ray.get([self.actors[shard].propose.remote(n) for shard, n in requests])

    def observe(self, shard: int, results: list[MeasureResult]) -> None:
        self.actors[shard].observe.remote(results)

    def set_model(self, model: StoredModel | None) -> None:
        """Put the model's bytes into the object store once; every shard's actor reads them there."""
        import ray

        ref = ray.put(model.model.to_bytes() if model is not None and model.model.trained else None)
        ray.get([a.set_model.remote(ref, model.model_id if model else None) for a in self.actors])

    def info(self) -> list[dict[str, Any]]:
        """Each shard actor's `SearchActor.info`."""
        import ray

        return ray.get([a.info.remote() for a in self.actors])

    def close(self) -> None:
        """Nothing to do: the actors belong to the pool and serve its next task."""
