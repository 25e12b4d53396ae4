"""The result store's contract: `ResultStore`, the abstract base every store implements.

It says what a store keeps (jobs, tasks, trials, rounds, cost models, exports, workers) and
what each call promises; `db.sql_store.SQLResultStore` is the implementation and
`db.store.open_store` the factory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from db.writer import ResultWriter
    from farm.core.jobspec import JobRequest

TASK_KEYS = (
    "workload",
    "workload_key",
    "target",
    "target_kind",
    "template",
    "template_version",
    "space_size",
    "budget",
    "family_key",
)
# Task keys a caller may leave out, with their defaults: a kernel tuned on its own is called once.
TASK_DEFAULTS = {"weight": 1}
TRIAL_COLUMNS = (
    "task_id",
    "workload_key",
    "config_index",
    "config",
    "status",
    "error",
    "latency",
    "latencies",
    "build_seconds",
    "run_seconds",
    "device",
    "worker",
    "shard",
    "round",
    "timeline",
    "origin",
    "created_at",
)


class ResultStore(ABC):
    """The farm's persistent state: jobs, their tasks, measured trials, rounds, cost models.

    Contract:

    - A store owns its engine and connection pool, built from its URL on first use.
    - Thread safety: every call checks out its own connection and runs in its own
      transaction, so threads of one process may share a store (the pool bounds how many
      talk to the database at once). Give each process its own store.
    - Pickling: a pickled store carries only its URL and pool settings, never its engine,
      and the copy builds a fresh engine on first use. That is how a store is passed into
      Ray actors. A store used after ``fork`` also rebuilds its engine rather than share
      the parent's connections.
    - Every method that changes several rows does so atomically.
    - Outages: a call that finds the database unavailable (a server restarting or out of reach)
      waits for it and tries again, for up to ``$FARM_DB_OUTAGE_SECONDS`` (600 s) counted from
      the outage's first failure, then raises `DatabaseUnavailable` (db.outage). Every write is
      safe to retry except those of `create_job`, `claim_job`, `save_model` and `add_export`,
      which are not retried once their COMMIT was sent (the reply lost, it may have been applied).
    - Trials are immutable and unique per (task, config_index); they are written through
      `writer()`, which batches them.
    - Timestamps are timezone-aware UTC datetimes; latencies are in seconds.
    - Dicts returned have the table's column names as keys.
    """

    url: str

    # Jobs -------------------------------------------------------------------------------

    @abstractmethod
    def create_job(
        self, name: str, spec: dict[str, Any], trials_budget: int, search: str, tasks: list[dict[str, Any]]
    ) -> int:
        """Create a queued job and its tasks in one transaction; return the job's id.

        `spec` is the request as submitted (JSON). Each task dict has the keys of `TASK_KEYS`, and
        may have those of `TASK_DEFAULTS`; ValueError if a key is missing or unknown, or `tasks` is empty.
        """

    def submit(self, request: JobRequest) -> int:
        """Queue a validated job (farm.core.jobspec.JobRequest) and its tasks; returns its id."""
        return self.create_job(**request.job_row())

    @abstractmethod
    def claim_job(self, scheduler_id: str, job_id: int | None = None) -> int | None:
        """Atomically take the oldest queued job (or job `job_id`) for `scheduler_id`; mark it running.

        Returns its id, or None when no job is queued (or `job_id` is not). Concurrent
        claimers, in any number of processes, never get the same job. `job_id` serves a
        client that runs the job it just submitted itself (``farm tune``).
        """

    @abstractmethod
    def wait_for_trials(self, job_id: int, timeout: float) -> bool:
        """Block until trials of `job_id` may have been written, at most `timeout` seconds.

        On Postgres it LISTENs for the writer's NOTIFY and returns True as soon as one for
        this job arrives (False on timeout); on SQLite, which has no notifications, it sleeps
        `timeout` and returns True (the caller polls). It never raises for an unavailable
        database: it sleeps `timeout` and returns True, and LISTENs again on a later call.
        """

    @abstractmethod
    def requeue_stale(self, seconds: float) -> list[int]:
        """Queue again every running job whose scheduler sent no heartbeat for `seconds`
        (it died); returns their ids. Their measured trials stay: a resumed job measures
        only the rest of its budget. On Postgres, only the database's own uptime counts: a
        server restarted less than `seconds` ago requeues nothing, since no scheduler could
        send heartbeats while it was down."""

    @abstractmethod
    def give_back(self, job_id: int, scheduler_id: str) -> bool:
        """Queue a running job claimed by `scheduler_id` again (its trials stay), for another
        scheduler to resume; False if it is not running under that scheduler."""

    @abstractmethod
    def heartbeat(self, job_id: int, scheduler_id: str) -> bool:
        """Record that `scheduler_id` is still working on `job_id`.

        Returns False when the job is no longer running under this scheduler (it was
        cancelled, finished, or claimed by another): the scheduler should stop working on it.
        """

    @abstractmethod
    def finish_job(self, job_id: int, status: str, error: str = "", scheduler_id: str | None = None) -> bool:
        """Mark a queued or running job done, failed or cancelled, with `error` (text).

        Returns False, changing nothing, if the job had already finished: a job cancelled
        while it ran stays cancelled. With `scheduler_id`, also if the job is not claimed by that
        scheduler (any more: requeued and claimed by another while this one could not reach the
        database). ValueError for any other `status`.
        """

    @abstractmethod
    def cancel_job(self, job_id: int) -> bool:
        """Cancel a queued or running job; False if there is no such active job.

        A running job's tuning loop learns of it within half a second and stops its work in flight
        (scheduler.tuner); its heartbeat is refused from then on.
        """

    @abstractmethod
    def job(self, job_id: int) -> dict[str, Any] | None:
        """The job's row, plus ``tasks`` (see `tasks`) and ``trials`` (its total); None if absent.

        Each task dict also has ``counts`` ({trial status: number}), ``trials`` (its total),
        ``best_latency`` (seconds, None before an ok trial) and ``reused`` (whether its record was
        copied from an earlier job: origin ``reused``).
        """

    @abstractmethod
    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest `limit` jobs, newest first: each one's row plus ``trials`` (its total)."""

    @abstractmethod
    def job_counts(self) -> dict[str, int]:
        """How many jobs are in each state (states without a job are left out)."""

    @abstractmethod
    def job_status(self, job_id: int) -> str:
        """The job's status (a `JobStatus` value); FarmError if there is no such job."""

    @abstractmethod
    def tasks(self, job_id: int) -> list[dict[str, Any]]:
        """The job's task rows in creation order."""

    @abstractmethod
    def set_task_budget(self, task_id: int, budget: int) -> None:
        """Give the task a new trial budget (a model job's budget moves between its tasks)."""

    @abstractmethod
    def prior_best(self, workload_key: str, target_kind: str, exclude_job: int | None = None) -> list[dict[str, Any]]:
        """The fastest ok trial of every task of `workload_key` on `target_kind`, of any job but
        `exclude_job`, fastest first: the tuning records an earlier job left. Keys: `TRIAL_COLUMNS`
        and the task's `job_id`, `target`, `template`, `template_version`, `workload`."""

    # Trials -----------------------------------------------------------------------------

    @abstractmethod
    def measured(self, task_id: int) -> dict[int, float | None]:
        """Each config index of the task that has a trial, whatever its status, with its latency
        (None unless the trial is ok): what a search of the task started afresh must know."""

    @abstractmethod
    def trial_count(self, task_id: int) -> int:
        """Number of trials of the task."""

    @abstractmethod
    def trials(self, job_id: int | None = None, task_id: int | None = None) -> pd.DataFrame:
        """Trials in the order they were stored, of one job, one task, or all.

        One row per trial with the columns `TRIAL_COLUMNS`: config and latencies as stored
        (dict and list), latency NaN unless the trial is ok.
        """

    @abstractmethod
    def best(self, task_id: int, k: int = 1) -> list[dict[str, Any]]:
        """The task's `k` fastest ok trials, fastest first (keys: `TRIAL_COLUMNS`)."""

    @abstractmethod
    def trial_activity(self, since: datetime, job_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Trials stored at or after `since` (a timezone-aware datetime), counted per job, worker
        and status: dicts with keys ``job_id``, ``worker``, ``status``, ``trials`` (how many) and
        ``last_at`` (the newest one's stored time), ordered by job, worker, status.

        Only trials of the jobs `job_ids` when given (an empty sequence: none). It reads the
        trials of those jobs' tasks only, so a live view of running jobs costs no scan of the
        whole table.
        """

    @abstractmethod
    def writer(self, batch_size: int = 256, flush_seconds: float | None = 0.5) -> ResultWriter:
        """A new `ResultWriter` on this store's database; close it (or use ``with``) when done."""

    # Rounds and cost models -------------------------------------------------------------

    @abstractmethod
    def add_round(self, task_id: int, round: int, trials: int, best_latency: float | None,
                  rank_corr: float | None = None, model_id: int | None = None) -> None:
        """Record the task's state after `round`; recording a round again replaces it
        (a scheduler that resumes a job may repeat its last round)."""

    @abstractmethod
    def rounds(self, task_id: int) -> list[dict[str, Any]]:
        """The task's round rows in round order."""

    @abstractmethod
    def save_model(self, family_key: str, task_id: int | None, model: bytes, feature_names: Sequence[str],
                   training_rows: int, training_seconds: float) -> int:
        """Store a trained cost model as the family's next version; return its id.

        `model` is XGBoost's UBJSON (``Booster.save_raw("ubj")``), never a pickle.
        """

    @abstractmethod
    def latest_model(self, family_key: str) -> dict[str, Any] | None:
        """The family's newest model row (``model`` as bytes), None if it has none."""

    @abstractmethod
    def set_model_rank_corr(self, model_id: int, value: float) -> None:
        """Record how well the model ranked the next round's configs; KeyError if absent."""

    @abstractmethod
    def trials_for_family(self, family_key: str, limit: int | None = None) -> pd.DataFrame:
        """Trials of every task of the family, to train or transfer a cost model.

        Columns: `TRIAL_COLUMNS` plus ``params`` (the task's workload parameters). With
        `limit`, only the newest `limit` trials. In the order they were stored.
        """

    # Exports and workers ----------------------------------------------------------------

    @abstractmethod
    def add_export(self, job_id: int, format: str, path: str, records: int) -> int:
        """Record that `records` best configs of the job were exported to `path`; return its id."""

    @abstractmethod
    def register_worker(self, name: str, host: str, device: str, rpc_key: str, status: str = "idle") -> int:
        """Register (or re-register, after a restart) the worker `name`; return its id."""

    @abstractmethod
    def worker_seen(self, name: str, status: str) -> None:
        """Record the worker's status and that it was just heard from; KeyError if unregistered."""

    @abstractmethod
    def workers(self) -> list[dict[str, Any]]:
        """The worker rows, by name."""

    @abstractmethod
    def close(self) -> None:
        """Close the store's connections; a later call opens new ones."""
