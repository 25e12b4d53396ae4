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
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from db.outage import DatabaseUnavailable
from db.store import ResultStore
from farm.core import metrics
from farm.core.backoff import Backoff
from farm.core.errors import FarmError, one_line
from farm.core.files import writable_folder
from scheduler.cluster import init_ray, stop_ray
from scheduler.pool import PoolFactory, WorkerPool
from scheduler.ray_pool import RayWorkerPool
from scheduler.tuner import Progress, run_job
from workers.compiler import warm_nvcc
from workers.rpc_processes import LocalTracker

log = logging.getLogger("farm.scheduler")

# The longest the service waits between looks for jobs while the database is unavailable.
MAX_POLL_BACKOFF_SECONDS = 30.0
# How long a pool whose job ended stays up for the next job of its shape (the service's default).
KEEP_WARM_SECONDS = 300.0

# A pool's shape: (target kind, device count, RPC keys of devices that run only a TVM server).
Shape = tuple[str, int, tuple[str, ...]]


@dataclass
class _Slot:
    """A worker pool of the scheduler: starting (`pool` None), in a job's use, or idle since `idle_since`."""

    shape: Shape
    name: str  # its workers are NAME-0, NAME-1, ... (their RPC keys and metrics carry it)
    pool: WorkerPool | None = None
    job: int | None = None
    idle_since: float = 0.0

    @property
    def devices(self) -> int:
        """Ray devices it holds: GPUs (logical ones on a CPU cluster); none for RPC-key devices."""
        return 0 if self.shape[2] else self.shape[1]


class _Stopped(Exception):
    """A job stopped (cancelled, interrupted, taken over) while it waited for devices."""


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
        self.pool_factory = pool_factory or self._ray_pool
        self.give_back_on_interrupt = give_back_on_interrupt
        self.id = f"scheduler@{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        # A log folder that cannot be written is the caller's error, before anything starts.
        self.log_dir = writable_folder(log_dir) if log_dir is not None else None
        self.ray_address, self.build_workers = ray_address, build_workers
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self._tracker: LocalTracker | None = None
        self._started_ray = False  # a local Ray instance this scheduler started, stopped by close()
        self._ray_ready = False
        self._ray_lock = threading.Lock()
        if tracker is None:
            # Not waited for: it listens long before the first RPC server registers with it.
            log_file = log_dir / "tracker.log" if log_dir else None
            self._tracker = LocalTracker(log=log_file).start(wait=False)
            tracker = self._tracker.address

        self.tracker = tracker
        self.max_jobs, self.keep_warm_seconds = max_jobs, keep_warm_seconds
        self._slots: list[_Slot] = []
        self._pools_changed = threading.Condition()  # guards _slots; notified when a pool is freed
        self._waiting = 0  # jobs waiting for devices
        self._placing: dict[int, threading.Event] = {}  # set once the job holds or waits for devices
        self._stop = threading.Event()
        self._interrupted = threading.Event()  # the service was stopped: its jobs stop and are given back
        # Jobs that ended while the database was unavailable: job id -> (status, error) to record.
        self._unrecorded: dict[int, tuple[str, str]] = {}
        self._record_lock = threading.Lock()

    @staticmethod
    def shape_of(spec: dict[str, Any]) -> Shape:
        """A job's pool shape: `workers` devices of its target kind, or its `rpc_keys`."""
        keys = tuple(spec.get("rpc_keys") or ())
        return spec["target"]["kind"], len(keys) or int(spec.get("workers") or 1), keys

    def pools(self) -> list[WorkerPool]:
        """The pools up now, in jobs' use or idle."""
        with self._pools_changed:
            return [slot.pool for slot in self._slots if slot.pool is not None]

    def pool_for(self, spec: dict[str, Any]) -> WorkerPool:
        """An idle pool for a job of `spec`'s shape, started now if there is none (`Client.prepare`
        starts the workers of the job it is about to submit): the job finds it up."""
        return self._acquire(None, self.shape_of(spec), lambda: False)

    def _acquire(self, job_id: int | None, shape: Shape, stopped: Callable[[], bool]) -> WorkerPool:
        """A pool of `shape` for job `job_id` (None: a pool left idle for the next job, which
        `pool_for` starts): an idle one of that shape, the one starting for the next job (waited
        for, not started twice), or a new one once the cluster has the devices (idle pools of
        other shapes are closed to free theirs; else it waits for a running job to end).
        _Stopped if `stopped()` meanwhile."""
        waiting = False
        self.start_ray(shape[0])  # outside the lock: seconds
        try:
            with self._pools_changed:
                while True:
                    mine: _Slot | None = None
                    for slot in self._slots:
                        if slot.shape == shape and slot.job is None:
                            if slot.pool is not None:
                                slot.job = job_id
                                self._placed(job_id)
                                return slot.pool
                            mine = slot  # starting for the next job: this one, unless it fails
                    if mine is not None:
                        self._placed(job_id)
                        if stopped():
                            raise _Stopped
                        self._pools_changed.wait(1.0)
                        continue
                    if self._fits(shape):
                        mine = _Slot(shape, self._free_name(shape[0]), job=job_id)
                        self._slots.append(mine)
                        self._placed(job_id)
                        break
                    idle = [slot for slot in self._slots if slot.job is None and slot.pool is not None]
                    if idle:  # an idle pool of another shape gives its devices back
                        victim = min(idle, key=lambda slot: slot.idle_since)
                        self._slots.remove(victim)
                        self._pools_changed.release()
                        try:
                            log.info("closing the idle pool of %d %s worker(s) for a job of another shape",
                                     victim.shape[1], victim.shape[0])
                            victim.pool.close()  # type: ignore[union-attr]
                        finally:
                            self._pools_changed.acquire()
                        continue
                    if not waiting:
                        waiting, self._waiting = True, self._waiting + 1
                        self._placed(job_id)
                        log.info("job %s waits for %d free %s device(s)", job_id, shape[1], shape[0])
                    if stopped():
                        raise _Stopped
                    self._pools_changed.wait(1.0)
            try:
                if self.pool_factory == self._ray_pool:
                    mine.pool = self._ray_pool(shape[0], shape[1], shape[2], name=mine.name)
                else:
                    mine.pool = self.pool_factory(shape[0], shape[1], shape[2])
            except BaseException:
                with self._pools_changed:
                    self._slots.remove(mine)
                    self._pools_changed.notify_all()
                raise
            with self._pools_changed:  # a job waiting for this pool (see above) takes it now
                mine.idle_since = time.monotonic()
                self._pools_changed.notify_all()
            self._publish_targets()
            return mine.pool
        finally:
            if waiting:
                with self._pools_changed:
                    self._waiting -= 1

    def _free_name(self, kind: str) -> str:
        """A worker name prefix no pool up or starting uses (the caller holds the lock): KIND-worker,
        else KIND-worker2, KIND-worker3, ...; two pools at once never share RPC keys or logs."""
        taken = {slot.name for slot in self._slots}
        return next(name for n in range(1, len(taken) + 2)
                    if (name := f"{kind}-worker" + (str(n) if n > 1 else "")) not in taken)

    def _placed(self, job_id: int | None) -> None:
        """Job `job_id` holds its devices or waits for them (see `_start_job`)."""
        placed = self._placing.get(job_id) if job_id is not None else None
        if placed is not None:
            placed.set()

    def _fits(self, shape: Shape) -> bool:
        """Whether a new pool of `shape` can start now beside the pools up or starting (the caller
        holds the lock): its RPC keys held by none, its devices free in the cluster. Without a count
        of the cluster's devices (a `pool_factory`), any other pool is in the way. A job larger than
        the whole cluster starts alone (its workers wait for devices to join)."""
        if shape[2]:
            return not any(set(shape[2]) & set(slot.shape[2]) for slot in self._slots)
        held = sum(slot.devices for slot in self._slots)
        total = self._devices()
        if total is None:
            return held == 0
        return held + shape[1] <= total or held == 0

    def _devices(self) -> int | None:
        """The devices of the cluster the Ray pools use (GPUs; logical ones on a CPU cluster);
        None when a `pool_factory` makes the pools, or before Ray runs (it starts with the first job)."""
        if self.pool_factory != self._ray_pool or not self._ray_ready:
            return None
        import ray

        return int(ray.cluster_resources().get("GPU", 0))

    def _release(self, pool: WorkerPool) -> None:
        """`pool`'s job ended: keep it idle for the next job of its shape."""
        with self._pools_changed:
            for slot in self._slots:
                if slot.pool is pool:
                    slot.job, slot.idle_since = None, time.monotonic()
            self._pools_changed.notify_all()

    def close_idle_pools(self, older_than: float = 0.0) -> int:
        """Close the pools idle for more than `older_than` seconds; how many."""
        now = time.monotonic()
        with self._pools_changed:
            idle = [slot for slot in self._slots
                    if slot.job is None and slot.pool is not None and now - slot.idle_since > older_than]
            for slot in idle:
                self._slots.remove(slot)
        for slot in idle:
            log.info("closing the pool of %d %s worker(s), idle for %.0f s", slot.shape[1], slot.shape[0],
                     now - slot.idle_since)
            slot.pool.close()  # type: ignore[union-attr]
        if idle:
            self._publish_targets()
        return len(idle)

    def start_ray(self, kind: str = "") -> None:
        """Start (or join) Ray once, saying so (`farm tune` shows these steps); nothing when a
        `pool_factory` makes the pools. Call it first from a thread that lives on (the service's
        own, before it runs jobs in threads; an embedded client's home thread): a Ray driver
        started in a thread that then ends loses its cluster."""
        if self.pool_factory != self._ray_pool:
            return
        with self._ray_lock:
            if not self._ray_ready:
                self._init_ray(kind)

    def _init_ray(self, kind: str) -> None:
        start = time.monotonic()
        if kind == "cuda" and self.ray_address is None:
            # This machine builds the kernels: its CUDA toolchain comes off disk while Ray starts.
            threading.Thread(target=_warm_nvcc, daemon=True, name="farm-nvcc-warm").start()
        log.info("starting Ray")
        self._started_ray = init_ray(self.ray_address) or self._started_ray
        self._ray_ready = True
        log.info("Ray ready in %.1f s", time.monotonic() - start)

    def _ray_pool(self, kind: str, count: int, keys: Sequence[str], name: str = "") -> WorkerPool:
        start = time.monotonic()
        self.start_ray(kind)
        log.info("starting %d %s worker actor(s): build processes, RPC servers", count, kind)
        pool = RayWorkerPool(self.tracker, kind, count, list(keys) or None, self.build_workers,
                             str(self.log_dir) if self.log_dir else None, name=name or f"{kind}-worker")
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
        targets = [{"targets": [i["metrics_address"] for pool in self.pools()
                                for i in getattr(pool, "infos", [])], "labels": {"role": "worker"}}]
        path = Path(folder) / f"workers-{os.getpid()}.json"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")  # job threads publish too
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
        that fails the job is raised once recorded (or kept to record, see `_record`). Safe to
        call from several threads at once (the service runs each job in one)."""
        job = self.store.job(job_id)
        spec = job["spec"]
        done = threading.Event()
        lost = threading.Event()  # the job is no longer this scheduler's
        beat = threading.Thread(target=self._heartbeat, args=(job_id, done, lost), daemon=True,
                                name="farm-heartbeat")
        status, error = "failed", ""
        pool: WorkerPool | None = None

        def stopped() -> bool:
            return lost.is_set() or self._interrupted.is_set()

        beat.start()
        try:
            try:
                pool = self._acquire(job_id, self.shape_of(spec),
                                     lambda: stopped() or self.store.job_status(job_id) == "cancelled")
            except _Stopped:
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
                self._release(pool)
            self._record(job_id, status, error)
        return status

    def _record(self, job_id: int, status: str, error: str) -> None:
        """Record how a job of this scheduler ended: finished, or queued again (given back). If the
        database is unavailable past the outage bound, keep it for `_record_unrecorded`."""
        with self._record_lock:
            self._unrecorded[job_id] = (status, error)
        try:
            self._record_unrecorded()
        except DatabaseUnavailable:
            log.info("job %d ended %s; it is recorded once the database is back", job_id, status)

    def _record_unrecorded(self) -> None:
        """Record the ends of jobs kept by `_record`; DatabaseUnavailable if it is still unavailable
        (the job kept), any other error as it comes (the job dropped: retrying would not help)."""
        with self._record_lock:  # job threads and the service's own
            self._record_unrecorded_locked()

    def _record_unrecorded_locked(self) -> None:
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
                if self._waiting or len(running) >= self._max_jobs():
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
            self._placing[job_id] = placed
            try:
                status = self.run_job(job_id)
                log.info("job %d %s", job_id, status)
            except FarmError as e:  # recorded as failed by run_job; the service goes on
                log.error("job %d failed: %s", job_id, e)
            except Exception:
                log.exception("job %d failed", job_id)
            finally:
                placed.set()
                self._placing.pop(job_id, None)

        thread = threading.Thread(target=job, daemon=True, name=f"farm-job-{job_id}")
        thread.start()
        placed.wait(60)
        return thread

    def _poll(self) -> int | None:
        """One look for work: record jobs that ended unrecorded, requeue stale ones, claim one."""
        self._record_unrecorded()
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
        with self._pools_changed:
            slots, self._slots = self._slots, []
        for slot in slots:
            if slot.pool is not None:
                slot.pool.close()
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
