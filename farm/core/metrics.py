"""The farm's Prometheus metrics, and the helpers that the scheduler, workers and writer call.

Every process serves its own metrics over HTTP (`serve`): the scheduler on
`FARM_SCHEDULER_METRICS_PORT` (default 9100, `scheduler_port`), each worker actor on
`FARM_WORKER_METRICS_PORT` (default 9101) plus its local GPU ordinal (`worker_port`), so
several actors of one node never collide. Prometheus scrapes them directly; Ray's own
metrics (`ray start --metrics-export-port 8080`) are scraped beside them. The farm does not
use Ray's custom-metrics API: Ray would rename its series (a `ray_` prefix, its own
labels) and tie every dashboard to Ray's exporter and its version.

Conventions (shared/DESIGN.md): prefix `farm_`, base units (`_seconds`, FLOP/s), `_total` on
counters, no unbounded label values. Label bounds:

- `status`: the six trial statuses of farm.core.measure.Status; `target`: the target kind
  (`llvm`, `cuda`, ...); `state`: the five job states; `reason`: `RESTART_REASONS`.
- `worker`: a worker actor's name (`<kind>-worker-<i>`, `<kind>-worker2-<i>` for a second pool up
  at once), bounded by the pools' sizes;
  `device`: that worker's RPC key, one per worker.
- `job_id`, `task_id`, `workload`: only on per-task series of jobs that are running on this
  scheduler (at most `max_jobs` at once, a job has a fixed set of tasks); the
  scheduler calls `clear_job` when a job ends, which removes every series of that job
  JOB_SERIES_LINGER_SECONDS later.
  (`job_id`, not `job`: Prometheus attaches its own `job` label, the scrape job, and would
  rename ours to `exported_job`.)

Every helper is O(1) (a dict lookup and an atomic add or set per series) except `clear_job`,
which is linear in the series of the one job that ended. Process-wide: the helpers write to
prometheus_client's default registry, which `serve` exposes together with the client's
process and Python collectors.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

SCHEDULER_PORT = 9100
WORKER_PORT = 9101
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
# Why an RPC session was opened again: it reached its age limit, a candidate's error may have
# killed it, or a candidate hung and the session was dropped with it.
RESTART_REASONS = ("expired", "error", "timeout")

# Bucket bounds in seconds, from the fastest to the slowest step worth telling apart: an
# llvm kernel on a test machine compiles in ~0.3 s, a cuda one through nvcc in 1-10 s, and
# the build timeout is 60 s; uploads and checks take milliseconds; a timed evaluation lasts
# `min_repeat_ms` x `repeat` (30 ms to 150 ms), far longer for slow kernels, up to the
# candidate's 10 s limit.
_BUILD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
# A round lasts `workers x batch_size` trials (16 to a few hundred): seconds to an hour.
_ROUND_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# Retraining: about 1 s per 10,000 trials on 2 cores, at most 20,000 trials (scheduler.retrain).
_RETRAIN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One batched INSERT of up to 256 trials: milliseconds, seconds when the database struggles.
_DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# --- set by each worker actor, about its own device ---------------------------------------

TRIALS = Counter(
    "farm_trials", "Candidates measured (one per trial result), by status and target kind. Worker.",
    ["status", "target"])
BUILD_SECONDS = Histogram(
    "farm_build_seconds", "Compiling one candidate in the build pool (BuildResult.build_seconds). Worker.",
    ["target"], buckets=_BUILD_BUCKETS)
UPLOAD_SECONDS = Histogram(
    "farm_upload_seconds", "Uploading one built candidate to its device and loading it (runner phases "
    "upload and load). Worker.", ["target"], buckets=_FAST_BUCKETS)
RUN_SECONDS = Histogram(
    "farm_run_seconds", "Timed kernel runs of one candidate (runner phases probe and evaluate). Worker.",
    ["target"], buckets=_RUN_BUCKETS)
DEVICE_BUSY = Counter(
    "farm_device_busy_seconds", "Seconds the worker's device spent inside timed kernel runs; its rate is "
    "the device's busy share, as bench/e2e_throughput.py and farm status define it. Worker.", ["worker"])
CHECK_SECONDS = Histogram(
    "farm_check_seconds", "Running one candidate once and comparing its output with the reference "
    "(runner phase check). Worker.", ["target"], buckets=_FAST_BUCKETS)
WORKER_UP = Gauge(
    "farm_worker_up", "1 while the worker's device is registered and measuring, 0 once it closed or "
    "failed. Worker.", ["worker", "device"])
RPC_RESTARTS = Counter(
    "farm_rpc_session_restarts", "RPC sessions opened again after the first, by reason (RESTART_REASONS). "
    "Worker.", ["worker", "reason"])
BUILD_BACKLOG = Gauge(
    "farm_build_backlog", "Candidates handed to the worker's build pool and not yet built. Worker.",
    ["worker"])

# --- set by the scheduler -----------------------------------------------------------------

CANDIDATES_IN_FLIGHT = Gauge(
    "farm_candidates_in_flight", "Candidates of the batch a worker is processing (its oldest unfinished "
    "batch). Scheduler.", ["worker"])
CANDIDATES_QUEUED = Gauge(
    "farm_candidates_queued", "Candidates of the batches submitted to a worker behind the one it is "
    "processing. Scheduler.", ["worker"])
JOBS = Gauge(
    "farm_jobs", "Jobs in the database by state, as the scheduler last counted them (several schedulers "
    "on one database each report the same counts: aggregate with max). Scheduler.", ["state"])
TASK_BEST_LATENCY = Gauge(
    "farm_task_best_latency_seconds", "Best correct latency measured so far for a task of a running job. "
    "Scheduler.", ["job_id", "task_id", "workload"])
TASK_BEST_FLOPS = Gauge(
    "farm_task_best_flops", "Throughput of the task's best kernel so far, in FLOP/s (Grafana unit "
    "`flops`). Scheduler.", ["job_id", "task_id", "workload"])
TASK_TRIALS = Gauge(
    "farm_task_trials_done", "Trials of a running job's task measured so far (resumed trials included). "
    "Scheduler.", ["job_id", "task_id"])
TASK_BUDGET = Gauge(
    "farm_task_trial_budget", "Trial budget of a running job's task. Scheduler.", ["job_id", "task_id"])
MODEL_LATENCY = Gauge(
    "farm_model_latency_seconds", "A running model job's estimated model latency: the sum over its kernels "
    "of calls per inference x best latency so far (set once every kernel has a correct trial). Scheduler.",
    ["job_id"])
RANK_CORRELATION = Gauge(
    "farm_costmodel_rank_correlation", "Spearman rank correlation, on the round just closed, of the cost "
    "model that guided it (latest round of a running job's task). Scheduler.", ["job_id", "task_id"])
ROUND_SECONDS = Histogram(
    "farm_round_duration_seconds", "Wall time of one tuning round, from its first batch to its close "
    "(retraining included). Scheduler.", ["target"], buckets=_ROUND_BUCKETS)
RETRAIN_SECONDS = Histogram(
    "farm_costmodel_retrain_seconds", "Retraining the shared cost model at a round close "
    "(scheduler.retrain). Scheduler.", buckets=_RETRAIN_BUCKETS)
HEARTBEAT = Gauge(
    "farm_scheduler_heartbeat_timestamp_seconds", "Unix time of the scheduler's last heartbeat; its age "
    "is time() minus this. Scheduler.")

# --- set wherever results are written (the scheduler's ResultWriter) ------------------------

DB_WRITE_SECONDS = Histogram(
    "farm_db_write_seconds", "One batched write of trial results (one transaction), failed ones "
    "included. ResultWriter.", buckets=_DB_BUCKETS)
DB_WRITE_FAILURES = Counter(
    "farm_db_write_failures", "Batched writes of trial results that raised (their rows are retried). "
    "ResultWriter.")

_PER_JOB = (TASK_BEST_LATENCY, TASK_BEST_FLOPS, TASK_TRIALS, TASK_BUDGET, RANK_CORRELATION, MODEL_LATENCY)
# How long a job's series outlive it: two scrapes at the deployment's 15 s interval, so that its
# last figures reach Prometheus (a short model job's estimated latency is first known at its last
# slice, moments before it ends).
JOB_SERIES_LINGER_SECONDS = 30.0
_LINGERING: dict[str, threading.Timer] = {}  # job id -> its series' pending removal
_LINGER_LOCK = threading.Lock()


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve this process's metrics at http://host:port/metrics in a daemon thread; the bound port.

    `port` 0 binds a free port. Call once per process. Loopback by default: on a cluster node
    the caller passes the address Prometheus reaches (0.0.0.0 inside a container).
    """
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)


def scheduler_port() -> int:
    """The scheduler's metrics port: `FARM_SCHEDULER_METRICS_PORT`, default 9100."""
    return int(os.environ.get("FARM_SCHEDULER_METRICS_PORT", SCHEDULER_PORT))


def worker_port(local_gpu: int = 0) -> int:
    """A worker actor's metrics port: `FARM_WORKER_METRICS_PORT` (default 9101) + its GPU ordinal on
    its node, so that the actors of one node serve on 9101, 9102, ... and never collide."""
    return int(os.environ.get("FARM_WORKER_METRICS_PORT", WORKER_PORT)) + local_gpu


def observe_trial(worker: str, status: str, target: str, build_s: float, upload_s: float | None = None,
                  run_s: float | None = None, check_s: float | None = None) -> None:
    """Count one trial and observe its step durations in seconds (a step it never reached: None).

    Worker `worker`, once per MeasureResult: `status` its status value, `target` the task's target
    kind; `run_s` (its timed runs) also adds to the worker's busy seconds. A candidate rejected
    before compiling still counts its (short) build step.
    """
    TRIALS.labels(status, target).inc()
    BUILD_SECONDS.labels(target).observe(build_s)
    for histogram, seconds in ((UPLOAD_SECONDS, upload_s), (RUN_SECONDS, run_s), (CHECK_SECONDS, check_s)):
        if seconds is not None:
            histogram.labels(target).observe(seconds)
    if run_s is not None:
        DEVICE_BUSY.labels(worker).inc(run_s)


def start_worker(worker: str, device: str, target: str) -> None:
    """Worker, once its device is registered: up, and every series it may count started at zero
    (each trial status for its target, each session-restart reason, its backlog), so that a
    rate or a ratio over them reads 0 until something happens, not "no data"."""
    from farm.core.measure import Status

    set_worker_up(worker, device, True)
    for status in Status:
        TRIALS.labels(status.value, target)
    for reason in RESTART_REASONS:
        RPC_RESTARTS.labels(worker, reason)
    BUILD_BACKLOG.labels(worker)
    DEVICE_BUSY.labels(worker)


def set_worker_up(worker: str, device: str, up: bool) -> None:
    """Worker: True once its RPC server is registered, False when it closes or its device fails."""
    WORKER_UP.labels(worker, device).set(1 if up else 0)


def rpc_session_restart(worker: str, reason: str) -> None:
    """Worker: an RPC session was opened again after the first; `reason` one of RESTART_REASONS."""
    if reason not in RESTART_REASONS:
        raise ValueError(f"reason must be one of {RESTART_REASONS}, got {reason!r}")
    RPC_RESTARTS.labels(worker, reason).inc()


def add_build_backlog(worker: str, candidates: int) -> None:
    """Worker: `candidates` handed to the build pool (positive) or built (negative)."""
    BUILD_BACKLOG.labels(worker).inc(candidates)


def set_worker_queue(worker: str, in_flight: int, queued: int) -> None:
    """Scheduler, after each submit and each finished batch: candidates of the worker's oldest
    unfinished batch (`in_flight`) and of the batches behind it (`queued`)."""
    CANDIDATES_IN_FLIGHT.labels(worker).set(in_flight)
    CANDIDATES_QUEUED.labels(worker).set(queued)


def set_jobs(counts: Mapping[str, int]) -> None:
    """Scheduler: jobs per state in the database; a state absent from `counts` is set to 0."""
    unknown = set(counts) - set(JOB_STATES)
    if unknown:
        raise ValueError(f"unknown job states {sorted(unknown)}; expected {JOB_STATES}")
    for state in JOB_STATES:
        JOBS.labels(state).set(counts.get(state, 0))


def set_task_best(job_id: int, task_id: int, workload: str, latency_s: float, gflops: float) -> None:
    """Scheduler, when a running job's task finds a faster kernel: its latency and GFLOPS.

    `workload` is a short fixed name of the task's workload (one per task, so it adds no series).
    Stored in base units: the throughput series is in FLOP/s.
    """
    _running(str(job_id))
    TASK_BEST_LATENCY.labels(str(job_id), str(task_id), workload).set(latency_s)
    TASK_BEST_FLOPS.labels(str(job_id), str(task_id), workload).set(gflops * 1e9)


def set_task_progress(job_id: int, task_id: int, done: int, budget: int) -> None:
    """Scheduler: trials of a running job's task measured so far and its budget (every task of the
    job when it starts, then the running task after each batch)."""
    _running(str(job_id))
    TASK_TRIALS.labels(str(job_id), str(task_id)).set(done)
    TASK_BUDGET.labels(str(job_id), str(task_id)).set(budget)


def set_model_latency(job_id: int, latency_s: float) -> None:
    """Scheduler, after each slice of a model job: its estimated latency (farm.core.allocation.model_latency)."""
    _running(str(job_id))
    MODEL_LATENCY.labels(str(job_id)).set(latency_s)


def observe_round(target: str, seconds: float) -> None:
    """Scheduler, at each round close: the round's wall time."""
    ROUND_SECONDS.labels(target).observe(seconds)


def observe_retrain(job_id: int, task_id: int, seconds: float, rank_corr: float | None) -> None:
    """Scheduler, after `retrain` at a round close: its seconds, and the rank correlation of the
    model that guided the round (None: no trained model guided it, the gauge keeps its value)."""
    RETRAIN_SECONDS.observe(seconds)
    if rank_corr is not None:
        _running(str(job_id))
        RANK_CORRELATION.labels(str(job_id), str(task_id)).set(rank_corr)


def clear_job(job_id: int, after: float = JOB_SERIES_LINGER_SECONDS) -> None:
    """Scheduler, when a job ends (done, failed or cancelled): remove every series of the job
    `after` seconds from now (in a daemon timer; 0: at once), unless the job runs again meanwhile
    (a job given back and claimed again: any helper that sets one of its series keeps them)."""
    key = str(job_id)
    if after <= 0:
        _remove_job(key, None)
        return
    timer = threading.Timer(after, lambda: _remove_job(key, timer))
    timer.daemon = True
    with _LINGER_LOCK:
        _LINGERING[key] = timer
    timer.start()


def _running(key: str) -> None:
    """Job `key` has a series set: a removal pending for it is called off."""
    if _LINGERING:  # empty but for the seconds after a job's end
        with _LINGER_LOCK:
            if (timer := _LINGERING.pop(key, None)) is not None:
                timer.cancel()


def _remove_job(key: str, timer: threading.Timer | None) -> None:
    """Remove job `key`'s series: at once (`timer` None), or as `timer`'s removal if it is still
    the one pending for the job (not called off by `_running`, nor replaced by a later end)."""
    with _LINGER_LOCK:
        if timer is not None and _LINGERING.get(key) is not timer:
            return
        _LINGERING.pop(key, None)
        for gauge in _PER_JOB:
            gauge.remove_by_labels({"job_id": key})


def heartbeat() -> None:
    """Scheduler: it is alive (its serve loop at each poll, its heartbeat thread at each beat)."""
    HEARTBEAT.set(time.time())


@contextmanager
def db_write() -> Iterator[None]:
    """Time one batched write of trial results; a write that raises is counted as failed and
    re-raised. ResultWriter, around each flush's transaction."""
    start = time.perf_counter()
    try:
        yield
    except Exception:
        DB_WRITE_FAILURES.inc()
        raise
    finally:
        DB_WRITE_SECONDS.observe(time.perf_counter() - start)
