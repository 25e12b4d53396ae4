"""The scheduler: claims jobs from the database and runs them on worker actors.

`farm scheduler` runs `Scheduler.serve()` as a long-running service; `farm tune` and the
embedded `farm.Client()` run the jobs they submit with `Scheduler.claim_and_run()`. Jobs are claimed with
`FOR UPDATE SKIP LOCKED` (store.claim_job), so two schedulers on one database never run the
same job. While a job runs, a heartbeat thread records that the scheduler is alive; a job
whose scheduler died (no heartbeat for `stale_seconds`) is queued again for another one.
Worker pools (scheduler.pool) are kept between jobs of the same kind: Ray worker actors by
default, or whatever a `pool_factory` makes (the in-process scheduler.local_pool).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from db.store import ResultStore
from farm.core import metrics
from farm.core.errors import one_line
from scheduler.cluster import init_ray
from scheduler.pool import PoolFactory, WorkerPool
from scheduler.ray_pool import RayWorkerPool
from scheduler.tuner import Progress, run_job
from workers.device import LocalTracker

log = logging.getLogger("farm.scheduler")


class Scheduler:
    """Runs jobs of `store` on worker pools.

    `tracker` is the farm's RPC tracker (host, port); None starts one on this machine.
    `ray_address` is a Ray cluster to join; None starts Ray on this machine. `pool_factory`
    makes the pools instead of Ray (then `ray_address` is not used). A job interrupted
    (KeyboardInterrupt: Ctrl-C, or SIGTERM in `farm scheduler`) is cancelled, or with
    `give_back_on_interrupt` (the service) queued again with its trials kept.
    """

    def __init__(self, store: ResultStore, tracker: tuple[str, int] | None = None, ray_address: str | None = None,
                 build_workers: int | None = None, log_dir: Path | None = None,
                 heartbeat_seconds: float = 5.0, stale_seconds: float = 60.0,
                 pool_factory: PoolFactory | None = None, give_back_on_interrupt: bool = False) -> None:
        self.store = store
        self.pool_factory = pool_factory or self._ray_pool
        self.give_back_on_interrupt = give_back_on_interrupt
        self.id = f"scheduler@{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.ray_address, self.build_workers, self.log_dir = ray_address, build_workers, log_dir
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self._tracker: LocalTracker | None = None
        if tracker is None:
            # Not waited for: it listens long before the first RPC server registers with it.
            log_file = log_dir / "tracker.log" if log_dir else None
            self._tracker = LocalTracker(log=log_file).start(wait=False)
            tracker = self._tracker.address

        self.tracker = tracker
        self._pools: dict[tuple[Any, ...], WorkerPool] = {}
        self._stop = threading.Event()

    def pool_for(self, spec: dict[str, Any]) -> WorkerPool:
        """The pool for a job's spec: `workers` devices of its target kind, or its `rpc_keys`."""
        kind = spec["target"]["kind"]
        keys = tuple(spec.get("rpc_keys") or ())
        count = len(keys) or int(spec.get("workers") or 1)
        shape = (kind, count, keys)
        if shape not in self._pools:
            self._pools[shape] = self.pool_factory(kind, count, keys)
            self._publish_targets()
        return self._pools[shape]

    def _ray_pool(self, kind: str, count: int, keys: Sequence[str]) -> WorkerPool:
        # In the thread that runs the job: a Ray driver started in a thread that then ends
        # loses its cluster ("Failed to connect to GCS").
        start = time.monotonic()
        init_ray(self.ray_address)
        log.info("Ray ready in %.1f s", time.monotonic() - start)
        pool = RayWorkerPool(self.tracker, kind, count, list(keys) or None, self.build_workers,
                             str(self.log_dir) if self.log_dir else None, name=f"{kind}-worker")
        log.info("%d %s worker actor(s) up in %.1f s (each: RPC server registered, %s)", pool.size, kind,
                 time.monotonic() - start, ", ".join(f"{i['name']} {i['startup_seconds']:.1f} s" for i in pool.infos))
        return pool

    def _publish_targets(self) -> None:
        """Where Prometheus finds the worker actors' metrics: with FARM_PROMETHEUS_TARGETS (a folder
        that a Prometheus file_sd_config reads, deploy/prometheus/local.yml), one JSON file per
        scheduler listing every actor's metrics address, rewritten when its pools change."""
        folder = os.environ.get("FARM_PROMETHEUS_TARGETS")
        if not folder:
            return
        targets = [{"targets": [i["metrics_address"] for pool in self._pools.values()
                                for i in getattr(pool, "infos", [])], "labels": {"role": "worker"}}]
        path = Path(folder) / f"workers-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets))
        tmp.replace(path)  # Prometheus never reads half a file

    def claim_and_run(self, job_id: int, on_progress: Callable[[Progress], None] | None = None) -> str:
        """Claim job `job_id` for this scheduler and run it; its final status (the job's status
        as it stands when another scheduler has it or it was cancelled before it started)."""
        if self.store.claim_job(self.id, job_id=job_id) is None:
            return self.store.job_status(job_id)
        return self.run_job(job_id, on_progress)

    def run_job(self, job_id: int, on_progress: Callable[[Progress], None] | None = None) -> str:
        """Run a job this scheduler has claimed; record and return its final status."""
        job = self.store.job(job_id)
        spec = job["spec"]
        done = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(job_id, done), daemon=True, name="farm-heartbeat")
        status, error = "failed", ""
        beat.start()
        try:
            pool = self.pool_for(spec)
            status = run_job(self.store, job_id, pool, search=spec.get("search", "xgb"),
                             seed=int(spec.get("seed", 0)), batch_size=int(spec.get("batch_size", 16)),
                             on_progress=on_progress)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM (Ray's driver handler exits)
            status, error = ("queued", "") if self.give_back_on_interrupt else ("cancelled", "interrupted")
            raise
        except Exception as e:
            error = one_line(e)
            log.exception("job %d failed", job_id)
            raise
        finally:
            done.set()
            if status == "queued":
                self.store.give_back(job_id, self.id)
                log.info("job %d given back (queued, its trials kept)", job_id)
            else:
                self.store.finish_job(job_id, status, error)
        return status

    def _heartbeat(self, job_id: int, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_seconds):
            try:
                self.store.heartbeat(job_id, self.id)
                metrics.heartbeat()
            except Exception as e:  # a database hiccup must not kill the job
                log.warning("heartbeat for job %d failed: %s", job_id, one_line(e))

    def serve(self, poll_seconds: float = 1.0, once: bool = False) -> None:
        """Claim and run jobs until `stop()` (or, with `once`, until no job is queued)."""
        log.info("%s serving (tracker %s:%d)", self.id, *self.tracker)
        while not self._stop.is_set():
            metrics.heartbeat()
            metrics.set_jobs(self.store.job_counts())
            self.store.requeue_stale(self.stale_seconds)
            job_id = self.store.claim_job(self.id)
            if job_id is None:
                if once:
                    return
                self._stop.wait(poll_seconds)
                continue
            log.info("running job %d", job_id)
            try:
                status = self.run_job(job_id)
                log.info("job %d %s", job_id, status)
            except Exception:  # recorded as failed by run_job; the service goes on
                continue

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._tracker is not None:
            self._tracker.stop()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
