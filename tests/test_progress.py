"""The job progress display says what a job waits for until its first trial: queued, or the
scheduler's latest start-up step logged on "farm.scheduler", as plain lines away from a terminal
and as the status line above the bars on one; and it leaves logging as it found it."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from farm.progress import SCHEDULER_LOGGER, JobProgress

log = logging.getLogger(SCHEDULER_LOGGER)


def job_doc(status: str = "running", trials: int = 0) -> dict[str, Any]:
    """A ResultStore.job document of one task of 16 trials."""
    task = {"id": 3, "workload": {"name": "matmul"}, "budget": 16, "trials": trials, "counts": {"ok": trials},
            "best_latency": 2e-6 if trials else None}
    return {"id": 7, "status": status, "trials": trials, "tasks": [task]}


@pytest.fixture
def quiet_logging() -> Iterator[list[logging.LogRecord]]:
    """Logging as `farm tune` sets it without -v (warnings only), its handler's records collected."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    yield records
    root.removeHandler(handler)
    root.setLevel(saved)


def test_piped_output_gets_each_start_up_step_as_a_line_until_the_first_trial(
        quiet_logging: list[logging.LogRecord]) -> None:
    stream = io.StringIO()
    display = JobProgress(Console(file=stream, width=100_000), every=0)
    assert log.isEnabledFor(logging.INFO)  # lowered while the display runs
    display.update(job_doc("queued"))
    assert display.status_line().startswith("queued, 0 s: waiting for a scheduler")  # type: ignore[union-attr]
    display.update(job_doc())
    log.info("Ray ready in %.1f s", 4.2)
    log.info("%d %s worker actor(s) up in %.1f s", 2, "llvm", 6.5)
    log.warning("a warning is logging's to show")
    display.update(job_doc(trials=2))  # the first trial: start-up is over
    log.info("task 3: cost model 1 trained on 8 trials in 0.10 s")
    display.close()
    lines = stream.getvalue().splitlines()
    assert "job 7: starting, 0 s: Ray ready in 4.2 s" in lines
    assert "job 7: starting, 0 s: 2 llvm worker actor(s) up in 6.5 s" in lines
    assert not any("warning" in line or "cost model" in line for line in lines), lines  # not printed twice
    assert "job 7 task 3 matmul: 2/16 trials, ok 2, best 2.00 µs" in lines
    # Logging showed only what it showed before, and is as it was.
    assert [r.getMessage() for r in quiet_logging] == ["a warning is logging's to show"]
    assert log.level == logging.NOTSET and not log.filters and not log.isEnabledFor(logging.INFO)


def test_with_verbose_logging_the_steps_are_not_printed_twice(quiet_logging: list[logging.LogRecord]) -> None:
    logging.getLogger().setLevel(logging.INFO)  # farm tune -v: logging prints the steps itself
    stream = io.StringIO()
    display = JobProgress(Console(file=stream, width=100_000), every=1e9)
    display.update(job_doc())
    log.info("Ray ready in 1.0 s")
    display.close()
    assert "Ray ready" not in stream.getvalue()
    assert [r.getMessage() for r in quiet_logging] == ["Ray ready in 1.0 s"]


def test_on_a_terminal_the_latest_step_is_the_status_line_above_the_bars(
        quiet_logging: list[logging.LogRecord]) -> None:
    stream = io.StringIO()
    display = JobProgress(Console(file=stream, force_terminal=True, width=120))
    display.update(job_doc())
    assert display.status_line() == "starting, 0 s: waiting for the first trial"
    log.info("Ray ready in 4.2 s")
    log.info("task 3: 1 shard searches (xgb) ready in 0.4 s")
    assert display.status_line() == "starting, 0 s: task 3: 1 shard searches (xgb) ready in 0.4 s"
    assert display._bars is not None
    display._bars.refresh()
    assert "starting, 0 s: task 3: 1 shard searches (xgb) ready" in stream.getvalue()
    display.update(job_doc(trials=1))
    assert display.status_line() is None
    display.close()
    assert quiet_logging == [] and not log.filters


def test_two_displays_at_once_share_the_scheduler_log_and_restore_it(
        quiet_logging: list[logging.LogRecord]) -> None:
    first, second = (JobProgress(Console(file=io.StringIO(), width=1000), every=1e9) for _ in range(2))
    log.info("Ray ready in 1.0 s")
    assert first.status_line() == second.status_line() == "starting, 0 s: Ray ready in 1.0 s"
    first.close()
    log.info("2 llvm worker actor(s) up")
    assert second.status_line() == "starting, 0 s: 2 llvm worker actor(s) up"
    second.close()
    assert quiet_logging == [] and log.level == logging.NOTSET and not log.filters
