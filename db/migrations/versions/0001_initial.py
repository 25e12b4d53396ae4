"""The initial schema: jobs, tasks, trials, rounds, cost_models, exports, workers.

A migration is a frozen snapshot: it spells its types out instead of importing
db.models, so that later model changes cannot alter what it creates.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("trials_budget", sa.Integer(), nullable=False),
        sa.Column("search", sa.String(length=32), nullable=False),
        _timestamp("created_at"),
        _timestamp("started_at", nullable=True),
        _timestamp("finished_at", nullable=True),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        _timestamp("heartbeat_at", nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed', 'cancelled')",
            name=op.f("ck_jobs_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_status_id"), "jobs", ["status", "id"])

    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=200), nullable=False),
        sa.Column("device", sa.String(length=200), nullable=False),
        sa.Column("rpc_key", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        _timestamp("started_at"),
        _timestamp("last_seen_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("name", name=op.f("uq_workers_name")),
    )

    op.create_table(
        "exports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_exports_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exports")),
    )
    op.create_index(op.f("ix_exports_job_id"), "exports", ["job_id"])

    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("workload", sa.JSON(), nullable=False),
        sa.Column("workload_key", sa.Text(), nullable=False),
        sa.Column("target", sa.JSON(), nullable=False),
        sa.Column("target_kind", sa.String(length=32), nullable=False),
        sa.Column("template", sa.String(length=100), nullable=False),
        sa.Column("template_version", sa.String(length=50), nullable=False),
        sa.Column("space_size", sa.BigInteger(), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("family_key", sa.String(length=300), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_tasks_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
    )
    op.create_index(op.f("ix_tasks_family_key"), "tasks", ["family_key"])
    op.create_index(op.f("ix_tasks_job_id"), "tasks", ["job_id"])

    op.create_table(
        "cost_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("family_key", sa.String(length=300), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("model", sa.LargeBinary(), nullable=False),
        sa.Column("feature_names", sa.JSON(), nullable=False),
        sa.Column("training_rows", sa.Integer(), nullable=False),
        sa.Column("training_seconds", sa.Float(), nullable=False),
        sa.Column("rank_corr", sa.Float(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_cost_models_task_id_tasks"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cost_models")),
        sa.UniqueConstraint("family_key", "version", name=op.f("uq_cost_models_family_key_version")),
    )

    op.create_table(
        "trials",
        # SQLite only autoincrements a column declared INTEGER PRIMARY KEY (64-bit anyway).
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("config_index", sa.BigInteger(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("latencies", sa.JSON(), nullable=False),
        sa.Column("latency", sa.Float(), nullable=True),
        sa.Column("build_seconds", sa.Float(), nullable=False),
        sa.Column("run_seconds", sa.Float(), nullable=False),
        sa.Column("device", sa.String(length=200), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        sa.CheckConstraint(
            "status IN ('ok', 'build_error', 'invalid', 'runtime_error', 'timeout', 'wrong_result')",
            name=op.f("ck_trials_status"),
        ),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name=op.f("fk_trials_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trials")),
        sa.UniqueConstraint("task_id", "config_index", name=op.f("uq_trials_task_id_config_index")),
    )
    op.create_index(op.f("ix_trials_task_id_latency"), "trials", ["task_id", "latency"])

    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("best_latency", sa.Float(), nullable=True),
        sa.Column("rank_corr", sa.Float(), nullable=True),
        sa.Column("model_id", sa.Integer(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["cost_models.id"],
            name=op.f("fk_rounds_model_id_cost_models"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name=op.f("fk_rounds_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rounds")),
        sa.UniqueConstraint("task_id", "round", name=op.f("uq_rounds_task_id_round")),
    )


def downgrade() -> None:
    for table in ("rounds", "trials", "cost_models", "tasks", "exports", "workers", "jobs"):
        op.drop_table(table)
