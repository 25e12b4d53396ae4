"""Worker actors on a Ray cluster, as the scheduler's WorkerPool, and the shards' searches as
Ray actors beside them (scheduler.ray_searches).

One worker actor per device (`num_gpus=1` each), or one per named RPC key for devices that run only
a TVM RPC server (`num_gpus=0`: the actor compiles and drives the remote board). A GPU node that
joins the cluster while a job runs (`docker compose up --scale gpu-worker=N`, a `ray start
--address` on a new host) gets a worker actor per GPU, which the running job uses once it is up
(`grow`). Each actor
has many calls open at once (the tuning loop's chunks: some compiling, some measuring), so it
runs them in threads (`max_concurrency`).

Each shard's search strategy runs in a `SearchActor` of its own (one per worker, created with
the pool and reused for every task): the shards plan their batches in parallel, and each model
retrained at a round close is put into the Ray object store once, from where every shard's
actor reads it (`RaySearches.set_model`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from farm.core.errors import one_line
from farm.core.measure import MeasureResult
from farm.core.task import Task
from scheduler.pool import MAX_CALLS
from scheduler.ray_searches import RaySearches, SearchActor
from workers.actor import WorkerActor

log = logging.getLogger("farm.scheduler")

# How long `RayWorkerPool.cancel` waits for the actors to hear it.
CANCEL_SECONDS = 2.0


class RayWorkerPool:
    """`count` device actors (or one actor per entry of `rpc_keys`) measuring `kind` kernels.

    An actor whose process dies is replaced by a new one under the same name (see `dispatch`).
    """

    def __init__(self, tracker: tuple[str, int], kind: str, count: int = 1, rpc_keys: list[str] | None = None,
                 build_workers: int | None = None, log_dir: str | None = None, name: str = "worker") -> None:
        import ray

        self.tracker, self.kind, self.rpc_keys = tracker, kind, list(rpc_keys or [])
        self.build_workers, self.log_dir, self.name = build_workers, log_dir, name
        self._lock = threading.Lock()  # actors are replaced from Ray's callback threads
        self._nodes = _gpu_nodes()  # nodes seen: a GPU node not among them joined later (grow)
        self._starting: list[Any] = []  # actors of joined devices, starting
        self._joined: list[tuple[Any, dict[str, Any]]] = []  # actors of joined devices, up: (actor, info)
        self._down: set[int] = set()  # workers whose replacement actor is not up yet
        self._closed = False  # once closing: an actor's death is no longer replaced
        self.actors: list[Any] = [self._new_actor(i) for i in range(len(self.rpc_keys) or count)]
        # The shards' search actors start beside the worker actors, not after them.
        self._search_actors: list[Any] = self._new_search_actors()
        self.infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in self.actors], timeout=180)

    def _new_actor(self, i: int) -> Any:
        """Start worker actor `i`: a GPU's (num_gpus=1), or the driver of the i-th RPC key's device."""
        import ray

        remote = ray.remote(WorkerActor).options(num_cpus=0, max_concurrency=MAX_CALLS + 2,
                                                 num_gpus=0 if self.rpc_keys else 1)
        if self.rpc_keys:
            return remote.remote(f"{self.name}-{i}", self.tracker, self.kind, key=self.rpc_keys[i], own_server=False,
                                 build_workers=self.build_workers)
        return remote.remote(f"{self.name}-{i}", self.tracker, self.kind, build_workers=self.build_workers,
                             log_dir=self.log_dir)

    @property
    def size(self) -> int:
        return len(self.actors)

    @property
    def names(self) -> list[str]:
        return [info["name"] for info in self.infos]

    def dispatch(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]:
        """Run the call on worker actor `worker`. If the actor has died (ActorDiedError), a new
        actor takes its place before the future fails, so the configs can be sent again at once."""
        import ray

        task_json = json.dumps(task.to_json(), sort_keys=True)
        actor = self.actors[worker]
        raw = actor.build_and_measure.remote(task_json, indices, shard, round_).future()
        out: cf.Future[list[MeasureResult]] = cf.Future()

        def done(f: cf.Future[list[dict[str, Any]]]) -> None:
            try:
                out.set_result([MeasureResult.from_json(d) for d in f.result()])
            except ray.exceptions.ActorDiedError as e:
                self._replace(worker, actor, e)
                out.set_exception(e)
            except Exception as e:  # the scheduler measures the configs again
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def _replace(self, worker: int, dead: Any, error: Exception) -> None:
        """A new actor in place of `dead` (once, however many of its calls fail)."""
        with self._lock:
            # Calls the tuning loop left running (its end game's) fail once `close` kills their actor.
            if self._closed or self.actors[worker] is not dead:
                return
            log.warning("worker actor %s died (%s); starting a new one", self.names[worker], one_line(error))
            self.actors[worker] = new = self._new_actor(worker)
            self._down.add(worker)
        new.info.remote().future().add_done_callback(lambda f: self._set_info(worker, f))

    def cancel(self) -> None:
        """Tell every worker actor to stop its calls in flight; waited for (briefly), so that calls
        made after this return are not stopped. An actor that is dead or does not answer within
        CANCEL_SECONDS (its node gone, Ray stopping) has no call left to stop, or none that returns."""
        import ray

        try:
            ray.get([a.cancel.remote() for a in self.actors], timeout=CANCEL_SECONDS)
        except Exception as e:
            log.warning("stopping the worker actors' calls: %s", one_line(e))

    def devices(self, timeout: float) -> set[str]:
        import ray

        calls = [a.device_name.remote() for i, a in enumerate(self.actors) if self.ready(i)]
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        names = set()
        for call in done:
            try:
                names.add(ray.get(call))
            except Exception as e:  # its device failed: its trials will say so
                log.warning("asking a worker actor for its device: %s", one_line(e))
        return names

    def grow(self) -> int:
        """Start a worker actor for every GPU of the nodes that joined since the last call, and add
        those that are up (their calls would wait for a GPU otherwise); how many were added. An
        actor placed elsewhere (another scheduler took the new GPU first) is added all the same
        once Ray places it; one never placed is never used. Devices named by RPC keys never grow."""
        if self.rpc_keys:
            return 0
        nodes = _gpu_nodes()
        new = {node: gpus for node, gpus in nodes.items() if node not in self._nodes}
        self._nodes.update(new)
        for node, gpus in new.items():
            log.info("a node with %d GPU(s) joined the cluster (%s): starting a worker actor on each", gpus, node[:12])
            for _ in range(gpus):
                self._start_joining()
        with self._lock:
            joined, self._joined = self._joined, []
            for actor, info in joined:
                self.actors.append(actor)
                self.infos.append(info)
                log.info("worker actor %s joined the pool (%d workers now)", info["name"], len(self.actors))
        return len(joined)

    def _start_joining(self) -> None:
        with self._lock:
            actor = self._new_actor(len(self.actors) + len(self._joined) + len(self._starting))
            self._starting.append(actor)

        def up(info: cf.Future[dict[str, Any]]) -> None:
            with self._lock:
                self._starting.remove(actor)
                try:
                    self._joined.append((actor, info.result()))
                except Exception as e:  # it died starting: the devices already in the pool go on
                    log.warning("a worker actor for a joined GPU did not start: %s", one_line(e))

        actor.info.remote().future().add_done_callback(up)

    def ready(self, worker: int) -> bool:
        """False from a worker actor's death until its replacement is up: a replacement waits for
        a free device, which never comes when the node left the cluster with its GPUs."""
        return worker not in self._down

    def _set_info(self, worker: int, info: cf.Future[dict[str, Any]]) -> None:
        """Record a replacement actor's info (its metrics address) once it is up; the worker takes
        work again. One that died starting leaves the worker down."""
        try:
            self.infos[worker] = info.result()
        except Exception as e:
            log.warning("worker actor %s did not start: %s", self.names[worker], one_line(e))
            return
        with self._lock:
            self._down.discard(worker)
        log.info("worker actor %s is up again", self.names[worker])

    def searches(self, search: str, task: Task, seed: int, measured: Mapping[int, float | None]) -> RaySearches:
        """One search per worker's shard of `task`, in this pool's search actors (see RaySearches)."""
        import ray

        try:
            return RaySearches(self._search_actors, search, task, seed, measured)
        except ray.exceptions.RayActorError as e:  # one died since the last task: start them afresh
            log.warning("a search actor died (%s); starting new ones", one_line(e))
            for a in self._search_actors:
                ray.kill(a)
            self._search_actors = self._new_search_actors()
            return RaySearches(self._search_actors, search, task, seed, measured)

    def _new_search_actors(self) -> list[Any]:
        """One new SearchActor per worker, on the scheduler's node (searching is the scheduler's
        work; a GPU node may leave the cluster mid-job, and its actors with it). The placement is
        strict: a soft one put a search on a GPU host that was then cut off, and the job failed
        with that actor's death. The scheduler's node always has room: it is a Ray node (the
        driver's), and a search takes no CPU resource."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        remote = ray.remote(SearchActor).options(num_cpus=0, scheduling_strategy=here)
        return [remote.remote() for _ in self.actors]

    def close(self) -> None:
        import ray

        with self._lock:  # joined devices not yet in the pool are stopped too; one still starting is killed
            self._closed = True
            self.actors += [actor for actor, _ in self._joined]
            starting, self._starting, self._joined = self._starting, [], []
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as e:  # an actor that died has nothing left to close
            log.warning("closing worker actors: %s", e)
        for a in self.actors + starting + self._search_actors:
            ray.kill(a)
        self.actors.clear()
        self._search_actors.clear()


def _gpu_nodes() -> dict[str, int]:
    """The cluster's alive nodes that have GPUs: node id -> GPU count."""
    import ray

    return {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in ray.nodes()
            if n.get("Alive") and n["Resources"].get("GPU", 0) >= 1}
