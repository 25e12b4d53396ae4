"""The Python client: submit tuning jobs to a farm and follow them; the one job lifecycle.

    from farm import Client
    client = Client("postgresql://farm@db-host/farm")   # a running farm (`farm scheduler`)
    job = client.submit(["resnet-last-conv"], target="cuda", trials=1000)
    job.wait(progress=True)
    job.best(); job.trials(); job.export("best.json")

Every job goes the same way, whoever submits it (`farm tune`, `farm submit`, this client):
validated (farm.core.jobspec.JobRequest), queued in the database, claimed and run by a
scheduler (scheduler.service.Scheduler), followed from the database, its best configs read
back (farm.export). A client that runs jobs `in_process` claims and runs the jobs it submits
itself, each in a thread of this process (local Ray, tracker and RPC servers), at once as long as
the devices allow (scheduler.service.Scheduler: a job waits for devices that others hold);
`Client()` with no URL does that on the embedded default database ($FARM_DB or
sqlite:///farm.db), as no scheduler service watches it. Otherwise a `farm scheduler` runs them.
Progress streams from the database: LISTEN/NOTIFY on Postgres, polling on SQLite.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from db.engine import display_url
from db.store import ResultStore, open_store
from farm.core.errors import FarmError, one_line
from farm.core.files import writable_folder
from farm.core.jobspec import JobRequest
from farm.core.targets import TargetSpec, parse_target
from farm.core.workloads import Workload
from farm.export import export_job, job_records
from farm.progress import JobProgress
from scheduler.cluster import restore_sigterm, stop_on_signals
from scheduler.pool import PoolFactory
from scheduler.service import Scheduler

if TYPE_CHECKING:
    import pandas as pd

FINAL = ("done", "failed", "cancelled")
# Jobs an in-process client runs at once (each still waits for devices the others hold).
MAX_JOBS = 8

log = logging.getLogger("farm.client")


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

        With `progress`, show it (farm.progress.JobProgress). A job this client runs in
        process that failed with an exception re-raises it here.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        display = JobProgress() if progress else None
        try:
            while True:
                job = self.status()
                if display is not None:
                    display.update(job)
                if job["status"] in FINAL:
                    self.client._raise_if_failed(self.id)
                    return str(job["status"])
                if deadline is not None and time.monotonic() >= deadline:
                    return str(job["status"])
                self.client._raise_if_failed(self.id)
                self.client.store.wait_for_trials(self.id, 0.5)
        finally:
            if display is not None:
                display.close()

    def best(self) -> list[dict[str, Any]]:
        """The best config of each task, as `farm.best/1` export records."""
        return job_records(self.client.store, self.id)

    def trials(self) -> pd.DataFrame:
        """One row per trial: config, status, error, latency (s), every repeat, worker, device, ..."""
        return self.client.store.trials(job_id=self.id)

    def cancel(self) -> bool:
        """Stop the job: nothing more is handed out, the candidates on its devices finish within
        about a second, and its measured trials stay. False if it had already ended."""
        return bool(self.client.store.cancel_job(self.id))

    def export(self, path: str | Path, format: str = "farm") -> Path:
        """Write the job's best configs to `path`: format `farm`, one farm.best/1 JSON file;
        `metaschedule`, a folder holding a MetaSchedule JSON database."""
        export_job(self.client.store, self.id, path, format)
        return Path(path)


class _StoreOnUse:
    """A client's store as its in-process scheduler holds it: opened when first used, so that the
    workers started ahead of a job (`Client.prepare`) write nothing for a job refused next."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client.store, name)


class Client:
    """A connection to a farm's database (see the module docstring).

    `in_process` (default: when no `url` is given) runs submitted jobs in this process, with
    RPC logs in `log_dir` and worker pools from `pool_factory` (default: Ray worker actors).
    """

    def __init__(self, url: str | None = None, *, in_process: bool | None = None, log_dir: Path | None = None,
                 pool_factory: PoolFactory | None = None) -> None:
        self.in_process = url is None if in_process is None else in_process
        self._url = url
        self.url = display_url(url)  # for messages: the password masked; FarmError for a malformed URL
        # Checked here, before a job is submitted: a log folder that cannot be written is one line.
        self.log_dir = writable_folder(log_dir) if log_dir is not None else None
        self.pool_factory = pool_factory
        # The home thread starts Ray and the workers ahead of jobs and stops them at the end: a Ray
        # driver started in a thread that ends loses its cluster, and stops fastest from the thread
        # that started it. Jobs run in threads of their own, several at once.
        self._home: cf.ThreadPoolExecutor | None = None
        self._job_threads: cf.ThreadPoolExecutor | None = None
        self._running: dict[int, cf.Future[str]] = {}
        self._scheduler: Scheduler | None = None
        self._scheduler_lock = threading.Lock()
        self._took_sigterm = False  # whether this client made SIGTERM interrupt (see `_run_here`)

    @cached_property
    def store(self) -> ResultStore:
        """The farm's database, opened (and migrated) on first use: a job refused by validation
        leaves no database behind."""
        return open_store(self._url)

    def submit(self, workloads: Sequence[str | Workload | tuple[str, dict[str, Any]]],
               target: str | dict[str, Any] | TargetSpec = "llvm", trials: int = 64, *, search: str = "xgb",
               workers: int = 1, seed: int = 0, batch_size: int = 16, rpc_keys: Sequence[str] = (),
               name: str = "", templates: str = "best") -> Job:
        """Queue a job tuning `workloads` (names, presets, Workloads or (name, params)) for
        `target` with `trials` measurements in all. Raises FarmError for bad input, having
        written nothing. `search` is a search spec, a strategy's name with options or without
        (`xgb`, `xgb:screen=16,epsilon=0.25`: farm.core.search). `rpc_keys` measures on devices
        that run only a TVM RPC server. A workload may be a TIR PrimFunc (or an IRModule holding
        one: docs/tir.md); `templates` ``all`` tunes a kernel that several templates schedule with
        each of them (farm.core.jobspec.JobRequest.build)."""
        return self.submit_request(JobRequest.build(
            workloads, target, trials, search=search, workers=workers, seed=seed, batch_size=batch_size,
            rpc_keys=rpc_keys, name=name, templates=templates))

    def submit_model(self, model: Any, example_inputs: Sequence[Any] | None = None,
                     target: str | dict[str, Any] | TargetSpec = "llvm", trials: int = 64, *,
                     skip: Sequence[str] = (), budgets: dict[str, int] | None = None, retune: bool = False,
                     input_shapes: dict[str, Sequence[int]] | None = None, **options: Any) -> Job:
        """Queue one job tuning every kernel of `model` (a torch.nn.Module with `example_inputs`, a
        torch.export program, an ONNX or .pt2 or .py file, a Relax IRModule, or a farm.core.model.Model)
        for `target`, `trials` in all, handed to the kernels where the model's latency falls fastest.
        Kernels tuned before on the same target are reused unless `retune`; `skip` and `budgets`
        (kernel names or shell patterns) leave kernels out or fix their trials; `options` are
        `submit`'s (search, workers, seed, ...). FarmError for bad input, having written nothing."""
        from farm.core.model import Model, load_model, model_job

        loaded = model if isinstance(model, Model) else load_model(model, example_inputs, input_shapes=input_shapes)
        return self.submit_request(model_job(loaded, target, trials, skip=skip, budgets=budgets, retune=retune,
                                             **options))

    def submit_request(self, request: JobRequest) -> Job:
        """Queue a validated job (farm.core.jobspec.JobRequest, farm.core.model.model_job); in
        process, start running it."""
        job = Job(self, self.store.submit(request))
        if self.in_process:
            self._run_here()
            self._at_home().submit(self._start_ray, request.target.kind)
            if self._job_threads is None:
                self._job_threads = cf.ThreadPoolExecutor(MAX_JOBS, thread_name_prefix="farm-job")
            self._running[job.id] = self._job_threads.submit(self._run, job.id)
        return job

    def prepare(self, target: str | dict[str, Any] | TargetSpec = "llvm", workers: int = 1) -> None:
        """In process: start what a job on `workers` devices of `target` runs on (the local Ray
        instance, the worker actors with their build processes and RPC servers) now, in the thread
        that runs the jobs, while this one goes on (checking and submitting the job: TVM's import
        and the task's space take seconds). A job of that shape submitted next finds them up. A
        failure to start them is the job's: it fails with it when it runs. Nothing for a client
        of a running farm, whose workers are up."""
        if self.in_process:
            spec = target if isinstance(target, TargetSpec) else parse_target(target)
            self._run_here()
            self._at_home().submit(self._prepare, {"target": spec.to_json(), "workers": workers})

    def _run_here(self) -> None:
        """Before this client first runs jobs in process: SIGTERM, unless the program handles it
        itself, interrupts the main thread as Ctrl-C does (scheduler.cluster.stop_on_signals), so
        that the `with` block (or `close`) stops the jobs rather than the process dying with them
        `running` in the database."""
        if not self._took_sigterm:
            self._took_sigterm = stop_on_signals()

    def _at_home(self) -> cf.ThreadPoolExecutor:
        if self._home is None:
            self._home = cf.ThreadPoolExecutor(1, thread_name_prefix="farm-in-process")
        return self._home

    def job(self, job_id: int) -> Job:
        job = Job(self, job_id)
        job.status()  # raises for an unknown id
        return job

    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        return self.store.jobs(limit)

    def _run(self, job_id: int) -> str:
        return self._scheduler_here().claim_and_run(job_id)

    def _prepare(self, spec: dict[str, Any]) -> None:
        try:
            self._scheduler_here().pool_for(spec)
        except Exception as e:  # the job meets it again, and fails with it
            log.info("starting the workers ahead of the job failed: %s", one_line(e))

    def _start_ray(self, kind: str) -> None:
        try:
            self._scheduler_here().start_ray(kind)
        except Exception as e:  # the job meets it again, and fails with it
            log.info("starting Ray ahead of the job failed: %s", one_line(e))

    def _scheduler_here(self) -> Scheduler:
        """The scheduler of this client's in-process jobs (made on first use)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                store = cast(ResultStore, _StoreOnUse(self))
                self._scheduler = Scheduler(store, log_dir=self.log_dir, pool_factory=self.pool_factory)
            return self._scheduler

    def _close_scheduler(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()

    def _raise_if_failed(self, job_id: int) -> None:
        future = self._running.get(job_id)
        if future is not None and future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    def close(self, interrupt: bool = False) -> None:
        """Wait for in-process jobs to end, stop what this client started (its pools, tracker and
        local Ray instance), release the database. With `interrupt` (leaving a `with` block by an
        exception: Ctrl-C, SIGTERM, an error), the jobs are stopped first, each within a candidate,
        and recorded as cancelled ("interrupted"), their trials kept."""
        if interrupt and self._scheduler is not None:
            self._scheduler.interrupt()
        if self._job_threads is not None:
            self._job_threads.shutdown(wait=True)
        if self._home is not None:
            # After the jobs, in the thread where their Ray driver started.
            self._home.submit(self._close_scheduler).result()
            self._home.shutdown(wait=True)
        if "store" in self.__dict__:
            self.store.close()
        if self._took_sigterm:
            restore_sigterm()
            self._took_sigterm = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(interrupt=exc_type is not None)


def tune_model(model: Any, example_inputs: Sequence[Any] | None = None, *,
               target: str | dict[str, Any] | TargetSpec = "llvm", trials: int = 64, db: str | None = None,
               workers: int = 1, progress: bool = True, **options: Any) -> Job:
    """Tune every kernel of `model` on this machine, as `farm tune-model` does: one job on
    `workers` local devices (every kernel a task, the budget handed to where the model's latency
    falls fastest), run in this process on the database `db` (default $FARM_DB, else
    sqlite:///farm.db); returns the finished Job (`job.best()` its records, `job.export(...)`).
    `options` are `Client.submit_model`'s."""
    with Client(db, in_process=True) as client:
        client.prepare(target, workers)
        job = client.submit_model(model, example_inputs, target, trials, workers=workers, **options)
        job.wait(progress=progress)
    return job
