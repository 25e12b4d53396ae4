"""The tuning loop of one job: shard each task's space over the workers and run rounds.

Per round, every worker's shard proposes a batch (its search strategy, never a config
already measured), the workers build and measure their batches in parallel, and the results
are written to the store in batches. A worker whose shard has nothing left takes configs
from another shard. The loop stops at each task's budget exactly, when the space is
exhausted, or when the job is cancelled. A job's budget is spread over its tasks when the
job is created (`split_budget`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from farm.measure import MeasureResult
from farm.search import SearchStrategy, make_search
from farm.task import Task

log = logging.getLogger("farm.scheduler")


class WorkerPool(Protocol):
    """Where batches run: in-process workers (embedded `farm tune`) or Ray actors."""

    @property
    def size(self) -> int: ...

    def submit(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]: ...


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


def split_budget(total: int, parts: int) -> list[int]:
    """`total` trials over `parts` tasks, as evenly as possible, summing exactly to `total`."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def run_job(
    store: Any,
    job_id: int,
    pool: WorkerPool,
    *,
    search: str = "random",
    seed: int = 0,
    batch_size: int = 16,
    on_progress: Callable[[Progress], None] | None = None,
    stall_seconds: float = 300.0,
) -> str:
    """Run every task of the job to its budget; returns the final status ("done" or "cancelled").

    `store` is a db.store.ResultStore. Results are written through one batched writer.
    """
    tasks = store.tasks(job_id)
    with store.writer() as writer:
        for number, row in enumerate(tasks):
            task = Task.from_json({"workload": row["workload"], "target": row["target"]})

            def report(done: int, best: float | None, last: list[MeasureResult],
                       number: int = number, task: Task = task, budget: int = row["budget"]) -> None:
                if on_progress is not None:
                    on_progress(Progress(number, len(tasks), task, done, budget, best, last))

            status = _run_task(store, writer, job_id, row, task, pool, search, seed, batch_size,
                               report, stall_seconds)
            if status == "cancelled":
                return status
    return "done"


def _run_task(store: Any, writer: Any, job_id: int, row: dict[str, Any], task: Task, pool: WorkerPool,
              search: str, seed: int, batch_size: int,
              report: Callable[[int, float | None, list[MeasureResult]], None],
              stall_seconds: float) -> str:
    task_id, budget = row["id"], row["budget"]
    shards = task.space.shards(pool.size)
    strategies: list[SearchStrategy] = [make_search(search, task, s, seed) for s in shards]
    measured = store.measured_indices(task_id)
    for strategy in strategies:
        strategy.mark_measured(measured)
    done = len(measured)
    best = min((b["latency"] for b in store.best(task_id, 1)), default=None)
    round_ = len(store.rounds(task_id))
    report(done, best, [])
    while done < budget:
        if store.job_status(job_id) == "cancelled":
            return "cancelled"
        sizes = split_budget(min(budget - done, pool.size * batch_size), pool.size)
        batches = _propose(strategies, sizes)
        if not any(batches):
            log.info("task %s: space exhausted after %d trials", task, done)
            break
        futures = {pool.submit(w, task, idx, shard, round_): (w, shard)
                   for w, (shard, idx) in enumerate(batches) if idx}
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=stall_seconds, return_when=cf.FIRST_COMPLETED)
            if not finished:  # the watchdog: say so, keep waiting (a hang becomes a timeout result)
                log.warning("round %d of %s: no batch finished in %.0f s (%d still running)",
                            round_, task, stall_seconds, len(pending))
            for future in finished:
                results = future.result()
                _, shard = futures[future]
                for r in results:
                    writer.add(task_id, r)
                strategies[shard].observe(results)
                done += len(results)
                best = _best(best, results)
                report(done, best, results)
        writer.flush()
        store.add_round(task_id, round_, done, best)
        round_ += 1
    return "done"


def _propose(strategies: list[SearchStrategy], sizes: list[int]) -> list[tuple[int, list[int]]]:
    """Per worker: (shard, indices). A worker whose shard ran dry proposes from another."""
    out = []
    for worker, n in enumerate(sizes):
        shard, indices = worker, strategies[worker].propose(n) if n else []
        if n and not indices:  # work stealing: the first shard that still has configs
            for other, strategy in enumerate(strategies):
                indices = strategy.propose(n)
                if indices:
                    shard = other
                    break
        out.append((shard, indices))
    return out


def _best(best: float | None, results: list[MeasureResult]) -> float | None:
    for r in results:
        if r.latency is not None and (best is None or r.latency < best):
            best = r.latency
    return best


class LocalWorkerPool:
    """Workers in this process, one thread each (the embedded `farm tune`)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self._threads = cf.ThreadPoolExecutor(len(workers), thread_name_prefix="farm-worker")
        self.started = time.monotonic()

    @property
    def size(self) -> int:
        return len(self.workers)

    def submit(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]:
        return self._threads.submit(self.workers[worker].process, task, indices, shard, round_)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for w in self.workers:
            w.close()
