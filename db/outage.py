"""Riding out a database outage: `Outage`, shared by a store, its writers and their threads.

PostgreSQL restarting (an upgrade, a failover, a crash) or out of reach for minutes must neither
fail the jobs that are running nor stop a scheduler. Every call of a store (db.store) and every
flush of its writers (db.writer) goes through the store's `Outage`: an error that means the
database cannot be reached right now (`is_unavailable`: connection refused or lost, the server
shutting down or starting up) is retried with backoff (from 0.25 s, doubling up to every 5 s)
until the call succeeds, or until the database has been unavailable for longer than the bound,
``$FARM_DB_OUTAGE_SECONDS`` (default 600: the farm is designed to ride out outages of 5 minutes
and more). Then the call raises `DatabaseUnavailable`, a FarmError of one line.

The outage's clock is shared: it starts at the first failure, whichever call met it, so every
call of a job gives up at the same time; once the bound has passed, each new call tries once
before giving up, so that the first call after the database is back succeeds and ends the
outage. Errors of the statement itself (a constraint, a missing table) are never retried, nor
SQLite's: a file does not go away.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from farm.core.backoff import Backoff
from farm.core.errors import FarmError

ENV_OUTAGE_SECONDS = "FARM_DB_OUTAGE_SECONDS"
DEFAULT_OUTAGE_SECONDS = 600.0
FIRST_DELAY_SECONDS = 0.25
MAX_DELAY_SECONDS = 5.0

# SQLSTATEs of a server that refuses for now, not for good: connection exceptions (class 08),
# admin_shutdown, crash_shutdown, cannot_connect_now (starting up, in recovery), too_many_connections.
_TRANSIENT_STATES = ("57P01", "57P02", "57P03", "53300")
# psycopg2 gives errors met while connecting no SQLSTATE: a FATAL from the server there means it
# refused us (a missing database, a wrong password) unless it is one of these passing states.
_TRANSIENT_FATAL = ("the database system is", "sorry, too many clients", "remaining connection slots",
                    "terminating connection")

log = logging.getLogger("farm.db")
T = TypeVar("T")


class DatabaseUnavailable(FarmError):
    """The database cannot be reached: while opening it, or for longer than the outage bound."""


class CommitOutcomeUnknown(Exception):
    """The connection broke while a transaction was committing: it may or may not have been
    applied. Raised (from the driver's error) by the store, so that `Outage.call` retries only
    the writes that are safe to apply twice."""


def outage_seconds() -> float:
    """The outage bound: ``$FARM_DB_OUTAGE_SECONDS``, else 600; FarmError for a bad value.
    0 turns retrying off (a call fails at its first error)."""
    raw = os.environ.get(ENV_OUTAGE_SECONDS)
    if not raw:
        return DEFAULT_OUTAGE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise FarmError(f"{ENV_OUTAGE_SECONDS}={raw!r} must be a number of seconds >= 0")
    return value


def first_line(exc: BaseException) -> str:
    """The first non-empty line of `exc`'s message (a DBAPI error's own, when it wraps one),
    whitespace collapsed: libpq's messages go on with hints on further lines."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    lines = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means that the database cannot be reached right now (worth retrying),
    rather than that the statement or the connection's settings are wrong."""
    if isinstance(exc, DatabaseUnavailable):
        return True
    if isinstance(exc, CommitOutcomeUnknown) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:  # SQLAlchemy recognised a lost connection
            return True
        exc = exc.orig if exc.orig is not None else exc
    psycopg2 = sys.modules.get("psycopg2")  # loaded by any Postgres engine; SQLite never gets here
    if psycopg2 is None or not isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError):
        return False
    if isinstance(exc, psycopg2.InterfaceError):  # "connection already closed"
        return True
    state = getattr(exc, "pgcode", None)
    if state:
        return state.startswith("08") or state in _TRANSIENT_STATES
    text = str(exc)
    return "FATAL:" not in text or any(passing in text for passing in _TRANSIENT_FATAL)


class Outage:
    """Retries of calls to the database at `where` (a URL with its password masked) through
    outages of up to `bound` seconds (default: `outage_seconds()`); see the module docstring.

    Thread-safe: a store, its writers and all their threads share one, and with it the clock
    of the current outage. `clock` and `sleep` are for tests.
    """

    def __init__(self, where: str, bound: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.where = where
        self.bound = outage_seconds() if bound is None else bound
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None

    @property
    def down(self) -> bool:
        """Whether the last call that ended met the database unavailable."""
        return self._down_since is not None

    def call(self, fn: Callable[[], T], what: str, *, idempotent: bool = True) -> T:
        """`fn()`, retried while it fails because the database is unavailable (see the module
        docstring); DatabaseUnavailable once the outage has lasted `bound` seconds. `fn` must
        reach the database: its success ends the outage.

        `what` names the call in the error. A call that is not `idempotent` is not retried after a
        `CommitOutcomeUnknown`: it may have been applied, and applying it twice would do harm.
        Other errors propagate at once.
        """
        backoff = Backoff(FIRST_DELAY_SECONDS, MAX_DELAY_SECONDS)
        while True:
            try:
                result = fn()
            except Exception as e:
                if not is_unavailable(e):
                    raise
                lasted = self._failed(e)
                if isinstance(e, CommitOutcomeUnknown) and not idempotent:
                    raise DatabaseUnavailable(
                        f"the connection to the database at {self.where} broke while {what} was committing "
                        f"({first_line(e.__cause__ or e)}): it may or may not have taken effect") from e
                left = self.bound - lasted
                if left <= 0:
                    raise DatabaseUnavailable(
                        f"the database at {self.where} has been unavailable for {lasted:.0f} s "
                        f"({first_line(e)}); gave up on {what} (the farm waits up to {self.bound:.0f} s: "
                        f"{ENV_OUTAGE_SECONDS} sets it)") from e
                self._sleep(min(backoff.next(), left))
                continue
            self._recovered()
            return result

    def _failed(self, e: Exception) -> float:
        """Note a failure; how long the outage has lasted (it starts with its first failure)."""
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
                log.warning("the database at %s is unavailable (%s); retrying for up to %.0f s (%s), "
                            "results are kept until it is back", self.where, first_line(e), self.bound,
                            ENV_OUTAGE_SECONDS)
            return now - self._down_since

    def _recovered(self) -> None:
        if self._down_since is None:  # the usual case, without taking the lock
            return
        with self._lock:
            if self._down_since is None:
                return
            lasted = self._clock() - self._down_since
            self._down_since = None
        log.warning("the database at %s is back after %.0f s", self.where, lasted)
