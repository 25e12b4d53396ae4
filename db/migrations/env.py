"""Alembic's entry point. `db.migrate` hands it an open connection in a transaction.

Run migrations through `db.migrate.upgrade(url)` (or ``python -m db.migrate``), which
serializes concurrent upgrades; the alembic command line has no URL to connect to here.
"""

from __future__ import annotations

from alembic import context

from db.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with db.migrate.upgrade(url) or `python -m db.migrate --db URL`")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things; batch mode recreates the table instead.
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
