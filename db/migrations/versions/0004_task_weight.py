"""Tasks keep their weight: how many times a model calls the kernel per inference (1 for a kernel
tuned on its own), which the model's latency and the job's budget across tasks are weighed by.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("weight", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("weight")
