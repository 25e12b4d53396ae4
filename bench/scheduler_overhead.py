"""Scheduler overhead per trial, and database write throughput with concurrent writers.

    python bench/scheduler_overhead.py --db postgresql://postgres@127.0.0.1/farm_bench [--trials 20000]
                                       [--search random xgb]

1. Overhead: a job per search runs through the real tuning loop (scheduler.tuner.run_job: search
   proposals, queueing, result writing, rounds, cancellation checks; with xgb also retraining
   the cost model at every round close and planning by annealing) against workers that return
   a made-up result for every config at once, so the wall time per trial is everything but
   build and measure. Goal: under 5 ms per trial.
2. Writes: 8 processes, each with its own store and ResultWriter, write trials in batches
   (multi-row INSERT ... ON CONFLICT DO NOTHING). Goal: over 10,000 trials per second.

The database must exist and be empty of farm tables, or be a fresh SQLite path: the script
creates its own jobs in it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import random
import time

from db.store import open_store
from farm.core.jobspec import JobRequest
from farm.core.measure import MeasureResult, Status
from farm.core.task import Task
from scheduler.local_pool import LocalWorkerPool
from scheduler.tuner import run_job


class InstantWorker:
    """A worker that measures nothing: every config gets a made-up latency at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rng = random.Random(name)

    def build_and_measure(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        return [MeasureResult(i, task.config(i).to_json(), Status.OK, latencies=[self.rng.uniform(1e-5, 1e-3)] * 3,
                              device=self.device_name(), worker=self.name, shard=shard, round=round_) for i in indices]

    def device_name(self) -> str:
        """No device: its made-up results name none."""
        return "none"

    def cancel(self) -> None:
        """Nothing to stop: a call returns at once."""

    def close(self) -> None:
        """Nothing to release."""


def overhead(url: str, trials: int, workers: int, batch: int, search: str) -> float:
    store = open_store(url)
    job = store.submit(JobRequest.build(["resnet-last-conv"], "cuda", trials, workers=workers, batch_size=batch,
                                        search=search))
    store.claim_job("bench", job_id=job)
    pool = LocalWorkerPool([InstantWorker(f"w{i}") for i in range(workers)])
    start = time.perf_counter()
    run_job(store, job, pool, search=search, batch_size=batch)
    seconds = time.perf_counter() - start
    pool.close()
    store.finish_job(job, "done")
    assert len(store.trials(job_id=job)) == trials
    return seconds


def _write(url: str, task_id: int, offset: int, count: int, batch: int) -> float:
    store = open_store(url)
    rows = [MeasureResult(offset + i, {"i": offset + i}, Status.OK, latencies=[1e-4, 1.1e-4, 0.9e-4],
                          build_seconds=1.0, run_seconds=0.2, device="bench", worker="w") for i in range(count)]
    start = time.perf_counter()
    with store.writer(batch_size=batch, flush_seconds=None) as writer:
        for r in rows:
            writer.record(task_id, r)
    return time.perf_counter() - start


def writes(url: str, writers: int, per_writer: int, batch: int) -> float:
    store = open_store(url)
    job = store.submit(JobRequest.build(["resnet-last-conv"], "cuda", 1))
    (task,) = store.tasks(job)
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(writers, mp_context=ctx) as pool:
        pool.submit(open_store, url).result()  # warm the pool: imports, not counted
        start = time.perf_counter()
        futures = [pool.submit(_write, url, task["id"], w * per_writer, per_writer, batch) for w in range(writers)]
        for f in futures:
            f.result()
        seconds = time.perf_counter() - start
    assert store.trial_count(task["id"]) == writers * per_writer
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--trials", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--per-writer", type=int, default=25000)
    parser.add_argument("--search", nargs="+", default=["random", "xgb"], choices=["random", "xgb"])
    args = parser.parse_args()
    for search in args.search:
        seconds = overhead(args.db, args.trials, args.workers, args.batch, search)
        print(f"scheduler overhead, {search} search: {args.trials} trials, {args.workers} workers, batch "
              f"{args.batch}: {seconds:.1f} s, {seconds / args.trials * 1e3:.3f} ms per trial (goal < 5 ms)",
              flush=True)
    seconds = writes(args.db, args.writers, args.per_writer, 1000)
    total = args.writers * args.per_writer
    print(f"writes: {args.writers} processes x {args.per_writer} trials in batches of 1000: {seconds:.1f} s, "
          f"{total / seconds:,.0f} trials/s (goal > 10,000)")


if __name__ == "__main__":
    main()
