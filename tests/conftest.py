"""Shared fixtures, and the check that the suite leaves nothing running.

Postgres (as procrastinate tests do): one migrated template database per test session,
cloned into a fresh database for each test that asks for `pg_url`, all dropped afterwards.
The server is ``$FARM_TEST_PG`` (default: postgres@127.0.0.1:5432, trust auth); tests that
need it are skipped, with the reason, when nothing answers there. `url` and `store` give a
test a fresh database on each backend, SQLite and Postgres. A test that stops and starts
its database gets a cluster of its own (`private_pg`).

Nothing left behind: every process the session starts carries FARM_TEST_SESSION=<its id>
(tests/processes.py). When the session ends, any such process still running after a grace period
(an RPC tracker or server, a Ray process, a database, a compile process...) fails the run: it is
listed with the test during which it appeared, then killed.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import psutil
import pytest
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from tests import processes
from tests.private_pg import PrivatePostgres

if TYPE_CHECKING:
    from db.store import ResultStore

# A suite started in the background by a shell without job control (`cmd &` in a script)
# inherits SIGINT ignored, and so would every process it starts; the tests that press Ctrl-C
# need it delivered. A handler here makes the children start with the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

PG_SERVER = os.environ.get("FARM_TEST_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")

SESSION = uuid.uuid4().hex
os.environ[processes.SESSION_ENV] = SESSION  # inherited by everything the session starts
# Helpers of this interpreter's multiprocessing, which end with it: not the farm's processes.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_first_seen: dict[int, str] = {}  # pid -> the test after which it was first seen running


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        for proc in processes.tagged(SESSION):
            _first_seen.setdefault(proc.pid, item.nodeid)


def _counts(proc: psutil.Process) -> bool:
    """Whether a process of this session counts as left behind: all but this interpreter's helpers."""
    try:
        return not (proc.ppid() == os.getpid() and any(h in processes.describe(proc) for h in _INTERPRETER_HELPERS))
    except psutil.NoSuchProcess:
        return False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process this session started is still running (see the module docstring)."""
    left = processes.left_behind(SESSION, counts=_counts)
    if not left:
        return
    lines = [f"{processes.describe(p)}  (running since {_first_seen.get(p.pid, 'the end of the session')})"
             for p in left]
    for proc in left:  # ours by their tag: killed so that they do not outlive the run
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    title = f"{len(left)} process(es) started by this test session were still running (now killed)"
    if reporter is not None:
        reporter.write_line("")  # after the progress line, which has no newline yet
        reporter.write_sep("=", title, red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print(title, *lines, sep="\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _admin_engine() -> Engine:
    # CREATE/DROP DATABASE cannot run inside a transaction; NullPool leaves no idle
    # connection behind that would block dropping a database.
    return create_engine(
        PG_SERVER, isolation_level="AUTOCOMMIT", poolclass=NullPool, connect_args={"connect_timeout": 3}
    )


def _execute(sql: str) -> None:
    engine = _admin_engine()
    with engine.connect() as connection:
        connection.exec_driver_sql(sql)
    engine.dispose()


def _database_url(name: str) -> str:
    return make_url(PG_SERVER).set(database=name).render_as_string(hide_password=False)


def _create_database(template: str | None = None) -> str:
    name = f"farm_test_{uuid.uuid4().hex[:12]}"
    _execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return name


def _drop_database(name: str) -> None:
    # FORCE: a store under test may still hold pooled connections.
    _execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_server() -> str:
    """URL of the maintenance database of a reachable PostgreSQL server; skips if none."""
    try:
        _execute("SELECT 1")
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        display = make_url(PG_SERVER).render_as_string(hide_password=True)
        pytest.skip(f"no PostgreSQL server at {display} ({reason}); start one or set FARM_TEST_PG")
    return PG_SERVER


@pytest.fixture(scope="session")
def pg_template(pg_server: str) -> Iterator[str]:
    """Name of a database migrated to the current schema, to clone from (never connect to it)."""
    from db.migrate import upgrade

    name = _create_database()
    try:
        upgrade(_database_url(name))  # disposes of its engine: a template must have no sessions
        yield name
    finally:
        _drop_database(name)


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """URL of a fresh Postgres database with the current schema, dropped after the test."""
    name = _create_database(template=pg_template)
    try:
        yield _database_url(name)
    finally:
        _drop_database(name)


@pytest.fixture
def pg_empty_url(pg_server: str) -> Iterator[str]:
    """URL of a fresh, empty Postgres database (no schema), dropped after the test."""
    name = _create_database()
    try:
        yield _database_url(name)
    finally:
        _drop_database(name)


@pytest.fixture(scope="session")
def unavailable() -> Callable[[str], NoReturn]:
    """What a test does when this machine lacks something it needs (root, Docker, namespaces):
    in CI (FARM_CI=1, set by .ci/run) it fails with the reason, elsewhere it is skipped with it."""

    def react(reason: str) -> NoReturn:
        if os.environ.get("FARM_CI") == "1":
            pytest.fail(f"{reason} (CI runs this test: FARM_CI=1)", pytrace=False)
        pytest.skip(reason)

    return react


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database with the current schema, once on SQLite and once on Postgres."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/farm.db"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def store(url: str) -> Iterator[ResultStore]:
    """The ResultStore at `url`, closed after the test."""
    from db.store import open_store

    opened = open_store(url)
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def _private_cluster(unavailable: Callable[[str], NoReturn]) -> Iterator[PrivatePostgres]:
    try:
        cluster = PrivatePostgres()
    except Exception as e:  # no initdb, no postgres user as root
        unavailable(f"cannot initialise a private PostgreSQL cluster: {e}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def private_pg(_private_cluster: PrivatePostgres) -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of this test session's own (tests/private_pg.py), which the test may
    stop and start; it runs again after the test. `private_pg.create_database(name)` gives a URL."""
    yield _private_cluster
    if not _private_cluster.running:
        _private_cluster.start()
