"""The scheduler: claims jobs from the database and runs them on worker actors.

`farm scheduler` runs `Scheduler.serve()` as a long-running service; `farm tune` and the
embedded `farm.Client()` run the jobs they submit with `Scheduler.claim_and_run()`. Jobs are claimed with
`FOR UPDATE SKIP LOCKED` (store.claim_job), so two schedulers on one database never run the
same job. While a job runs, a heartbeat thread records that the scheduler is alive; a job
whose scheduler died (no heartbeat for `stale_seconds`) is queued again for another one.

The database may be unavailable for minutes (db.outage): every store call waits for it, up to
the outage bound ($FARM_DB_OUTAGE_SECONDS, 600 s), so a running job pauses at its next call and
goes on when it is back, its measured results held by the writer meanwhile. Past the bound the job
fails; how it ended is recorded once the database is back. The service itself never stops for it:
it keeps looking for jobs, backing off from `poll_seconds` to every 30 s.
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

from db.outage import DatabaseUnavailable
from db.store import ResultStore
from farm.core import metrics
from farm.core.backoff import Backoff
from farm.core.errors import FarmError, one_line
from scheduler.cluster import init_ray, stop_ray
from scheduler.pool import PoolFactory, WorkerPool
from scheduler.ray_pool import RayWorkerPool
from scheduler.tuner import Progress, run_job
from workers.builder import warm_nvcc
from workers.device import LocalTracker

log = logging.getLogger("farm.scheduler")

# The longest the service waits between looks for jobs while the database is unavailable.
MAX_POLL_BACKOFF_SECONDS = 30.0


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
        self._started_ray = False  # a local Ray instance this scheduler started, stopped by close()
        if tracker is None:
            # Not waited for: it listens long before the first RPC server registers with it.
            log_file = log_dir / "tracker.log" if log_dir else None
            self._tracker = LocalTracker(log=log_file).start(wait=False)
            tracker = self._tracker.address

        self.tracker = tracker
        self._pools: dict[tuple[Any, ...], WorkerPool] = {}
        self._stop = threading.Event()
        # Jobs that ended while the database was unavailable: job id -> (status, error) to record.
        self._unrecorded: dict[int, tuple[str, str]] = {}

    def pool_for(self, spec: dict[str, Any]) -> WorkerPool:
        """The pool for a job's spec: `workers` devices of its target kind, or its `rpc_keys`.

        The pool of the last job is kept for the next job of the same shape (its actors, servers,
        sessions and build processes warm). A job of another shape first closes it: this scheduler
        runs one job at a time, so the kept pool is idle, and its devices (Ray's GPUs, RPC keys)
        are what the new pool may need. Before, a 2-worker job after a 1-worker job on a 2-GPU
        cluster waited for a GPU the idle pool held, and failed after 180 s.
        """
        kind = spec["target"]["kind"]
        keys = tuple(spec.get("rpc_keys") or ())
        count = len(keys) or int(spec.get("workers") or 1)
        shape = (kind, count, keys)
        if shape not in self._pools:
            for old in list(self._pools):
                log.info("closing the idle pool of %d %s worker(s) for a job of another shape", old[1], old[0])
                self._pools.pop(old).close()
            self._pools[shape] = self.pool_factory(kind, count, keys)
            self._publish_targets()
        return self._pools[shape]

    def _ray_pool(self, kind: str, count: int, keys: Sequence[str]) -> WorkerPool:
        # In the thread that runs the job: a Ray driver started in a thread that then ends
        # loses its cluster ("Failed to connect to GCS").
        start = time.monotonic()
        if kind == "cuda" and self.ray_address is None:
            # This machine builds the kernels: its CUDA toolchain comes off disk while Ray starts.
            threading.Thread(target=_warm_nvcc, daemon=True, name="farm-nvcc-warm").start()
        log.info("starting Ray")
        self._started_ray = init_ray(self.ray_address) or self._started_ray
        log.info("Ray ready in %.1f s", time.monotonic() - start)
        log.info("starting %d %s worker actor(s): build processes, RPC servers", count, kind)
        pool = RayWorkerPool(self.tracker, kind, count, list(keys) or None, self.build_workers,
                             str(self.log_dir) if self.log_dir else None, name=f"{kind}-worker")
        log.info("%d %s worker actor(s) up in %.1f s (each: %s; RPC servers register meanwhile)", pool.size, kind,
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
        """Run a job this scheduler has claimed; record and return its final status. An error
        that fails the job is raised once recorded (or kept to record, see `_record`)."""
        job = self.store.job(job_id)
        spec = job["spec"]
        done = threading.Event()
        lost = threading.Event()  # the job is no longer this scheduler's
        beat = threading.Thread(target=self._heartbeat, args=(job_id, done, lost), daemon=True,
                                name="farm-heartbeat")
        status, error = "failed", ""
        beat.start()
        try:
            pool = self.pool_for(spec)
            status = run_job(self.store, job_id, pool, search=spec.get("search", "xgb"),
                             seed=int(spec.get("seed", 0)), batch_size=int(spec.get("batch_size", 16)),
                             on_progress=on_progress, should_stop=lost.is_set)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM (Ray's driver handler exits)
            status, error = ("queued", "") if self.give_back_on_interrupt else ("cancelled", "interrupted")
            raise
        except Exception as e:
            error = one_line(e)
            raise
        finally:
            done.set()
            self._record(job_id, status, error)
        return status

    def _record(self, job_id: int, status: str, error: str) -> None:
        """Record how a job of this scheduler ended: finished, or queued again (given back). If the
        database is unavailable past the outage bound, keep it for `_record_unrecorded`."""
        self._unrecorded[job_id] = (status, error)
        try:
            self._record_unrecorded()
        except DatabaseUnavailable:
            log.info("job %d ended %s; it is recorded once the database is back", job_id, status)

    def _record_unrecorded(self) -> None:
        """Record the ends of jobs kept by `_record`; DatabaseUnavailable if it is still unavailable
        (the job kept), any other error as it comes (the job dropped: retrying would not help)."""
        for job_id, (status, error) in list(self._unrecorded.items()):
            del self._unrecorded[job_id]
            try:
                if status == "queued":
                    self.store.give_back(job_id, self.id)
                    log.info("job %d given back (queued, its trials kept)", job_id)
                else:
                    # Only while it is still ours: requeued and claimed by another meanwhile, it is theirs.
                    self.store.finish_job(job_id, status, error, scheduler_id=self.id)
            except DatabaseUnavailable:
                self._unrecorded[job_id] = (status, error)
                raise

    def _heartbeat(self, job_id: int, done: threading.Event, lost: threading.Event) -> None:
        """Every `heartbeat_seconds` until `done`: say the job is still this scheduler's. When the
        store says it is not (cancelled, or requeued after heartbeats that did not arrive and then
        claimed by another scheduler), set `lost`: the job stops here, so that it does not run twice."""
        while not done.wait(self.heartbeat_seconds):
            try:
                if not self.store.heartbeat(job_id, self.id) and not lost.is_set():
                    log.warning("job %d is no longer this scheduler's (cancelled, or requeued and taken over): "
                                "stopping it here", job_id)
                    lost.set()
                metrics.heartbeat()
                # While a job runs too, or the jobs-by-state panel and the no-trials alert see it queued.
                metrics.set_jobs(self.store.job_counts())
            except DatabaseUnavailable as e:  # past the outage bound: the job's own calls fail too, and say so
                log.debug("heartbeat for job %d skipped: %s", job_id, e)
            except Exception as e:  # a database hiccup must not kill the job
                log.warning("heartbeat for job %d failed: %s", job_id, one_line(e))

    def serve(self, poll_seconds: float = 0.25, once: bool = False) -> None:
        """Claim and run jobs until `stop()` (or, with `once`, until no job is queued). An
        unavailable database never ends it (see the module docstring); a job's failure neither."""
        log.info("%s serving (tracker %s:%d)", self.id, *self.tracker)
        backoff = Backoff(max(poll_seconds, 0.25), max(poll_seconds, MAX_POLL_BACKOFF_SECONDS))  # --poll 0 spins
        while not self._stop.is_set():
            metrics.heartbeat()
            try:
                job_id = self._poll()
            except DatabaseUnavailable as e:
                delay = backoff.next()
                log.error("%s; looking for jobs again in %.1f s", e, delay)
                self._stop.wait(delay)
                continue
            backoff.reset()
            if job_id is None:
                if once:
                    return
                self._stop.wait(poll_seconds)
                continue
            log.info("running job %d", job_id)
            try:
                status = self.run_job(job_id)
                log.info("job %d %s", job_id, status)
            except FarmError as e:  # recorded as failed by run_job; the service goes on
                log.error("job %d failed: %s", job_id, e)
            except Exception:
                log.exception("job %d failed", job_id)

    def _poll(self) -> int | None:
        """One look for work: record jobs that ended unrecorded, requeue stale ones, claim one."""
        self._record_unrecorded()
        metrics.set_jobs(self.store.job_counts())
        self.store.requeue_stale(self.stale_seconds)
        return self.store.claim_job(self.id)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop the pools, the tracker and the local Ray instance this scheduler started; a last
        try to record the jobs that ended while the database was unavailable. Called from the
        thread that ran the jobs, Ray stops in a second rather than six (scheduler.cluster.stop_ray)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._started_ray:
            stop_ray()
            self._started_ray = False
        if self._tracker is not None:
            self._tracker.stop()
        try:
            self._record_unrecorded()
        except DatabaseUnavailable:
            for job_id, (status, _) in self._unrecorded.items():
                log.warning("job %d ended %s but the database is unavailable: it stays running there until "
                            "a `farm scheduler` requeues it (or `farm cancel %d`)", job_id, status, job_id)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _warm_nvcc() -> None:
    seconds = warm_nvcc()
    if seconds is not None:
        log.info("CUDA toolchain warmed: an empty kernel compiled in %.1f s", seconds)
