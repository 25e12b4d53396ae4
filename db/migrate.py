"""Schema migrations run from code: `upgrade(url)` brings a database to the newest schema.

Every process that opens a store calls `upgrade` at start; it is a no-op on an up-to-date
database and safe when several processes start at once (see `upgrade`). A schema change
is a new file in ``db/migrations/versions/`` whose ``down_revision`` is the current head,
with the same change made in `db.models`; the migrations-match-models test checks both.

Command line: ``python -m db.migrate [--db URL]`` upgrades and prints the revision.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, func, select

from db.engine import for_writing, make_engine, resolve_url
from farm.core.errors import FarmError

MIGRATIONS = Path(__file__).resolve().with_name("migrations")
# Postgres advisory lock held while migrating: arbitrary, fixed, and unique to the farm.
_MIGRATION_LOCK = 0x6661726D  # "farm"


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic configuration for db/migrations, without an alembic.ini.

    `connection` (if given) is the connection the migrations run on, within its transaction.
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def head() -> str:
    """The newest revision in db/migrations."""
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert revision is not None, "db/migrations/versions holds no revision"
    return revision


def upgrade(url: str | Engine | None = None) -> None:
    """Create or upgrade the schema at `url` (a URL for `make_engine`, or an open engine) to head.

    All migrations run in one transaction that first takes a lock (Postgres: an advisory
    lock; SQLite: BEGIN IMMEDIATE), so concurrent callers run them one after another and
    the later ones find nothing to do. An engine passed in is left open; one made here is
    disposed of. Raises FarmError if the database cannot be opened.
    """
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with for_writing(engine).begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            command.upgrade(alembic_config(connection), "head")
    finally:
        if engine is not url:
            engine.dispose()


def current(url: str | Engine | None = None) -> str | None:
    """The schema revision of the database at `url`, None if it has never been migrated."""
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        if engine is not url:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m db.migrate", description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: $FARM_DB, else sqlite:///farm.db)")
    args = parser.parse_args(argv)
    try:
        upgrade(args.db)
        revision = current(args.db)
    except FarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    display = resolve_url(args.db).render_as_string(hide_password=True)
    print(f"{display}: schema at revision {revision} (head {head()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
