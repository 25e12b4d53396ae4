"""The Python client: submit tuning jobs to a farm and follow them.

    from farm import Client
    farm = Client("postgresql://farm@db-host/farm")     # a running farm (`farm scheduler`)
    job = farm.submit(["resnet-last-conv"], target="cuda", trials=1000)
    job.wait(progress=True)
    job.best(); job.trials(); job.export("best.json")

`Client()` with no URL is the embedded default: the database is $FARM_DB or
sqlite:///farm.db, and the jobs it submits run in this process (local Ray, tracker and RPC
servers), one after another, as no scheduler service watches that database.
Progress streams from the database: LISTEN/NOTIFY on Postgres, polling on SQLite.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from farm.errors import FarmError
from farm.jobs import JobRequest
from farm.workloads import Workload

FINAL = ("done", "failed", "cancelled")


class Job:
    """A submitted job. Every method reads the database: it reflects what the farm has done."""

    def __init__(self, client: Client, job_id: int) -> None:
        self.client, self.id = client, job_id

    def __repr__(self) -> str:
        return f"Job({self.id}, {self.status()['status']!r})"

    def status(self) -> dict[str, Any]:
        """The job row, its tasks with per-status trial counts and best latency (seconds)."""
        job = self.client.store.job(self.id)
        if job is None:
            raise FarmError(f"no job {self.id} in {self.client.url}")
        return job

    def wait(self, progress: bool = True, timeout: float | None = None) -> str:
        """Block until the job ends (or `timeout` seconds pass); return its status.

        With `progress`, show a bar per task: trials done of its budget, best latency so far.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _ProgressBars() if progress else None
        try:
            while True:
                job = self.status()
                if bar is not None:
                    bar.update(job)
                if job["status"] in FINAL:
                    return str(job["status"])
                if deadline is not None and time.monotonic() >= deadline:
                    return str(job["status"])
                # Embedded jobs report failures of the thread running them here.
                self.client._raise_if_failed(self.id)
                self.client.store.wait_for_trials(self.id, 0.5)
        finally:
            if bar is not None:
                bar.close()

    def best(self) -> list[dict[str, Any]]:
        """The best config of each task, as `farm.best/1` export records."""
        from farm.export import job_records

        return job_records(self.client.store, self.id)

    def trials(self) -> pd.DataFrame:
        """One row per trial: config, status, error, latency (s), every repeat, worker, device, ..."""
        return self.client.store.trials(job_id=self.id)

    def cancel(self) -> bool:
        """Ask the farm to stop the job (measured trials stay). False if it had already ended."""
        return bool(self.client.store.cancel_job(self.id))

    def export(self, path: str | Path, format: str = "farm") -> Path:
        """Write the job's best configs to `path`: format `farm`, one farm.best/1 JSON file;
        `metaschedule`, a folder holding a MetaSchedule JSON database."""
        from farm.export import export_job

        export_job(self.client.store, self.id, path, format)
        return Path(path)


class Client:
    """A connection to a farm's database (see the module docstring)."""

    def __init__(self, url: str | None = None) -> None:
        from db.store import open_store

        self.embedded = url is None
        self.url = url or os.environ.get("FARM_DB") or "sqlite:///farm.db"
        self.store = open_store(self.url)
        self._runner: cf.ThreadPoolExecutor | None = None
        self._running: dict[int, cf.Future[str]] = {}
        self._scheduler: Any = None

    def submit(self, workloads: Sequence[str | Workload | tuple[str, dict[str, Any]]], target: str | dict[str, Any]
               = "llvm", trials: int = 64, *, search: str = "xgb", workers: int = 1, seed: int = 0,
               batch_size: int = 16, rpc_keys: Sequence[str] = (), name: str = "") -> Job:
        """Queue a job tuning `workloads` (names, presets, Workloads or (name, params)) for
        `target` with `trials` measurements in all. Raises FarmError for bad input, having
        written nothing. `rpc_keys` measures on devices that run only a TVM RPC server."""
        request = JobRequest.build(workloads, target, trials, search=search, workers=workers, seed=seed,
                                   batch_size=batch_size, rpc_keys=rpc_keys, name=name)
        job = Job(self, request.submit(self.store))
        if self.embedded:
            self._run_embedded(job.id)
        return job

    def job(self, job_id: int) -> Job:
        job = Job(self, job_id)
        job.status()  # raises for an unknown id
        return job

    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        return self.store.jobs(limit)

    def _run_embedded(self, job_id: int) -> None:
        if self._runner is None:
            self._runner = cf.ThreadPoolExecutor(1, thread_name_prefix="farm-embedded")
        self._running[job_id] = self._runner.submit(self._run_job, job_id)

    def _run_job(self, job_id: int) -> str:
        from scheduler.service import Scheduler

        if self._scheduler is None:
            self._scheduler = Scheduler(self.store)
        if self.store.claim_job(self._scheduler.id, job_id=job_id) is None:
            return self.store.job_status(job_id)  # cancelled before it started
        return str(self._scheduler.run_job(job_id))

    def _raise_if_failed(self, job_id: int) -> None:
        future = self._running.get(job_id)
        if future is not None and future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    def close(self) -> None:
        """Wait for embedded jobs to end, stop what this client started, release the database."""
        if self._runner is not None:
            self._runner.shutdown(wait=True)
        if self._scheduler is not None:
            self._scheduler.close()
        self.store.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ProgressBars:
    """Rich progress bars, one per task, fed from `Job.status()` documents."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("best {task.fields[best]}"), TimeElapsedColumn())
        self.progress.start()
        self.ids: dict[int, Any] = {}

    def update(self, job: dict[str, Any]) -> None:
        for task in job["tasks"]:
            if task["id"] not in self.ids:
                self.ids[task["id"]] = self.progress.add_task(task["workload"]["name"], total=task["budget"], best="-")
            best = "-" if task["best_latency"] is None else f"{task['best_latency'] * 1e6:.1f} µs"
            self.progress.update(self.ids[task["id"]], completed=task["trials"], best=best)

    def close(self) -> None:
        self.progress.stop()
