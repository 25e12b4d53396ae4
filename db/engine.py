"""The one way to get a database engine: `make_engine(url)`.

URLs: ``None`` means ``$FARM_DB`` if set, else ``sqlite:///farm.db``; ``sqlite:///PATH`` is the
embedded default (one machine); ``postgresql://USER@HOST:PORT/DB`` is the cluster database.
Anything that cannot be opened raises `FarmError` with one line that says what to do.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from sqlalchemy import URL, Engine, Table, create_engine, event, make_url
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker

from db.outage import DatabaseUnavailable, first_line, is_unavailable
from farm.core.errors import FarmError

DEFAULT_URL = "sqlite:///farm.db"
ENV_URL = "FARM_DB"
# A file holding the Postgres password, read when the farm connects, so that the password is in
# no URL: not on a command line (`ps`), not in $FARM_DB, not in what a store pickles for Ray.
ENV_PASSWORD_FILE = "FARM_DB_PASSWORD_FILE"
ENV_POOL_SIZE = "FARM_DB_POOL_SIZE"
ENV_MAX_OVERFLOW = "FARM_DB_MAX_OVERFLOW"
# Every Ray actor owns an engine, so a small pool keeps N actors under Postgres'
# max_connections (100 by default): each engine holds at most pool_size + max_overflow.
DEFAULT_POOL_SIZE = 2
DEFAULT_MAX_OVERFLOW = 2
SQLITE_BUSY_TIMEOUT_MS = 5000
POSTGRES_CONNECT_TIMEOUT_S = 10

# SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; the farm ships psycopg2.
POSTGRES_DRIVER = "postgresql+psycopg2"
_HINT = "set --db or FARM_DB"
_USAGE = "use sqlite:///PATH or postgresql://USER@HOST:PORT/DB"
# Execution option read by the SQLite "begin" hook; see `for_writing`.
_BEGIN_IMMEDIATE = "farm_begin_immediate"


def resolve_url(url: str | URL | None) -> URL:
    """The URL the farm will open for `url`: the default applied and SQLite paths made absolute.

    An absolute path keeps a store that is pickled into a process with another working
    directory (a Ray actor) on the same file. Raises FarmError for malformed or unsupported URLs.
    """
    if url is None:
        url = os.environ.get(ENV_URL) or DEFAULT_URL
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise FarmError(f"bad database URL {str(url)!r}: {_USAGE}; {_HINT}") from None
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise FarmError(f"unsupported database {backend!r} in {display_url(parsed)}: {_USAGE}; {_HINT}")
    database = parsed.database or ""
    if backend == "sqlite" and database not in ("", ":memory:") and not parsed.query.get("uri"):
        parsed = parsed.set(database=os.path.abspath(database))
    return parsed


def make_engine(
    url: str | URL | None = None,
    *,
    pool_size: int | None = None,
    max_overflow: int | None = None,
) -> Engine:
    """Open the database at `url` (see `resolve_url`) and check that it answers.

    SQLite gets WAL (readers never block the writer), a 5 s busy timeout and foreign keys;
    its transactions begin with a plain BEGIN, or BEGIN IMMEDIATE on `for_writing(engine)`.
    Postgres gets a pool of `pool_size` (+ `max_overflow`) connections, from the arguments,
    else ``$FARM_DB_POOL_SIZE`` / ``$FARM_DB_MAX_OVERFLOW``, else 2 and 2, with pre-ping. Its
    password is the URL's, else the content of the file ``$FARM_DB_PASSWORD_FILE`` (read now, on
    every node that connects), else libpq's own (``$PGPASSWORD``, ``~/.pgpass``).
    Raises FarmError (one line, nothing created) if the database cannot be opened: its subclass
    DatabaseUnavailable when the server did not answer (a store retries those, see db.outage).
    """
    parsed = resolve_url(url)
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite_path(parsed)
        engine = _create(parsed, json_serializer=_json_dumps)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    else:
        connect_args: dict[str, Any] = {}
        if "connect_timeout" not in parsed.query:
            # An unreachable host would otherwise hang for minutes before failing.
            connect_args["connect_timeout"] = POSTGRES_CONNECT_TIMEOUT_S
        if "application_name" not in parsed.query:
            connect_args["application_name"] = "farm"
        driver = POSTGRES_DRIVER if parsed.drivername == "postgresql" else parsed.drivername
        engine = _create(
            _with_password_file(parsed).set(drivername=driver),
            json_serializer=_json_dumps,
            pool_size=_setting("pool_size", pool_size, ENV_POOL_SIZE, DEFAULT_POOL_SIZE, minimum=1),
            max_overflow=_setting("max_overflow", max_overflow, ENV_MAX_OVERFLOW, DEFAULT_MAX_OVERFLOW, minimum=0),
            pool_pre_ping=True,
            connect_args=connect_args,
        )
    try:
        with engine.connect():
            pass
    except DBAPIError as exc:
        engine.dispose()
        error = DatabaseUnavailable if is_unavailable(exc) else FarmError
        raise error(_connect_error(parsed, exc)) from None
    return engine


def _with_password_file(parsed: URL) -> URL:
    """`parsed` with the password from ``$FARM_DB_PASSWORD_FILE`` when it has none of its own."""
    path = os.environ.get(ENV_PASSWORD_FILE)
    if not path or parsed.password is not None:
        return parsed
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise FarmError(f"cannot read the database password from {ENV_PASSWORD_FILE}={path}: {reason}") from None
    if not password:
        raise FarmError(f"{ENV_PASSWORD_FILE}={path} is empty: put the database password in it")
    return parsed.set(password=password)


def for_writing(engine: Engine) -> Engine:
    """`engine` for transactions that write: on SQLite they begin with BEGIN IMMEDIATE.

    A deferred SQLite transaction that reads and then writes can fail at once with
    "database is locked" when another connection committed in between (the busy timeout
    does not apply to that upgrade); taking the write lock at BEGIN makes it wait instead.
    The returned engine shares `engine`'s pool. On Postgres it behaves like `engine`.
    """
    return engine.execution_options(**{_BEGIN_IMMEDIATE: True})


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """ORM sessions on `engine` that keep loaded objects usable after commit.

    Sessions usually write, so on SQLite their transactions begin with BEGIN IMMEDIATE
    (see `for_writing`); read-only code should prefer ``engine.connect()``.
    """
    return sessionmaker(for_writing(engine), expire_on_commit=False)


def dialect_insert(engine: Engine, table: Table) -> postgresql.Insert | sqlite.Insert:
    """An INSERT for `table` in `engine`'s dialect, which has ``on_conflict_do_*``."""
    if engine.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def _create(parsed: URL, **kwargs: Any) -> Engine:
    try:
        return create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ImportError) as exc:
        raise FarmError(
            f"cannot open {display_url(parsed)}: its driver is not installed ({first_line(exc)}); {_USAGE}"
        ) from None


def _check_sqlite_path(parsed: URL) -> None:
    """Refuse a file in a missing directory before sqlite3 is asked to create it."""
    database = parsed.database or ""
    if database in ("", ":memory:") or parsed.query.get("uri"):
        return
    directory = os.path.dirname(database)
    if not os.path.isdir(directory):
        raise FarmError(f"cannot open {display_url(parsed)}: directory {directory} does not exist; "
                        f"create it or {_HINT}")


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # sqlite3's own transaction handling would skip BEGIN before SELECT and DDL; turn it
    # off and let `_sqlite_on_begin` emit BEGIN, so that transactions mean what they say.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    _enable_wal(cursor)
    # NORMAL is durable against application crashes under WAL; only an OS crash may lose
    # the last commits, which costs re-measuring a few configs, not a corrupt database.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the database to WAL; the mode is stored in the file, so this is once per file.

    Switching needs an exclusive lock, and SQLite refuses it at once, without waiting for
    the busy timeout, when that could deadlock: several processes opening a new database
    together. So wait here, as the busy timeout would.
    """
    if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _sqlite_on_begin(connection: Any) -> None:
    immediate = connection.get_execution_options().get(_BEGIN_IMMEDIATE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _setting(name: str, value: int | None, env: str, default: int, minimum: int) -> int:
    """`value`, else the integer in `$env`, else `default`."""
    if value is None:
        raw = os.environ.get(env)
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise FarmError(f"{env}={raw!r} is not an integer") from None
    if value < minimum:
        raise FarmError(f"database {name} ({env}) must be >= {minimum}, got {value}")
    return value


def _json_default(value: Any) -> Any:
    # Configs and latencies often hold NumPy scalars or arrays, which json cannot encode.
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_json_dumps: Callable[[Any], str] = partial(json.dumps, default=_json_default)


def display_url(url: str | URL | None) -> str:
    """The URL the farm opens for `url` (resolve_url; given a parsed URL, that one), its password
    masked: the only form of a database URL that goes into messages and logs."""
    parsed = url if isinstance(url, URL) else resolve_url(url)
    return parsed.render_as_string(hide_password=True)


def _connect_error(parsed: URL, exc: DBAPIError) -> str:
    reason = first_line(exc)
    if parsed.get_backend_name() == "postgresql":
        reason = reason.removeprefix("FATAL:").strip()
        hint = "is PostgreSQL running there and does the database exist?"
    else:
        hint = "is it a writable SQLite database?"
    return f"cannot connect to {display_url(parsed)}: {reason}; {hint} {_HINT}"
