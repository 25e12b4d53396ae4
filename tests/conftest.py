"""Shared fixtures.

Postgres (as procrastinate tests do): one migrated template database per test session,
cloned into a fresh database for each test that asks for `pg_url`, all dropped afterwards.
The server is ``$FARM_TEST_PG`` (default: postgres@127.0.0.1:5432, trust auth); tests that
need it are skipped, with the reason, when nothing answers there.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

PG_SERVER = os.environ.get("FARM_TEST_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")


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
