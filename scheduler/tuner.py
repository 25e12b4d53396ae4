"""The tuning loop of one job: shard each task's space over the workers and run rounds.

Every worker's shard proposes batches (its search strategy, never a config already
measured); each worker has one batch running and one queued, the workers build and measure
in parallel, and the results are written to the store in batches. A worker whose shard has
nothing left takes configs from another shard. The loop stops at each task's budget exactly, when the space is
exhausted, or when the job is cancelled. A job's budget is spread over its tasks when the
job is created (farm.core.jobspec.JobRequest).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from db.store import ResultStore
from db.writer import ResultWriter
from farm.core import metrics
from farm.core.errors import one_line
from farm.core.measure import MeasureResult, Status
from farm.core.task import Task
from scheduler.pool import QUEUE_DEPTH, WorkerPool
from scheduler.retrain import retrain, starting_model
from scheduler.shards import ShardSearches

log = logging.getLogger("farm.scheduler")

# Candidates in each worker's first batch of a task. A worker returns a batch's results
# together, so the first trial is recorded after its first batch: a small one (the full batch
# queued behind it) puts a result in the database seconds after the job starts.
FIRST_BATCH = 2

Inflight = dict[cf.Future[list[MeasureResult]], tuple[int, int, list[int]]]  # batch -> (worker, shard, indices)

@dataclass
class Progress:
    """What a progress display needs after each batch."""

    task_number: int
    tasks: int
    task: Task
    done: int
    budget: int
    best_seconds: float | None
    last: list[MeasureResult]


def run_job(
    store: ResultStore,
    job_id: int,
    pool: WorkerPool,
    *,
    search: str = "xgb",
    seed: int = 0,
    batch_size: int = 16,
    on_progress: Callable[[Progress], None] | None = None,
    stall_seconds: float = 300.0,
) -> str:
    """Run every task of the job to its budget on `pool`; returns the final status ("done" or
    "cancelled"). Results are written through one batched writer of `store`."""
    tasks = store.tasks(job_id)
    for row in tasks:
        metrics.set_task_progress(job_id, row["id"], store.trial_count(row["id"]), row["budget"])
    try:
        with store.writer() as writer:
            for number, row in enumerate(tasks):
                task = Task.from_json({"workload": row["workload"], "target": row["target"]})

                def report(done: int, best: float | None, last: list[MeasureResult], number: int = number,
                           task: Task = task, row: dict[str, Any] = row) -> None:
                    metrics.set_task_progress(job_id, row["id"], done, row["budget"])
                    if best is not None:
                        metrics.set_task_best(job_id, row["id"], task.workload.name, best,
                                              task.workload.flops() / best / 1e9)
                    if on_progress is not None:
                        on_progress(Progress(number, len(tasks), task, done, row["budget"], best, last))

                status = _run_task(store, writer, job_id, row, task, pool, search, seed, batch_size,
                                   report, stall_seconds)
                if status == "cancelled":
                    return status
        return "done"
    finally:
        metrics.clear_job(job_id)


def _run_task(store: ResultStore, writer: ResultWriter, job_id: int, row: dict[str, Any], task: Task, pool: WorkerPool,
              search: str, seed: int, batch_size: int,
              report: Callable[[int, float | None, list[MeasureResult]], None],
              stall_seconds: float) -> str:
    """Keep every worker busy with up to QUEUE_DEPTH batches until the budget is spent.

    A round closes each time `pool.size * batch_size` results have arrived: the writer is
    flushed, the shared cost model is retrained on every trial of the task's family and handed
    to every shard's search, and the round is recorded with the previous model's rank
    correlation on the round's results.
    """
    measured = store.measured_indices(row["id"])
    start = time.monotonic()
    searches = pool.searches(search, task, seed, measured)
    log.info("task %s: %d shard searches (%s) ready in %.1f s", row["id"], searches.count, search,
             time.monotonic() - start)
    try:
        return _tune(store, writer, job_id, row, task, pool, searches, batch_size, report, stall_seconds,
                     len(measured))
    finally:
        searches.close()


def _tune(store: ResultStore, writer: ResultWriter, job_id: int, row: dict[str, Any], task: Task, pool: WorkerPool,
          searches: ShardSearches, batch_size: int,
          report: Callable[[int, float | None, list[MeasureResult]], None], stall_seconds: float, done: int) -> str:
    """The loop of `_run_task`, `done` trials into the task's budget."""
    task_id, budget = row["id"], row["budget"]
    best = min((b["latency"] for b in store.best(task_id, 1)), default=None)
    round_ = len(store.rounds(task_id))
    # A task of a template and target kind tuned before starts from the family's model.
    current = starting_model(store, row)
    searches.set_model(current)
    round_results: list[MeasureResult] = []
    report(done, best, [])
    inflight: Inflight = {}
    queued = [0] * pool.size
    started = [False] * pool.size
    exhausted = False
    cancelled = store.job_status(job_id) == "cancelled"
    since_round = 0
    round_started = time.monotonic()
    while True:
        # Fill the queues level by level, so that every worker gets work before any gets two
        # batches, and the last trials of the budget are spread over the workers too. The
        # shards of one level plan their batches in parallel.
        for depth in range(QUEUE_DEPTH):
            left = budget - done - sum(len(i) for _, _, i in inflight.values())
            share = -(-left // pool.size)
            wanted: list[tuple[int, int]] = []
            for worker in range(pool.size):
                n = min(batch_size, share, left)
                if not started[worker]:  # a worker's first batch is small: its first results come soon
                    n, started[worker] = min(n, FIRST_BATCH), True
                if cancelled or exhausted or n <= 0 or queued[worker] > depth:
                    continue
                wanted.append((worker, n))
                left -= n
            for (worker, n), indices in zip(wanted, searches.propose(wanted), strict=True):
                shard = worker
                if not indices:  # work stealing: the first shard with configs left
                    shard, indices = _steal(searches, n)
                if not indices:
                    exhausted = True
                    log.info("task %s: space exhausted after %d trials", task, done)
                    continue
                inflight[pool.submit(worker, task, indices, shard, round_)] = (worker, shard, indices)
                queued[worker] += 1
        _queue_metrics(pool, inflight)
        if not inflight:
            break
        finished, _ = cf.wait(list(inflight), timeout=stall_seconds, return_when=cf.FIRST_COMPLETED)
        if not finished:  # the watchdog: say so and keep waiting (a hang ends as a timeout result)
            log.warning("task %s: no batch finished in %.0f s (%d running)", task, stall_seconds, len(inflight))
            continue
        for future in finished:
            worker, shard, indices = inflight.pop(future)
            queued[worker] -= 1
            results = _results(future, task, indices, shard, round_)
            for r in results:
                writer.add(task_id, r)
            searches.observe(shard, results)
            round_results.extend(results)
            done += len(results)
            since_round += len(results)
            best = _best(best, results)
            report(done, best, results)
        cancelled = cancelled or store.job_status(job_id) == "cancelled"
        if round_results and (since_round >= pool.size * batch_size or not inflight):
            writer.flush()  # the retraining reads every trial of the family from the store
            guided_by = current.model_id if current else None  # the model the round's rank_corr scores
            trained = retrain(store, row, task, current, round_results)
            metrics.observe_retrain(job_id, task_id, trained.training_seconds, trained.rank_corr)
            metrics.observe_round(task.target.kind, time.monotonic() - round_started)
            round_started = time.monotonic()
            current = trained.current
            searches.set_model(current)
            store.add_round(task_id, round_, done, best, trained.rank_corr, guided_by)
            round_, since_round, round_results = round_ + 1, 0, []
    return "cancelled" if cancelled else "done"


def _queue_metrics(pool: WorkerPool, inflight: Inflight) -> None:
    """Per worker: candidates of its oldest unfinished batch (in flight) and of those behind it."""
    batches: dict[int, list[int]] = {w: [] for w in range(pool.size)}
    for worker, _, indices in inflight.values():  # in submission order
        batches[worker].append(len(indices))
    for worker, sizes in batches.items():
        metrics.set_worker_queue(pool.names[worker], sizes[0] if sizes else 0, sum(sizes[1:]))


def _results(future: cf.Future[list[MeasureResult]], task: Task, indices: list[int], shard: int,
             round_: int) -> list[MeasureResult]:
    """The batch's results; a worker that failed as a whole yields a runtime error per config."""
    try:
        return future.result()
    except Exception as e:
        log.warning("a worker failed on a batch of %s: %s", task, one_line(e))
        return [MeasureResult(i, task.space.get(i).to_json(), Status.RUNTIME_ERROR, f"worker failed: {one_line(e)}",
                              shard=shard, round=round_) for i in indices]


def _steal(searches: ShardSearches, n: int) -> tuple[int, list[int]]:
    """(shard, indices) from the first shard with configs left; no indices when all are out."""
    for shard in range(searches.count):
        (indices,) = searches.propose([(shard, n)])
        if indices:
            return shard, indices
    return 0, []


def _best(best: float | None, results: list[MeasureResult]) -> float | None:
    for r in results:
        if r.latency is not None and (best is None or r.latency < best):
            best = r.latency
    return best
