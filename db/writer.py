"""Batched, idempotent writes of measurement results: `ResultWriter`."""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from types import TracebackType
from typing import Any

from sqlalchemy import Engine, Text, cast, func, select

from db.engine import dialect_insert, display_url, for_writing
from db.models import TaskRecord, TrialRecord, utcnow
from db.outage import Outage, first_line
from farm.core import metrics
from farm.core.measure import MeasureResult, Status

# Postgres channel on which every flush that stored trials announces the ids of their jobs.
NOTIFY_CHANNEL = "farm_trials"

_TRIALS = TrialRecord.__table__
_TASKS = TaskRecord.__table__
log = logging.getLogger(__name__)


def trial_row(task_id: int, result: MeasureResult, created_at: datetime) -> dict[str, Any]:
    """The `trials` row for `result` (its `latency` is MeasureResult.latency: the median, only when ok)."""
    status = Status(result.status)  # also accepts the plain string, and rejects unknown ones
    latencies = [float(value) for value in result.latencies]
    return {
        "task_id": int(task_id),
        "config_index": int(result.config_index),
        "config": result.config,
        "status": status.value,
        "error": result.error,
        "latencies": latencies,
        "latency": result.latency,
        "build_seconds": float(result.build_seconds),
        "run_seconds": float(result.run_seconds),
        "device": result.device,
        "worker": result.worker,
        "shard": int(result.shard),
        "round": int(result.round),
        "timeline": result.timeline or None,
        "origin": result.origin or None,
        "created_at": created_at,
    }


class ResultWriter:
    """Buffers measurement results and stores them in batches, one transaction per flush.

    Contract:

    - `add` only appends to a buffer. The `add` that fills it to `batch_size` rows has it
      flushed at once: by the background thread when there is one (so `add` never waits for the
      database), else in the caller's thread.
    - With `flush_seconds`, a daemon thread (started by the first `add`) flushes whatever waits
      every `flush_seconds`, so a slow producer's results still arrive promptly.
    - Idempotent: ``INSERT ... ON CONFLICT (task_id, config_index) DO NOTHING``. A config
      already stored, by this writer or another, is skipped; retrying a batch is safe.
    - Outages: a flush that finds the database unavailable keeps its rows, in order, and tries
      again with backoff through `outage` (db.outage.Outage: the store's, shared with its other
      calls; default: one of the writer's own) for up to the outage bound, while `add` goes on
      buffering in memory. `flush` and `close` return once every row added before they were
      called is stored, or raise DatabaseUnavailable after the bound; any other failure is
      raised at once. Either way the rows stay buffered for the next flush; the background
      thread logs such a failure in one line and tries again at its next tick.
    - On Postgres, a flush that stored rows sends ``NOTIFY farm_trials, '<job id>'`` for each
      job concerned, in the same transaction, so listeners hear only of committed rows.
    - Thread-safe: producers and the background thread share it. Not picklable: create it
      in the process that produces the results (`ResultStore.writer`).
    """

    def __init__(self, engine: Engine, batch_size: int = 256, flush_seconds: float | None = 0.5,
                 outage: Outage | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if flush_seconds is not None and flush_seconds <= 0:
            raise ValueError(f"flush_seconds must be > 0 or None, got {flush_seconds}")
        self.batch_size = batch_size
        self.flush_seconds = flush_seconds
        self._engine = for_writing(engine)
        self._outage = outage or Outage(display_url(engine.url))
        self._rows: list[dict[str, Any]] = []
        self._in_flight = 0  # rows a flush has taken from the buffer and not stored yet
        self._inserted = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # the background thread's tick, or a full buffer
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the buffer and the fields above
        # Flushes run one at a time, so that when flush() returns, every row added before
        # it was called is stored, even rows another thread's flush had already taken.
        self._flush_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Rows added but not yet stored."""
        with self._lock:
            return len(self._rows) + self._in_flight

    @property
    def inserted(self) -> int:
        """Rows this writer has stored so far, by any flush (duplicates not counted)."""
        with self._lock:
            return self._inserted

    def record(self, task_id: int, result: MeasureResult) -> None:
        """Buffer `result` of task `task_id`; have the buffer flushed if it holds `batch_size` rows.

        Raises RuntimeError after `close`, ValueError for an unknown status.
        """
        row = trial_row(task_id, result, utcnow())
        with self._lock:
            if self._closed:
                raise RuntimeError("ResultWriter.record after close")
            self._rows.append(row)
            full = len(self._rows) >= self.batch_size
            if self.flush_seconds is not None and self._thread is None:
                self._thread = threading.Thread(target=self._flush_periodically, name="farm-result-writer", daemon=True)
                self._thread.start()
            background = self._thread is not None
        if full and background:
            self._wake.set()
        elif full:
            self.flush()

    def flush(self) -> int:
        """Store every buffered row in one transaction, riding out an outage (see the class
        docstring); return how many were new."""
        with self._flush_lock:
            if not self.pending:  # not through the outage: a call that reached no database ends none
                return 0
            return self._outage.call(self._flush_once, "storing results")

    def _flush_once(self) -> int:
        """One try of `flush`: the rows it took go back to the front of the buffer if it fails."""
        with self._lock:
            rows, self._rows = self._rows, []
            self._in_flight = len(rows)
        if not rows:
            return 0
        try:
            with metrics.db_write():
                inserted = self._insert(rows)
        except BaseException:
            with self._lock:
                self._rows[:0] = rows
                self._in_flight = 0
            raise
        with self._lock:
            self._inserted += inserted
            self._in_flight = 0
        return inserted

    def close(self) -> None:
        """Stop the background thread and flush. Later `add`s raise; calling it again retries."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None:
            thread.join()
        self.flush()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Flush even when the block failed: what was measured before the failure is valid.
        self.close()

    def _insert(self, rows: list[dict[str, Any]]) -> int:
        # One statement executed with many parameter sets: SQLAlchemy compiles it once (cached)
        # and sends multi-row VALUES pages ("insertmanyvalues"); RETURNING counts what was new.
        statement = (
            dialect_insert(self._engine, _TRIALS)
            .on_conflict_do_nothing(index_elements=["task_id", "config_index"])
            .returning(_TRIALS.c.id)
        )
        with self._engine.begin() as connection:
            inserted = len(connection.execute(statement, rows).all())
            if inserted and connection.dialect.name == "postgresql":
                task_ids = sorted({row["task_id"] for row in rows})
                jobs = select(_TASKS.c.job_id).where(_TASKS.c.id.in_(task_ids)).distinct().subquery()
                connection.execute(select(func.pg_notify(NOTIFY_CHANNEL, cast(jobs.c.job_id, Text))))
        return inserted

    def _flush_periodically(self) -> None:
        assert self.flush_seconds is not None
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            if self._stop.is_set():  # close() flushes what is left
                return
            try:
                self.flush()
            except Exception as e:  # kept for the next tick; an outage was logged by the Outage
                log.warning("storing %d results failed, retrying in %g s: %s", self.pending, self.flush_seconds,
                            first_line(e))
