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
A scheduler runs several jobs at once, each in a thread of its own with a worker pool of its own
(scheduler.pool: Ray worker actors by default, or whatever a `pool_factory` makes, such as the
in-process scheduler.local_pool), as long as the cluster has devices for them: a job whose pool
would need more devices than are free waits for a running job to end, and the service claims
no further job meanwhile (first come, first served). A pool whose job ended is kept, idle and
warm (actors, RPC servers, sessions, build processes), for the next job of its shape; it is
closed when a job of another shape needs its devices, or after `keep_warm_seconds` unused.

`Scheduler` composes the parts, each in a module of its own: the pools' placement on the devices
(scheduler.placement), Ray's start (scheduler.ray_start), Prometheus's targets
(scheduler.prometheus_targets), a job's heartbeat (scheduler.heartbeat) and the recording of how
jobs ended (scheduler.recording); the claiming of jobs and the serve loop are its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from db.outage import DatabaseUnavailable
from db.store import ResultStore
from farm.core import metrics
from farm.core.backoff import Backoff
from farm.core.errors import FarmError, one_line
from farm.core.files import writable_folder
from scheduler.heartbeat import heartbeat
from scheduler.placement import Placement, Shape, Stopped
from scheduler.pool import PoolFactory, WorkerPool
from scheduler.prometheus_targets import publish_targets
from scheduler.ray_start import RayStart
from scheduler.recording import JobEnds
from scheduler.tuner import Progress, run_job
from workers.rpc_processes import LocalTracker

log = logging.getLogger("farm.scheduler")

# The longest the service waits between looks for jobs while the database is unavailable.
MAX_POLL_BACKOFF_SECONDS = 30.0
# How long a pool whose job ended stays up for the next job of its shape (the service's default).
KEEP_WARM_SECONDS = 300.0


class Scheduler:
    """Runs jobs of `store` on worker pools.

    `tracker` is the farm's RPC tracker (host, port); None starts one on this machine.
    `ray_address` is a Ray cluster to join; None starts Ray on this machine. `pool_factory`
    makes the pools instead of Ray (then `ray_address` is not used). A job interrupted
    (KeyboardInterrupt: Ctrl-C, or SIGTERM in `farm scheduler`) is cancelled, or with
    `give_back_on_interrupt` (the service) queued again with its trials kept. `max_jobs` bounds
    the jobs run at once (default: the cluster's devices with Ray pools, one with a `pool_factory`,
    whose devices the scheduler cannot count); `keep_warm_seconds` is how long an idle pool stays up.
    """

    def __init__(self, store: ResultStore, tracker: tuple[str, int] | None = None, ray_address: str | None = None,
                 build_workers: int | None = None, log_dir: Path | None = None,
                 heartbeat_seconds: float = 5.0, stale_seconds: float = 60.0,
                 pool_factory: PoolFactory | None = None, give_back_on_interrupt: bool = False,
                 max_jobs: int | None = None, keep_warm_seconds: float = KEEP_WARM_SECONDS) -> None:
        self.store = store
        self.give_back_on_interrupt = give_back_on_interrupt
        self.id = f"scheduler@{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        # A log folder that cannot be written is the caller's error, before anything starts.
        self.log_dir = writable_folder(log_dir) if log_dir is not None else None
        self.ray_address, self.build_workers = ray_address, build_workers
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self._tracker: LocalTracker | None = None
        if tracker is None:
            # Not waited for: it listens long before the first RPC server registers with it.
            log_file = log_dir / "tracker.log" if log_dir else None
            self._tracker = LocalTracker(log=log_file).start(wait=False)
            tracker = self._tracker.address

        self.tracker = tracker
        self._ray = RayStart(ray_address, tracker, build_workers, self.log_dir)
        self.pool_factory = pool_factory or self._ray.pool
        self.max_jobs, self.keep_warm_seconds = max_jobs, keep_warm_seconds
        self._placement = Placement(self._new_pool, self._devices, publish_targets)
        self._stop = threading.Event()
        self._interrupted = threading.Event()  # the service was stopped: its jobs stop and are given back
        self._ends = JobEnds(store, self.id)

    @staticmethod
    def shape_of(spec: dict[str, Any]) -> Shape:
        """A job's pool shape: `workers` devices of its target kind, or its `rpc_keys`."""
        keys = tuple(spec.get("rpc_keys") or ())
        return spec["target"]["kind"], len(keys) or int(spec.get("workers") or 1), keys

    def pools(self) -> list[WorkerPool]:
        """The pools up now, in jobs' use or idle."""
        return self._placement.pools()

    def pool_for(self, spec: dict[str, Any]) -> WorkerPool:
        """An idle pool for a job of `spec`'s shape, started now if there is none (`Client.prepare`
        starts the workers of the job it is about to submit): the job finds it up."""
        return self._acquire(None, self.shape_of(spec), lambda: False)

    def _acquire(self, job_id: int | None, shape: Shape, stopped: Callable[[], bool]) -> WorkerPool:
        """`Placement.acquire`, Ray started first (outside the placement's lock: seconds)."""
        self.start_ray(shape[0])
        return self._placement.acquire(job_id, shape, stopped)

    def _devices(self) -> int | None:
        """The devices of the cluster the Ray pools use (GPUs; logical ones on a CPU cluster);
        None when a `pool_factory` makes the pools, or before Ray runs (it starts with the first job)."""
        if self.pool_factory != self._ray.pool:
            return None
        return self._ray.devices()

    def close_idle_pools(self, older_than: float = 0.0) -> int:
        """Close the pools idle for more than `older_than` seconds; how many."""
        return self._placement.close_idle(older_than)

    def start_ray(self, kind: str = "") -> None:
        """Start (or join) Ray once, saying so (`farm tune` shows these steps); nothing when a
        `pool_factory` makes the pools. Call it first from a thread that lives on (the service's
        own, before it runs jobs in threads; an embedded client's home thread): a Ray driver
        started in a thread that then ends loses its cluster."""
        if self.pool_factory != self._ray.pool:
            return
        self._ray.start(kind)

    def _new_pool(self, shape: Shape, name: str) -> WorkerPool:
        """A pool of `shape` whose workers are NAME-0, NAME-1, ... (Ray pools; a `pool_factory` names its own)."""
        if self.pool_factory == self._ray.pool:
            return self._ray.pool(shape[0], shape[1], shape[2], name=name)
        return self.pool_factory(shape[0], shape[1], shape[2])

    def claim_and_run(self, job_id: int, on_progress: Callable[[Progress], None] | None = None) -> str:
        """Claim job `job_id` for this scheduler and run it; its final status (the job's status
        as it stands when another scheduler has it or it was cancelled before it started)."""
        if self.store.claim_job(self.id, job_id=job_id) is None:
            return self.store.job_status(job_id)
        return self.run_job(job_id, on_progress)

    def run_job(self, job_id: int, on_progress: Callable[[Progress], None] | None = None) -> str:
        """Run a job this scheduler has claimed; record and return its final status. An error
        that fails the job is raised once recorded (or kept to record, see `JobEnds.record`). Safe to
        call from several threads at once (the service runs each job in one)."""
        job = self.store.job(job_id)
        spec = job["spec"]
        done = threading.Event()
        lost = threading.Event()  # the job is no longer this scheduler's
        beat = threading.Thread(target=heartbeat, daemon=True, name="farm-heartbeat",
                                args=(self.store, self.id, job_id, self.heartbeat_seconds, done, lost))
        status, error = "failed", ""
        pool: WorkerPool | None = None

        def stopped() -> bool:
            return lost.is_set() or self._interrupted.is_set()

        beat.start()
        try:
            try:
                pool = self._acquire(job_id, self.shape_of(spec),
                                     lambda: stopped() or self.store.job_status(job_id) == "cancelled")
            except Stopped:
                status = "cancelled"
            else:
                status = run_job(self.store, job_id, pool, search=spec.get("search", "xgb"),
                                 seed=int(spec.get("seed", 0)), batch_size=int(spec.get("batch_size", 16)),
                                 on_progress=on_progress, should_stop=stopped)
            if status == "cancelled" and self._interrupted.is_set():  # the service was stopped
                status, error = ("queued", "") if self.give_back_on_interrupt else ("cancelled", "interrupted")
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM (Ray's driver handler exits)
            status, error = ("queued", "") if self.give_back_on_interrupt else ("cancelled", "interrupted")
            raise
        except Exception as e:
            error = one_line(e)
            raise
        finally:
            done.set()
            if pool is not None:
                self._placement.release(pool)
            self._ends.record(job_id, status, error)
        return status

    def serve(self, poll_seconds: float = 0.25, once: bool = False) -> None:
        """Claim and run jobs, each in a thread of its own, until `stop()` (or, with `once`, until
        no job is queued or running). A job is claimed only while fewer than `max_jobs` run and no
        job waits for devices. An unavailable database never ends it (see the module docstring);
        a job's failure neither. Interrupted (KeyboardInterrupt, SystemExit) or stopped, it stops
        its jobs (the chunks in flight finish) and records them (`give_back_on_interrupt`: queued
        again) before it returns or re-raises."""
        log.info("%s serving (tracker %s:%d)", self.id, *self.tracker)
        backoff = Backoff(max(poll_seconds, 0.25), max(poll_seconds, MAX_POLL_BACKOFF_SECONDS))  # --poll 0 spins
        running: dict[int, threading.Thread] = {}
        try:
            while not self._stop.is_set():
                metrics.heartbeat()
                for job_id, thread in list(running.items()):
                    if not thread.is_alive():
                        del running[job_id]
                self.close_idle_pools(self.keep_warm_seconds)
                if self._placement.waiting or len(running) >= self._max_jobs():
                    self._stop.wait(poll_seconds)
                    continue
                try:
                    job_id = self._poll()
                except DatabaseUnavailable as e:
                    delay = backoff.next()
                    log.error("%s; looking for jobs again in %.1f s", e, delay)
                    self._stop.wait(delay)
                    continue
                backoff.reset()
                if job_id is None:
                    if once and not running:
                        return
                    self._stop.wait(poll_seconds)
                    continue
                log.info("running job %d", job_id)
                running[job_id] = self._start_job(job_id)
        finally:
            # Stopped, interrupted or failed: the jobs stop within a candidate and are recorded.
            if running:
                self.interrupt()
                for thread in running.values():
                    thread.join(120)
                self._interrupted.clear()

    def _max_jobs(self) -> int:
        return self.max_jobs or self._devices() or 1

    def _start_job(self, job_id: int) -> threading.Thread:
        """Run job `job_id` in a thread of its own; returns once the job holds its pool's devices
        or waits for them, so that jobs get devices in the order they were claimed."""
        self.start_ray(self.store.job(job_id)["spec"]["target"]["kind"])
        placed = threading.Event()

        def job() -> None:
            self._placement.placing[job_id] = placed
            try:
                status = self.run_job(job_id)
                log.info("job %d %s", job_id, status)
            except FarmError as e:  # recorded as failed by run_job; the service goes on
                log.error("job %d failed: %s", job_id, e)
            except Exception:
                log.exception("job %d failed", job_id)
            finally:
                placed.set()
                self._placement.placing.pop(job_id, None)

        thread = threading.Thread(target=job, daemon=True, name=f"farm-job-{job_id}")
        thread.start()
        placed.wait(60)
        return thread

    def _poll(self) -> int | None:
        """One look for work: record jobs that ended unrecorded, requeue stale ones, claim one."""
        self._ends.record_unrecorded()
        metrics.set_jobs(self.store.job_counts())
        self.store.requeue_stale(self.stale_seconds)
        return self.store.claim_job(self.id)

    def stop(self) -> None:
        """End `serve`: its running jobs stop within a candidate and are recorded (see `serve`)."""
        self._stop.set()

    def interrupt(self) -> None:
        """Stop every job this scheduler runs, and any it starts from now on: each stops within a
        candidate (scheduler.tuner) and is recorded, queued again with `give_back_on_interrupt`,
        else cancelled ("interrupted")."""
        self._interrupted.set()

    def close(self) -> None:
        """Stop the pools, the tracker and the local Ray instance this scheduler started; a last
        try to record the jobs that ended while the database was unavailable. Called from the
        thread that ran the jobs, Ray stops in a second rather than six (scheduler.cluster.stop_ray)."""
        self._placement.close()
        self._ray.stop()
        if self._tracker is not None:
            self._tracker.stop()
        try:
            self._ends.record_unrecorded()
        except DatabaseUnavailable:
            for job_id, (status, _) in self._ends.unrecorded.items():
                log.warning("job %d ended %s but the database is unavailable: it stays running there until "
                            "a `farm scheduler` requeues it (or `farm cancel %d`)", job_id, status, job_id)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
