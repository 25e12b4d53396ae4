"""Riding out database outages (db.outage), as pure logic: a fake clock, driver errors built by hand,
a writer whose database never answers. tests/test_faults.py stops a real PostgreSQL."""

from __future__ import annotations

import logging
import sqlite3
import time

import psycopg2
import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from db.outage import (
    DEFAULT_OUTAGE_SECONDS,
    ENV_OUTAGE_SECONDS,
    CommitOutcomeUnknown,
    DatabaseUnavailable,
    Outage,
    is_unavailable,
    outage_seconds,
)
from db.writer import ResultWriter
from farm.core.backoff import Backoff
from farm.core.errors import FarmError
from farm.core.measure import MeasureResult, Status

REFUSED = psycopg2.OperationalError(
    'connection to server at "127.0.0.1", port 5432 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?\n")


class FakeTime:
    """A clock that only the outage's sleeps move."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: BaseException, result: str = "ok") -> tuple[list[int], object]:
    """A call that raises `error` `times` times, then returns `result`; and its call count."""
    calls = [0]

    def call() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise error
        return result

    return calls, call


def outage(bound: float = 60.0) -> tuple[Outage, FakeTime]:
    fake = FakeTime()
    return Outage("postgresql://farm:***@db/farm", bound, clock=fake.clock, sleep=fake.sleep), fake


def test_backoff_doubles_up_to_its_maximum_and_resets() -> None:
    backoff = Backoff(0.25, 2.0)
    assert [backoff.next() for _ in range(6)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    backoff.reset()
    assert backoff.next() == 0.25
    with pytest.raises(ValueError):
        Backoff(3.0, 2.0)


def test_a_call_is_retried_with_backoff_until_the_database_answers(caplog: pytest.LogCaptureFixture) -> None:
    guard, fake = outage()
    calls, call = failing(5, REFUSED)
    with caplog.at_level(logging.WARNING, logger="farm.db"):
        assert guard.call(call, "job_status") == "ok"
    assert calls == [6] and fake.sleeps == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert not guard.down
    # One line when the outage begins, one when it ends; none per try.
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "is unavailable (connection to server" in messages[0] and "retrying for up to 60 s" in messages[0]
    assert "is back after 8 s" in messages[1]


def test_the_delay_between_tries_stops_growing_at_five_seconds() -> None:
    guard, fake = outage(bound=600)
    _, call = failing(12, REFUSED)
    guard.call(call, "heartbeat")
    assert fake.sleeps[-4:] == [5.0] * 4 and max(fake.sleeps) == 5.0


def test_a_call_gives_up_after_the_bound_with_one_line() -> None:
    guard, fake = outage(bound=10)
    calls, call = failing(10**6, REFUSED)
    with pytest.raises(DatabaseUnavailable) as raised:
        guard.call(call, "job_status")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the database at postgresql://farm:***@db/farm has been unavailable for 10 s "
                              "(connection to server at")
    assert message.endswith(f"; gave up on job_status (the farm waits up to 10 s: {ENV_OUTAGE_SECONDS} sets it)")
    assert sum(fake.sleeps) == pytest.approx(10) and calls[0] == len(fake.sleeps) + 1
    assert guard.down


def test_the_outage_clock_is_shared_by_every_call() -> None:
    """Past the bound, a new call tries once and gives up; the first one that succeeds ends the outage."""
    guard, fake = outage(bound=10)
    with pytest.raises(DatabaseUnavailable):
        guard.call(failing(10**6, REFUSED)[1], "first")
    slept = len(fake.sleeps)
    calls, call = failing(10**6, REFUSED)
    with pytest.raises(DatabaseUnavailable, match="gave up on second"):
        guard.call(call, "second")
    assert calls == [1] and len(fake.sleeps) == slept
    assert guard.call(lambda: 42, "third") == 42 and not guard.down
    calls, call = failing(1, REFUSED)  # a new outage has a clock of its own
    assert guard.call(call, "fourth") == "ok" and calls == [2]


def test_errors_of_the_statement_are_raised_at_once() -> None:
    guard, fake = outage()
    for error in (ValueError("bad"), FarmError("no job 7"),
                  IntegrityError("INSERT", {}, psycopg2.IntegrityError("duplicate key")),
                  OperationalError("SELECT", {}, sqlite3.OperationalError("database is locked"))):
        calls, call = failing(1, error)
        with pytest.raises(type(error)):
            guard.call(call, "x")
        assert calls == [1]
    assert fake.sleeps == [] and not guard.down


def test_a_lost_commit_is_retried_only_for_idempotent_writes() -> None:
    lost = CommitOutcomeUnknown("server closed the connection unexpectedly")
    lost.__cause__ = OperationalError("COMMIT", {}, psycopg2.OperationalError("server closed the connection"),
                                      connection_invalidated=True)
    guard, _ = outage()
    calls, call = failing(1, lost)
    assert guard.call(call, "finish_job") == "ok" and calls == [2]
    calls, call = failing(1, lost)
    with pytest.raises(DatabaseUnavailable, match=r"broke while create_job was committing .* may or may not have "
                                                  r"taken effect"):
        guard.call(call, "create_job", idempotent=False)
    assert calls == [1]


@pytest.mark.parametrize(("error", "unavailable"), [
    (REFUSED, True),
    (psycopg2.OperationalError("server closed the connection unexpectedly"), True),
    (psycopg2.OperationalError('connection to server at "db" failed: FATAL:  the database system is starting up'),
     True),
    (psycopg2.OperationalError('connection to server at "db" failed: FATAL:  the database system is shutting '
                               'down'), True),
    (psycopg2.OperationalError("FATAL:  terminating connection due to administrator command"), True),
    (psycopg2.InterfaceError("connection already closed"), True),
    (psycopg2.OperationalError('connection to server at "db" failed: FATAL:  database "nope" does not exist'), False),
    (psycopg2.OperationalError('connection to server at "db" failed: FATAL:  password authentication failed'),
     False),
    (psycopg2.ProgrammingError("relation jobs does not exist"), False),
    (sqlite3.OperationalError("unable to open database file"), False),
    (DatabaseUnavailable("cannot connect"), True),
    (OperationalError("SELECT 1", {}, REFUSED), True),
    (DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True), True),
    (TimeoutError("timed out"), False),
])
def test_what_counts_as_the_database_being_unavailable(error: BaseException, unavailable: bool) -> None:
    assert is_unavailable(error) is unavailable


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OUTAGE_SECONDS, raising=False)
    assert outage_seconds() == DEFAULT_OUTAGE_SECONDS == 600
    monkeypatch.setenv(ENV_OUTAGE_SECONDS, "25.5")
    assert outage_seconds() == 25.5 and Outage("x").bound == 25.5
    monkeypatch.setenv(ENV_OUTAGE_SECONDS, "0")
    assert outage_seconds() == 0
    for bad in ("ten", "-1", "inf", "nan"):
        monkeypatch.setenv(ENV_OUTAGE_SECONDS, bad)
        with pytest.raises(FarmError, match=f"{ENV_OUTAGE_SECONDS}='{bad}' must be a number of seconds >= 0"):
            outage_seconds()


def test_a_writer_keeps_buffering_while_its_database_is_unavailable() -> None:
    """A Postgres engine whose server never answers (nothing listens on port 1): `add` neither
    raises nor waits, a full buffer is handed to the background thread, and `close` gives up after
    the bound with the rows still buffered, for a later flush."""
    engine = create_engine("postgresql+psycopg2://farm@127.0.0.1:1/farm", connect_args={"connect_timeout": 2})
    guard = Outage("port 1", bound=1.0)
    writer = ResultWriter(engine, batch_size=2, flush_seconds=0.05, outage=guard)
    start = time.monotonic()
    for i in range(5):
        writer.record(1, MeasureResult(i, {"tile": i}, Status.OK, latencies=[1e-3]))
    assert time.monotonic() - start < 0.5
    time.sleep(0.3)  # the background thread is retrying meanwhile
    assert writer.pending == 5 and writer.inserted == 0
    with pytest.raises(DatabaseUnavailable, match="gave up on storing results"):
        writer.close()
    assert writer.pending == 5 and guard.down
    # A flush with nothing to store reaches no database: it must not end the outage.
    assert ResultWriter(engine, flush_seconds=None, outage=guard).flush() == 0 and guard.down
    engine.dispose()
