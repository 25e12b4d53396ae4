"""The SQL implementation of the result store: `SQLResultStore`, for SQLite and Postgres alike.

It implements the contract of `db.base.ResultStore`; open one through `db.store.open_store`,
which migrates the schema first.
"""

from __future__ import annotations

import functools
import logging
import os
import select as io_select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, Row, Select, func, insert, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from db.base import TASK_DEFAULTS, TASK_KEYS, TRIAL_COLUMNS, ResultStore
from db.engine import dialect_insert, display_url, for_writing, make_engine, resolve_url
from db.models import (
    CostModelRecord,
    ExportRecord,
    JobRecord,
    JobStatus,
    RoundRecord,
    TaskRecord,
    TrialRecord,
    WorkerRecord,
    utcnow,
)
from db.outage import CommitOutcomeUnknown, Outage, first_line, is_unavailable
from db.writer import NOTIFY_CHANNEL, ResultWriter
from farm.core.errors import FarmError
from farm.core.measure import Status

if TYPE_CHECKING:
    import pandas as pd

_JOBS = JobRecord.__table__
_TASKS = TaskRecord.__table__
_TRIALS = TrialRecord.__table__
_ROUNDS = RoundRecord.__table__
_MODELS = CostModelRecord.__table__
_EXPORTS = ExportRecord.__table__
_WORKERS = WorkerRecord.__table__

_FINISHED = (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)
_ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
# Concurrent save_model calls for one family may pick the same next version on Postgres;
# the unique (family_key, version) constraint rejects all but one, and the others retry.
_SAVE_MODEL_ATTEMPTS = 5
log = logging.getLogger("farm.db")

_P = ParamSpec("_P")
_T = TypeVar("_T")
_Method = Callable[Concatenate["SQLResultStore", _P], _T]


def _through_outages(idempotent: bool = True) -> Callable[[_Method[_P, _T]], _Method[_P, _T]]:
    """Run the decorated method through its store's Outage: the whole method (each is one
    transaction, or reads) is called again while the database is unavailable. `idempotent=False`
    for writes that would do harm if applied twice (see db.outage.CommitOutcomeUnknown)."""

    def decorate(method: _Method[_P, _T]) -> _Method[_P, _T]:
        @functools.wraps(method)
        def call(self: SQLResultStore, *args: _P.args, **kwargs: _P.kwargs) -> _T:
            return self._outage.call(lambda: method(self, *args, **kwargs), f"store.{method.__name__}",
                                     idempotent=idempotent)

        return call

    return decorate


class SQLResultStore(ResultStore):
    """A `ResultStore` in a SQL database: SQLite (embedded) or Postgres (cluster).

    Dialect differences stay inside: SQLite write transactions take the database's write
    lock at BEGIN (BEGIN IMMEDIATE), Postgres claims jobs with FOR UPDATE SKIP LOCKED.
    It assumes the schema is current: use `open_store`, which migrates first.
    """

    def __init__(
        self, url: str | None = None, *, pool_size: int | None = None, max_overflow: int | None = None
    ) -> None:
        """`url` as for `make_engine`; resolved now, so a pickled copy opens the same database.

        FarmError for an in-memory SQLite database, which other connections cannot see.
        """
        resolved = resolve_url(url)
        if resolved.get_backend_name() == "sqlite" and resolved.database in (None, "", ":memory:"):
            raise FarmError("an in-memory SQLite database cannot hold the farm's results: use sqlite:///PATH")
        self.url = resolved.render_as_string(hide_password=False)
        self._pool_size = pool_size
        self._max_overflow = max_overflow
        self._init_engine_state()

    def _init_engine_state(self, outage_bound: float | None = None) -> None:
        self._outage = Outage(display_url(self.url), outage_bound)  # shared by this store's writers
        self._engine: Engine | None = None
        self._writing: Engine | None = None
        self._pid = 0
        self._engine_lock = threading.Lock()
        self._listener: Any = None  # psycopg2 connection LISTENing for trial notifications
        self._listen_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "pool_size": self._pool_size, "max_overflow": self._max_overflow,
                "outage_bound": self._outage.bound}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self._pool_size = state["pool_size"]
        self._max_overflow = state["max_overflow"]
        self._init_engine_state(state["outage_bound"])

    def __repr__(self) -> str:
        return f"SQLResultStore({display_url(self.url)!r})"

    @property
    def engine(self) -> Engine:
        """The store's engine, built on first use in this process."""
        return self._engines()[0]

    def _engines(self) -> tuple[Engine, Engine]:
        with self._engine_lock:
            if self._engine is not None and self._pid != os.getpid():
                # Forked: the parent's connections are not ours to use, nor to close.
                self._engine.dispose(close=False)
                self._engine = None
            if self._engine is None:
                self._engine = make_engine(self.url, pool_size=self._pool_size, max_overflow=self._max_overflow)
                self._writing = for_writing(self._engine)
                self._pid = os.getpid()
            assert self._writing is not None
            return self._engine, self._writing

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._engines()[0].begin() as connection:
            yield connection

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        committing = False
        try:
            with self._engines()[1].begin() as connection:
                yield connection
                committing = True
        except DBAPIError as e:
            if committing and is_unavailable(e):
                raise CommitOutcomeUnknown(first_line(e)) from e
            raise

    def close(self) -> None:
        with self._engine_lock:
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
            self._engine = self._writing = None
        with self._listen_lock:
            if self._listener is not None and self._pid == os.getpid():
                self._listener.close()
            self._listener = None

    # Jobs -------------------------------------------------------------------------------

    @_through_outages(idempotent=False)
    def create_job(
        self, name: str, spec: dict[str, Any], trials_budget: int, search: str, tasks: list[dict[str, Any]]
    ) -> int:
        if not tasks:
            raise ValueError("a job needs at least one task")
        rows = [_task_row(task) for task in tasks]
        now = utcnow()
        with self._write() as connection:
            job_id = connection.execute(
                insert(_JOBS).values(
                    name=name,
                    status=JobStatus.QUEUED.value,
                    spec=spec,
                    trials_budget=trials_budget,
                    search=search,
                    created_at=now,
                    error="",
                )
            ).inserted_primary_key[0]
            connection.execute(insert(_TASKS), [{**row, "job_id": job_id, "created_at": now} for row in rows])
        return int(job_id)

    @_through_outages(idempotent=False)
    def claim_job(self, scheduler_id: str, job_id: int | None = None) -> int | None:
        # One statement on both dialects. On Postgres the subquery locks the row it picks and
        # skips rows other claimers hold; SQLite renders no FOR UPDATE, and BEGIN IMMEDIATE
        # makes claims run one at a time instead. status = 'queued' is checked again on update.
        target: Any = job_id
        if job_id is None:
            target = (
                select(_JOBS.c.id)
                .where(_JOBS.c.status == JobStatus.QUEUED.value)
                .order_by(_JOBS.c.id)
                .limit(1)
                .with_for_update(skip_locked=True)
                .scalar_subquery()
            )
        now = utcnow()
        claim = (
            update(_JOBS)
            .where(_JOBS.c.id == target, _JOBS.c.status == JobStatus.QUEUED.value)
            .values(status=JobStatus.RUNNING.value, claimed_by=scheduler_id, started_at=now, heartbeat_at=now)
            .returning(_JOBS.c.id)
        )
        with self._write() as connection:
            return connection.execute(claim).scalar_one_or_none()

    def wait_for_trials(self, job_id: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            engine = self.engine
            if engine.dialect.name != "postgresql":
                time.sleep(timeout)
                return True
            return self._listen(engine, job_id, deadline)
        except Exception as e:
            if not is_unavailable(e):
                raise
            # The caller polls the job next, and that call rides out the outage (Outage).
            log.debug("waiting for trials without LISTEN: %s", first_line(e))
            with self._listen_lock:
                if self._listener is not None:  # it broke: LISTEN on a new one next time
                    self._listener.close()
                self._listener = None
            time.sleep(max(0.0, deadline - time.monotonic()))
            return True

    def _listen(self, engine: Engine, job_id: int, deadline: float) -> bool:
        """`wait_for_trials` on Postgres: LISTEN until `deadline` (monotonic) for the job's NOTIFY."""
        with self._listen_lock:
            if self._listener is None or self._listener.closed:
                # A connection of its own, outside the pool: it stays LISTENing.
                cargs, cparams = engine.dialect.create_connect_args(engine.url)
                self._listener = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
                self._listener.set_session(autocommit=True)
                with self._listener.cursor() as cursor:
                    cursor.execute(f"LISTEN {NOTIFY_CHANNEL}")
            listener = self._listener
        while True:
            listener.poll()
            while listener.notifies:
                if listener.notifies.pop(0).payload == str(job_id):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            io_select.select([listener], [], [], left)

    @_through_outages()
    def requeue_stale(self, seconds: float) -> list[int]:
        cutoff = utcnow() - timedelta(seconds=seconds)
        statement = (
            update(_JOBS)
            .where(_JOBS.c.status == JobStatus.RUNNING.value, _JOBS.c.heartbeat_at < cutoff)
            .values(status=JobStatus.QUEUED.value, claimed_by=None)
            .returning(_JOBS.c.id)
        )
        with self._write() as connection:
            if connection.dialect.name == "postgresql":
                statement = statement.where(func.pg_postmaster_start_time() < cutoff)
            return list(connection.execute(statement).scalars())

    @_through_outages()
    def give_back(self, job_id: int, scheduler_id: str) -> bool:
        statement = (
            update(_JOBS)
            .where(_JOBS.c.id == job_id, _JOBS.c.status == JobStatus.RUNNING.value,
                   _JOBS.c.claimed_by == scheduler_id)
            .values(status=JobStatus.QUEUED.value, claimed_by=None)
        )
        with self._write() as connection:
            return connection.execute(statement).rowcount == 1

    @_through_outages()
    def heartbeat(self, job_id: int, scheduler_id: str) -> bool:
        statement = (
            update(_JOBS)
            .where(
                _JOBS.c.id == job_id,
                _JOBS.c.claimed_by == scheduler_id,
                _JOBS.c.status == JobStatus.RUNNING.value,
            )
            .values(heartbeat_at=utcnow())
        )
        with self._write() as connection:
            return connection.execute(statement).rowcount == 1

    @_through_outages()
    def finish_job(self, job_id: int, status: str, error: str = "", scheduler_id: str | None = None) -> bool:
        if status not in _FINISHED:
            raise ValueError(f"finish_job: status must be one of {', '.join(_FINISHED)}, got {status!r}")
        return self._finish(job_id, JobStatus(status), error, scheduler_id)

    @_through_outages()
    def cancel_job(self, job_id: int) -> bool:
        return self._finish(job_id, JobStatus.CANCELLED, "")

    def _finish(self, job_id: int, status: JobStatus, error: str, scheduler_id: str | None = None) -> bool:
        statement = (
            update(_JOBS)
            .where(_JOBS.c.id == job_id, _JOBS.c.status.in_([s.value for s in _ACTIVE]))
            .values(status=status.value, error=error, finished_at=utcnow())
        )
        if scheduler_id is not None:
            statement = statement.where(_JOBS.c.claimed_by == scheduler_id)
        with self._write() as connection:
            return connection.execute(statement).rowcount == 1

    @_through_outages()
    def job(self, job_id: int) -> dict[str, Any] | None:
        with self._read() as connection:
            row = connection.execute(select(_JOBS).where(_JOBS.c.id == job_id)).first()
            if row is None:
                return None
            tasks = [_dict(task) for task in connection.execute(_tasks_of(job_id))]
            stats = connection.execute(
                select(_TRIALS.c.task_id, _TRIALS.c.status, func.count(), func.min(_TRIALS.c.latency))
                .where(_TRIALS.c.task_id.in_(select(_TASKS.c.id).where(_TASKS.c.job_id == job_id)))
                .group_by(_TRIALS.c.task_id, _TRIALS.c.status)
            ).all()
            reused = set(connection.execute(
                select(_TRIALS.c.task_id).distinct()
                .where(_TRIALS.c.task_id.in_(select(_TASKS.c.id).where(_TASKS.c.job_id == job_id)),
                       _TRIALS.c.origin == "reused")
            ).scalars())
        by_task: dict[int, dict[str, Any]] = {
            task["id"]: {"counts": {}, "trials": 0, "best_latency": None, "reused": task["id"] in reused}
            for task in tasks
        }
        for task_id, status, count, fastest in stats:
            summary = by_task[task_id]
            summary["counts"][status] = count
            summary["trials"] += count
            if status == Status.OK.value and fastest is not None:
                summary["best_latency"] = fastest
        for task in tasks:
            task.update(by_task[task["id"]])
        return {**_dict(row), "tasks": tasks, "trials": sum(task["trials"] for task in tasks)}

    @_through_outages()
    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        counts = (
            select(_TASKS.c.job_id, func.count(_TRIALS.c.id).label("trials"))
            .join(_TRIALS, _TRIALS.c.task_id == _TASKS.c.id)
            .group_by(_TASKS.c.job_id)
            .subquery()
        )
        statement = (
            select(_JOBS, func.coalesce(counts.c.trials, 0).label("trials"))
            .outerjoin(counts, counts.c.job_id == _JOBS.c.id)
            .order_by(_JOBS.c.id.desc())
            .limit(limit)
        )
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(statement)]

    @_through_outages()
    def job_counts(self) -> dict[str, int]:
        with self._read() as connection:
            rows = connection.execute(select(_JOBS.c.status, func.count()).group_by(_JOBS.c.status)).all()
        return {str(status): int(count) for status, count in rows}

    @_through_outages()
    def job_status(self, job_id: int) -> str:
        with self._read() as connection:
            status = connection.execute(select(_JOBS.c.status).where(_JOBS.c.id == job_id)).scalar()
        if status is None:
            raise FarmError(f"no job {job_id} in {self!r}; `farm jobs` lists the jobs")
        return status

    @_through_outages()
    def tasks(self, job_id: int) -> list[dict[str, Any]]:
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(_tasks_of(job_id))]

    @_through_outages()
    def set_task_budget(self, task_id: int, budget: int) -> None:
        with self._write() as connection:
            connection.execute(update(_TASKS).where(_TASKS.c.id == task_id).values(budget=budget))

    @_through_outages()
    def prior_best(self, workload_key: str, target_kind: str, exclude_job: int | None = None) -> list[dict[str, Any]]:
        fastest = (
            select(_TRIALS.c.task_id, func.min(_TRIALS.c.latency).label("latency"))
            .join_from(_TRIALS, _TASKS, _TRIALS.c.task_id == _TASKS.c.id)
            .where(_TASKS.c.workload_key == workload_key, _TASKS.c.target_kind == target_kind,
                   _TASKS.c.job_id != (-1 if exclude_job is None else exclude_job),
                   _TRIALS.c.status == Status.OK.value, _TRIALS.c.latency.is_not(None))
            .group_by(_TRIALS.c.task_id)
            .subquery()
        )
        task_columns = (_TASKS.c.job_id, _TASKS.c.target, _TASKS.c.template, _TASKS.c.template_version,
                        _TASKS.c.workload)
        statement = (
            _trials_select().add_columns(*task_columns)
            .join(fastest, (fastest.c.task_id == _TRIALS.c.task_id) & (fastest.c.latency == _TRIALS.c.latency))
            .where(_TRIALS.c.status == Status.OK.value)
            .order_by(_TRIALS.c.latency, _TRIALS.c.id)
        )
        with self._read() as connection:
            rows = [_dict(row) for row in connection.execute(statement)]
        seen: set[int] = set()  # one per task (two trials of a task may tie)
        return [row for row in rows if not (row["task_id"] in seen or seen.add(row["task_id"]))]

    # Trials -----------------------------------------------------------------------------

    @_through_outages()
    def measured(self, task_id: int) -> dict[int, float | None]:
        with self._read() as connection:
            rows = connection.execute(select(_TRIALS.c.config_index, _TRIALS.c.status, _TRIALS.c.latency)
                                      .where(_TRIALS.c.task_id == task_id))
            return {int(index): latency if status == "ok" else None for index, status, latency in rows}

    @_through_outages()
    def trial_count(self, task_id: int) -> int:
        with self._read() as connection:
            return connection.execute(
                select(func.count()).select_from(_TRIALS).where(_TRIALS.c.task_id == task_id)
            ).scalar_one()

    @_through_outages()
    def trials(self, job_id: int | None = None, task_id: int | None = None) -> pd.DataFrame:
        statement = _trials_select()
        if job_id is not None:
            statement = statement.where(_TASKS.c.job_id == job_id)
        if task_id is not None:
            statement = statement.where(_TRIALS.c.task_id == task_id)
        with self._read() as connection:
            rows = connection.execute(statement.order_by(_TRIALS.c.id)).all()
        return _frame(rows, TRIAL_COLUMNS)

    @_through_outages()
    def best(self, task_id: int, k: int = 1) -> list[dict[str, Any]]:
        statement = (
            _trials_select()
            .where(
                _TRIALS.c.task_id == task_id,
                _TRIALS.c.status == Status.OK.value,
                _TRIALS.c.latency.is_not(None),
            )
            .order_by(_TRIALS.c.latency, _TRIALS.c.id)
            .limit(k)
        )
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(statement)]

    def trial_activity(self, since: datetime, job_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        keys = (_TASKS.c.job_id, _TRIALS.c.worker, _TRIALS.c.status)
        statement = (
            select(*keys, func.count().label("trials"), func.max(_TRIALS.c.created_at).label("last_at"))
            .join_from(_TRIALS, _TASKS, _TRIALS.c.task_id == _TASKS.c.id)
            .where(_TRIALS.c.created_at >= since)
            .group_by(*keys)
            .order_by(*keys)
        )
        if job_ids is not None:
            statement = statement.where(_TASKS.c.job_id.in_(list(job_ids)))
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(statement)]

    def writer(self, batch_size: int = 256, flush_seconds: float | None = 0.5) -> ResultWriter:
        return ResultWriter(self.engine, batch_size=batch_size, flush_seconds=flush_seconds, outage=self._outage)

    # Rounds and cost models -------------------------------------------------------------

    @_through_outages()
    def add_round(self, task_id: int, round: int, trials: int, best_latency: float | None,
                  rank_corr: float | None = None, model_id: int | None = None) -> None:
        engine = self.engine
        values = {"trials": trials, "best_latency": best_latency, "rank_corr": rank_corr, "model_id": model_id}
        statement = (
            dialect_insert(engine, _ROUNDS)
            .values(task_id=task_id, round=round, created_at=utcnow(), **values)
            .on_conflict_do_update(index_elements=["task_id", "round"], set_=values)
        )
        with self._write() as connection:
            connection.execute(statement)

    @_through_outages()
    def rounds(self, task_id: int) -> list[dict[str, Any]]:
        statement = select(_ROUNDS).where(_ROUNDS.c.task_id == task_id).order_by(_ROUNDS.c.round)
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(statement)]

    @_through_outages(idempotent=False)
    def save_model(self, family_key: str, task_id: int | None, model: bytes, feature_names: Sequence[str],
                   training_rows: int, training_seconds: float) -> int:
        next_version = (
            select(func.coalesce(func.max(_MODELS.c.version), 0) + 1)
            .where(_MODELS.c.family_key == family_key)
            .scalar_subquery()
        )
        statement = insert(_MODELS).values(
            family_key=family_key,
            task_id=task_id,
            version=next_version,
            model=bytes(model),
            feature_names=list(feature_names),
            training_rows=training_rows,
            training_seconds=training_seconds,
            created_at=utcnow(),
        )
        attempt = 1
        while True:
            try:
                with self._write() as connection:
                    return int(connection.execute(statement).inserted_primary_key[0])
            except IntegrityError:
                if attempt == _SAVE_MODEL_ATTEMPTS:
                    raise
                attempt += 1

    @_through_outages()
    def latest_model(self, family_key: str) -> dict[str, Any] | None:
        statement = (
            select(_MODELS).where(_MODELS.c.family_key == family_key).order_by(_MODELS.c.version.desc()).limit(1)
        )
        with self._read() as connection:
            row = connection.execute(statement).first()
        if row is None:
            return None
        found = _dict(row)
        found["model"] = bytes(found["model"])  # some drivers return a memoryview
        return found

    @_through_outages()
    def set_model_rank_corr(self, model_id: int, value: float) -> None:
        statement = update(_MODELS).where(_MODELS.c.id == model_id).values(rank_corr=value)
        with self._write() as connection:
            if connection.execute(statement).rowcount != 1:
                raise KeyError(f"no cost model {model_id}")

    @_through_outages()
    def trials_for_family(self, family_key: str, limit: int | None = None) -> pd.DataFrame:
        statement = (
            _trials_select()
            .add_columns(_TASKS.c.workload)
            .where(_TASKS.c.family_key == family_key)
            .order_by(_TRIALS.c.id.desc())
            .limit(limit)
        )
        with self._read() as connection:
            rows = connection.execute(statement).all()
        rows.reverse()
        frame = _frame([row[:-1] for row in rows], TRIAL_COLUMNS)
        frame["params"] = [row.workload["params"] for row in rows]
        return frame

    # Exports and workers ----------------------------------------------------------------

    @_through_outages(idempotent=False)
    def add_export(self, job_id: int, format: str, path: str, records: int) -> int:
        statement = insert(_EXPORTS).values(
            job_id=job_id, format=format, path=path, records=records, created_at=utcnow()
        )
        with self._write() as connection:
            return int(connection.execute(statement).inserted_primary_key[0])

    @_through_outages()
    def register_worker(self, name: str, host: str, device: str, rpc_key: str, status: str = "idle") -> int:
        now = utcnow()
        values = {
            "host": host,
            "device": device,
            "rpc_key": rpc_key,
            "status": status,
            "started_at": now,
            "last_seen_at": now,
        }
        statement = (
            dialect_insert(self.engine, _WORKERS)
            .values(name=name, **values)
            .on_conflict_do_update(index_elements=["name"], set_=values)
            .returning(_WORKERS.c.id)
        )
        with self._write() as connection:
            return int(connection.execute(statement).scalar_one())

    @_through_outages()
    def worker_seen(self, name: str, status: str) -> None:
        statement = update(_WORKERS).where(_WORKERS.c.name == name).values(status=status, last_seen_at=utcnow())
        with self._write() as connection:
            if connection.execute(statement).rowcount != 1:
                raise KeyError(f"no worker named {name!r}; register_worker first")

    @_through_outages()
    def workers(self) -> list[dict[str, Any]]:
        with self._read() as connection:
            return [_dict(row) for row in connection.execute(select(_WORKERS).order_by(_WORKERS.c.name))]


def _task_row(task: dict[str, Any]) -> dict[str, Any]:
    missing = [key for key in TASK_KEYS if key not in task]
    unknown = sorted(set(task) - set(TASK_KEYS) - set(TASK_DEFAULTS))
    if missing or unknown:
        raise ValueError(f"task dict: missing keys {missing}, unknown keys {unknown}; expected {TASK_KEYS}")
    return {**TASK_DEFAULTS, **{key: task[key] for key in (*TASK_KEYS, *TASK_DEFAULTS) if key in task}}


def _tasks_of(job_id: int) -> Select[Any]:
    return select(_TASKS).where(_TASKS.c.job_id == job_id).order_by(_TASKS.c.id)


def _trials_select() -> Select[Any]:
    columns = [_TASKS.c.workload_key if name == "workload_key" else _TRIALS.c[name] for name in TRIAL_COLUMNS]
    return select(*columns).join_from(_TRIALS, _TASKS, _TRIALS.c.task_id == _TASKS.c.id)


def _dict(row: Row[Any]) -> dict[str, Any]:
    return dict(row._mapping)


def _frame(rows: Sequence[Row[Any]] | Sequence[tuple[Any, ...]], columns: Sequence[str]) -> pd.DataFrame:
    import pandas as pd  # here: pandas takes a third of a second to import, and `farm submit` needs none

    frame = pd.DataFrame([tuple(row) for row in rows], columns=list(columns))
    # A column of None (no ok trial yet) would otherwise be of dtype object.
    frame["latency"] = frame["latency"].astype("float64")
    return frame
