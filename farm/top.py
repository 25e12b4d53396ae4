"""`farm top`: a live view of the farm's jobs and workers, read from its database alone.

Every refresh reads the database and nothing else (no scheduler, Ray or Prometheus), so it works
from any machine that reaches the database, during a job or after it.

- Jobs: the newest `limit` jobs, or the ones asked for: id, state, workloads, trials of the
  budget, trials per second in the last minute and over the job so far, each task's best
  latency (a model's job: its kernels tuned so far and the model's estimated latency), and the ETA
  (trials left over the last minute's rate: farm.report.Pace).
- Workers: every worker that stored trials for the jobs watched (the running ones shown, or the
  ones asked for) since their claims: its jobs, its trials of the last minute by status, and how
  long ago it stored its newest trial (farm.report.WorkerActivity). A worker that stopped
  measuring shows as a growing age.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from db.engine import display_url
from db.store import ResultStore
from farm.core.allocation import model_kernels, model_latency
from farm.core.errors import FarmError
from farm.core.workloads import workload_label
from farm.progress import format_latency, format_seconds
from farm.report import RECENT_SECONDS, Pace, WorkerActivity, pace, worker_activity


@dataclass
class Snapshot:
    """What one refresh shows: the jobs (status documents and their Pace) and the workers of the
    jobs watched, read from the database at `url` (password masked) at Unix time `taken_at`."""

    url: str
    taken_at: float
    jobs: list[tuple[dict[str, Any], Pace]]
    workers: list[WorkerActivity]


def snapshot(store: ResultStore, job_ids: Sequence[int] = (), limit: int = 10, now: float | None = None) -> Snapshot:
    """Read a Snapshot: the jobs `job_ids` (FarmError for one that does not exist) and their
    workers, or, with none given, the newest `limit` jobs and the workers of the running ones."""
    now = time.time() if now is None else now
    docs = []
    for job_id in job_ids or [row["id"] for row in store.jobs(limit)]:
        doc = store.job(job_id)
        if doc is None:
            raise FarmError(f"no job {job_id} in this database; `farm jobs` lists the jobs")
        docs.append(doc)
    watched = docs if job_ids else [doc for doc in docs if doc["status"] == "running"]
    return Snapshot(display_url(store.url), now, [(doc, pace(store, doc, now)) for doc in docs],
                    worker_activity(store, watched, now))


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(snap: Snapshot) -> Group:
    """The snapshot as a header line and two tables, jobs and workers."""
    minute = f"{RECENT_SECONDS:.0f} s"
    jobs = Table(title="jobs", title_justify="left")
    for column in ("job", "state", "workloads", "trials", f"trials/s ({minute})", "trials/s (all)", "best",
                   "ETA"):
        jobs.add_column(column, no_wrap=column != "workloads",
                        justify="right" if column.startswith(("trials", "ETA")) else "left")
    for doc, job_pace in snap.jobs:
        model = doc["spec"].get("model")
        if model is not None:  # a model's kernels are many: the model and its estimated latency
            kernels = model_kernels(doc["tasks"])
            tuned = sum(k.best is not None for k in kernels)
            what = f"model {model['name']} ({tuned}/{len(kernels)} kernels tuned)"
            best = f"model {format_latency(model_latency(kernels))}"
        else:
            what = ", ".join(workload_label(t["workload"], params=False) for t in doc["tasks"])
            best = ", ".join(format_latency(t["best_latency"]) for t in doc["tasks"])
        jobs.add_row(str(doc["id"]), doc["status"], what, f"{doc['trials']}/{doc['trials_budget']}",
                     _rate(job_pace.recent_rate), _rate(job_pace.throughput), best, job_pace.eta())
    workers = Table(title="workers", title_justify="left")
    for column in ("worker", "jobs", f"trials ({minute})", f"statuses ({minute})", "last trial"):
        workers.add_column(column, no_wrap=True, justify="right" if column.startswith(("trials", "last")) else "left")
    for worker in snap.workers:
        statuses = ", ".join(f"{status} {n}" for status, n in sorted(worker.recent.items())) or "-"
        workers.add_row(worker.name or "(unnamed)", ", ".join(map(str, worker.jobs)), str(sum(worker.recent.values())),
                        statuses, f"{format_seconds(max(snap.taken_at - worker.last_at, 0))} ago")
    header = Text(f"farm top — {snap.url} at {datetime.fromtimestamp(snap.taken_at):%H:%M:%S}")
    if not snap.workers:
        workers.caption = "no running job: no worker to show"
    return Group(header, jobs, workers)


def run(store: ResultStore, console: Console, job_ids: Sequence[int] = (), limit: int = 10,
        interval: float = 2.0, once: bool = False) -> None:
    """Show snapshots every `interval` seconds until Ctrl-C (or one, with `once`): on a terminal
    redrawn in place (rich Live), elsewhere printed one after another, for a log or a pipe."""
    if once:
        console.print(render(snapshot(store, job_ids, limit)))
        return
    try:
        if console.is_terminal:
            with Live(render(snapshot(store, job_ids, limit)), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(snapshot(store, job_ids, limit)), refresh=True)
        while True:
            console.print(render(snapshot(store, job_ids, limit)))
            time.sleep(interval)
    except KeyboardInterrupt:  # how one leaves `farm top`: not an error
        return
