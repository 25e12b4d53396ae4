"""The farm's tables as SQLAlchemy 2.0 typed models.

These classes are the schema's source of truth for code; `db/migrations` creates it in a
database, and a test checks that the two agree. Timestamps are timezone-aware UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from farm.core.measure import Status

# Deterministic constraint names, so that migrations (and SQLite's batch mode, which
# recreates tables) can refer to constraints by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRIAL_STATUSES = tuple(status.value for status in Status)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware.

    SQLite keeps no zone and Postgres answers in the session's zone; this makes both
    return UTC, and refuses naive datetimes, whose zone nobody knows.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({quoted})"


class JobRecord(Base):
    """A submitted tuning request; a scheduler claims it (queued → running) and finishes it."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("status", tuple(JobStatus)), name="status"),
        Index(None, "status", "id"),  # claim_job: the oldest queued job
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    # The request as submitted: workloads, target, trials budget, search, workers, seed, options.
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    trials_budget: Mapped[int] = mapped_column(Integer)
    search: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    claimed_by: Mapped[str | None] = mapped_column(String(200))  # the scheduler's id
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str] = mapped_column(Text, default="")


class TaskRecord(Base):
    """One workload on one target within a job, with its template and config-space size."""

    __tablename__ = "tasks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    workload: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"name": ..., "params": {...}}
    workload_key: Mapped[str] = mapped_column(Text)  # canonical JSON of `workload`
    target: Mapped[dict[str, Any]] = mapped_column(JSON)
    target_kind: Mapped[str] = mapped_column(String(32))
    template: Mapped[str] = mapped_column(String(100))
    template_version: Mapped[str] = mapped_column(String(50))
    space_size: Mapped[int] = mapped_column(BigInteger)  # spaces reach 1.8e10 configs
    budget: Mapped[int] = mapped_column(Integer)
    # Calls of the kernel per inference of the model it came from (1 for a kernel tuned on its own).
    weight: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # template@version + target kind + workload name: tasks whose measurements train one cost model.
    family_key: Mapped[str] = mapped_column(String(300), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TrialRecord(Base):
    """One measured config of a task. A config is stored at most once per task."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("task_id", "config_index"),
        CheckConstraint(_in("status", TRIAL_STATUSES), name="status"),
        Index(None, "task_id", "latency"),  # best(): the fastest trials of a task
    )

    # SQLite only autoincrements a column declared INTEGER PRIMARY KEY (64-bit anyway).
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    config_index: Mapped[int] = mapped_column(BigInteger)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str] = mapped_column(Text, default="")
    latencies: Mapped[list[float]] = mapped_column(JSON)  # seconds, one per repeat
    latency: Mapped[float | None] = mapped_column(Float)  # median seconds; null unless ok
    build_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    device: Mapped[str] = mapped_column(String(200), default="")
    worker: Mapped[str] = mapped_column(String(200), default="")
    shard: Mapped[int] = mapped_column(Integer, default=0)
    round: Mapped[int] = mapped_column(Integer, default=0)
    # farm.core.measure.MeasureResult.timeline: epoch seconds of build and measurement steps
    timeline: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # farm.core.measure.MeasureResult.origin: what proposed the config; null where unknown
    origin: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class RoundRecord(Base):
    """Progress of a task after one search round, and the cost model that guided it."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("task_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    trials: Mapped[int] = mapped_column(Integer)  # trials of the task so far
    best_latency: Mapped[float | None] = mapped_column(Float)
    rank_corr: Mapped[float | None] = mapped_column(Float)
    model_id: Mapped[int | None] = mapped_column(ForeignKey("cost_models.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class CostModelRecord(Base):
    """A trained XGBoost cost model, as UBJSON bytes (never a pickle), versioned per family."""

    __tablename__ = "cost_models"
    __table_args__ = (UniqueConstraint("family_key", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    family_key: Mapped[str] = mapped_column(String(300))
    task_id: Mapped[int | None] = mapped_column(ForeignKey("tasks.id", ondelete="SET NULL"))
    version: Mapped[int] = mapped_column(Integer)
    model: Mapped[bytes] = mapped_column(LargeBinary)
    feature_names: Mapped[list[str]] = mapped_column(JSON)
    training_rows: Mapped[int] = mapped_column(Integer)
    training_seconds: Mapped[float] = mapped_column(Float)
    # Spearman correlation of its predictions with the next round's measurements.
    rank_corr: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ExportRecord(Base):
    """A best-config export written for a job."""

    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    format: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    records: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WorkerRecord(Base):
    """A GPU worker (one Ray actor per device) and when it was last heard from."""

    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    host: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(200))
    rpc_key: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
