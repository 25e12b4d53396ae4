"""make_engine from URLs, its errors, and migrations that build exactly the models' schema."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from db.engine import make_engine
from db.migrate import alembic_config, current, head, upgrade
from db.models import Base
from farm.core.errors import FarmError


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database without a schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/farm.db"
    return request.getfixturevalue("pg_empty_url")


# Migrations ---------------------------------------------------------------------------------


def test_migrations_build_the_models_schema(empty_url: str) -> None:
    assert current(empty_url) is None
    upgrade(empty_url)
    upgrade(empty_url)  # every start calls it: a no-op once at head
    assert current(empty_url) == head()
    engine = make_engine(empty_url)
    with engine.connect() as connection:
        diffs = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata)
        names = set(inspect(connection).get_table_names())
    engine.dispose()
    assert diffs == []
    assert names == {*Base.metadata.tables, "alembic_version"}


def test_migrations_downgrade_to_nothing(empty_url: str) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    with engine.connect() as connection:
        assert set(inspect(connection).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(empty_url)
    assert current(empty_url) == head()


def test_concurrent_upgrades_of_an_empty_database(empty_url: str) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            upgrade(empty_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and current(empty_url) == head()


# SQLite -------------------------------------------------------------------------------------


def test_sqlite_pragmas(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/farm.db")
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_default_url_and_farm_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FARM_DB", raising=False)
    make_engine(None).dispose()
    assert (tmp_path / "farm.db").exists()
    monkeypatch.setenv("FARM_DB", f"sqlite:///{tmp_path}/other.db")
    engine = make_engine(None)
    assert engine.url.database == str(tmp_path / "other.db")
    engine.dispose()


# Postgres -----------------------------------------------------------------------------------


def test_postgres_pool_settings(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(pg_url)
    assert (engine.pool.size(), engine.pool._max_overflow, engine.pool._pre_ping) == (2, 2, True)  # type: ignore[attr-defined]
    with engine.connect() as connection:
        assert connection.execute(text("SELECT current_setting('application_name')")).scalar() == "farm"
    engine.dispose()
    monkeypatch.setenv("FARM_DB_POOL_SIZE", "3")
    monkeypatch.setenv("FARM_DB_MAX_OVERFLOW", "0")
    engine = make_engine(pg_url)
    assert (engine.pool.size(), engine.pool._max_overflow) == (3, 0)  # type: ignore[attr-defined]
    engine.dispose()
    engine = make_engine(pg_url, pool_size=1, max_overflow=5)
    assert (engine.pool.size(), engine.pool._max_overflow) == (1, 5)  # type: ignore[attr-defined]
    engine.dispose()


# Errors: one line, nothing created ----------------------------------------------------------


def _one_line_error(url: Any) -> str:
    with pytest.raises(FarmError) as info:
        make_engine(url)
    message = str(info.value)
    assert "\n" not in message and "set --db or FARM_DB" in message
    return message


def test_unreachable_postgres(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    message = _one_line_error("postgresql://farm:secret@127.0.0.1:1/farm")
    assert message.startswith("cannot connect to postgresql://farm:***@127.0.0.1:1/farm: ")
    assert "refused" in message and "secret" not in message
    assert os.listdir(tmp_path) == []


def test_missing_postgres_database(pg_server: str) -> None:
    message = _one_line_error(pg_server.rsplit("/", 1)[0] + "/farm_no_such_database")
    assert 'database "farm_no_such_database" does not exist' in message


def test_sqlite_in_missing_directory(tmp_path: Path) -> None:
    message = _one_line_error(f"sqlite:///{tmp_path}/missing/farm.db")
    assert message == (
        f"cannot open sqlite:///{tmp_path}/missing/farm.db: directory {tmp_path}/missing does not exist; "
        "create it or set --db or FARM_DB"
    )
    assert os.listdir(tmp_path) == []


def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a database, but long enough to have a header" * 100)
    message = _one_line_error(f"sqlite:///{tmp_path}/notes.txt")
    assert "not a database" in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", "bad database URL 'not a url'"),
        ("mysql://root@localhost/farm", "unsupported database 'mysql'"),
        ("postgresql+nosuchdriver://localhost/farm", "driver is not installed"),
    ],
)
def test_bad_urls(url: str, expected: str) -> None:
    with pytest.raises(FarmError, match=expected) as info:
        make_engine(url)
    assert "\n" not in str(info.value)


def test_bad_pool_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_DB_POOL_SIZE", "many")
    with pytest.raises(FarmError, match="FARM_DB_POOL_SIZE='many' is not an integer"):
        make_engine("postgresql://postgres@127.0.0.1:1/farm")
