"""Worker actors on a Ray cluster, as the scheduler's WorkerPool.

One actor per device (`num_gpus=1` each), or one per named RPC key for devices that run only
a TVM RPC server (`num_gpus=0`: the actor compiles and drives the remote board). Each actor
runs up to QUEUE_DEPTH batches at once (one measuring, one compiling behind it), so calls
are made with `max_concurrency` above that.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
from typing import Any

from farm.measure import MeasureResult
from farm.task import Task
from scheduler.tuner import QUEUE_DEPTH
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
        self.infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in self.actors], timeout=180)

    @property
    def size(self) -> int:
        return len(self.actors)

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

    def close(self) -> None:
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as e:  # an actor that died has nothing left to close
            log.warning("closing worker actors: %s", e)
        for a in self.actors:
            ray.kill(a)
        self.actors.clear()
