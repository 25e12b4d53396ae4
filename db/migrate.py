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
from sqlalchemy import Connection, Engine, func, inspect, select
from sqlalchemy.exc import DBAPIError

from db.engine import display_url, for_writing, make_engine, resolve_url
from farm.core.errors import FarmError, brief, one_line

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
    disposed of. Raises FarmError if the database cannot be opened, is at a revision this farm
    does not know (`check_revision`), or cannot be migrated (saying to run `farm db upgrade` as a
    user allowed to change the schema).
    """
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with for_writing(engine).begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            revision = check_revision(connection)
            if revision == head():
                return
            try:
                command.upgrade(alembic_config(connection), "head")
            except DBAPIError as e:  # e.g. a database user who may not create tables
                reason = one_line(e.orig if e.orig is not None else e).partition(": ")[2]
                raise FarmError(
                    f"cannot migrate the database at {display_url(engine.url)} from schema {revision or 'empty'} to "
                    f"{head()}: {reason}; run `farm db upgrade --db URL` as a database user allowed to change "
                    "the schema") from None
    finally:
        if engine is not url:
            engine.dispose()


def check_revision(connection: Connection) -> str | None:
    """The database's schema revision (None: never migrated), if this farm can work with it.

    FarmError, one line, when the revision is not one of db/migrations' (the database was written
    by a newer farm, whose migrations this one does not have), or when the database holds the
    farm's tables but no revision (not made by `farm db upgrade`).
    """
    revision = MigrationContext.configure(connection).get_current_revision()
    url = display_url(connection.engine.url)
    if revision is None:
        if "jobs" in inspect(connection).get_table_names():
            raise FarmError(f"the database at {url} holds a jobs table but no farm schema revision: it was not "
                            "made by `farm db upgrade`; give the farm an empty database or one it made")
        return None
    known = {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if revision not in known:
        raise FarmError(f"the database at {url} is at schema revision {brief(revision)}, which this farm does "
                        f"not know: it was written by a newer farm (this one's newest is {head()}); upgrade the farm")
    return revision


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
