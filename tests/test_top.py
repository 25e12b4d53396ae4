"""A job's pace (throughput, recent rate, ETA) and worker activity from the database, as `farm
status` and `farm top` show them: the figures on SQLite and Postgres, the commands as a user runs
them (once, piped and repeated, and live on a terminal)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from db.store import ResultStore, open_store
from farm.report import pace, worker_activity
from tests.test_cli import farm
from tests.test_db_store import failed, make_job, ok, store_at


def _running_job(store: ResultStore) -> tuple[dict, int, int]:
    """A claimed job of two tasks (budget 64); its document and its tasks' ids."""
    job_id = make_job(store, n_tasks=2)
    assert store.claim_job("sched", job_id=job_id) == job_id
    a, b = (task["id"] for task in store.tasks(job_id))
    return store.job(job_id), a, b  # type: ignore[return-value]


def test_pace_counts_since_the_claim_and_the_eta_follows_the_last_minute(store: ResultStore) -> None:
    job, a, b = _running_job(store)
    start = job["started_at"]
    for i in range(20):  # one a second, 10 to 29 s after the claim
        store_at(store, a, ok(i, 1e-3), start + timedelta(seconds=10 + i))
    for i in range(10):  # a slower last minute: 10 trials, 90 to 99 s after it
        store_at(store, b, replace(ok(i, 1e-3), worker="w1"), start + timedelta(seconds=90 + i))
    now = start.timestamp() + 100
    got = pace(store, store.job(job["id"]), now=now)  # type: ignore[arg-type]
    assert (got.trials, got.budget, got.since_claim, got.recent) == (30, 64, 30, 10)
    assert got.wall_seconds == pytest.approx(100) and got.recent_seconds == pytest.approx(60)
    assert got.throughput == pytest.approx(0.3)
    assert got.recent_rate == pytest.approx(10 / 60)
    assert got.eta_seconds == pytest.approx(34 / (10 / 60))  # 204 s: trials left over the last minute's rate
    assert got.eta() == "3 min 24 s"
    assert "throughput 0.30 trials/s over 1 min 40 s" in got.summary() and "ETA 3 min 24 s" in got.summary()
    # A minute without trials: the ETA cannot be said.
    assert pace(store, store.job(job["id"]), now=now + 120).eta_seconds is None  # type: ignore[arg-type]
    # Queued: no pace at all.
    queued = store.job(make_job(store))
    assert pace(store, queued).throughput is None and pace(store, queued).eta() == "-"  # type: ignore[arg-type]

    workers = worker_activity(store, [store.job(job["id"])], now=now)  # type: ignore[list-item]
    assert [(w.name, w.jobs, w.recent) for w in workers] == [("w0", [job["id"]], {}), ("w1", [job["id"]], {"ok": 10})]
    assert now - workers[0].last_at == pytest.approx(71) and now - workers[1].last_at == pytest.approx(1)


@pytest.fixture
def busy_farm(tmp_path: Path) -> str:
    """A SQLite farm with one running job whose trials two workers stored just now (real writer)
    and an older finished job; its URL."""
    url = f"sqlite:///{tmp_path}/farm.db"
    store = open_store(url)
    done, _, _ = _running_job(store)
    store.finish_job(done["id"], "done")
    _, a, b = _running_job(store)
    with store.writer(flush_seconds=None) as writer:
        for i in range(12):
            writer.record(a, ok(i, 2e-6 + i * 1e-7))
        writer.record(b, replace(failed(0), worker="llvm-worker-1"))
        for i in range(1, 6):
            writer.record(b, replace(ok(i, 5e-6), worker="llvm-worker-1"))
    store.close()
    return url


def test_status_shows_throughput_eta_and_busy_share(busy_farm: str) -> None:
    proc = farm("status", "2", "--db", busy_farm)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "throughput" in line)
    assert "trials/s over" in line and "trials/s in its last" in line and "ETA " in line, proc.stdout
    assert "46 trials left" in line  # 64 - 18
    assert "devices busy" in proc.stdout
    doc = farm("status", "2", "--json", "--db", busy_farm)
    pace_doc = json.loads(doc.stdout)["pace"]
    assert pace_doc["throughput"] > 0 and pace_doc["recent_rate"] > 0 and pace_doc["eta_seconds"] > 0
    assert "--watch" in farm("status", "--help").stdout and "ETA" in farm("status", "--help").stdout


def test_top_once_prints_jobs_and_workers_uncut(busy_farm: str) -> None:
    proc = farm("top", "--once", "--db", busy_farm)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row = next(line for line in lines if line.startswith("│ 2 "))
    assert "running" in row and "18/64" in row and "2.00 µs" in row and "5.00 µs" in row and " s │" in row
    assert next(line for line in lines if line.startswith("│ 1 ")).split("│")[2].strip() == "done"
    worker0 = next(line for line in lines if "│ w0 " in line)
    worker1 = next(line for line in lines if "llvm-worker-1" in line)
    assert "ok 12" in worker0 and "build_error 1, ok 5" in worker1 and "s ago" in worker1
    assert any(len(line) > 80 for line in lines)  # a pipe: nothing cut at 80 columns
    assert "trials/s (60 s)" in proc.stdout
    # Job ids given: only those; an unknown one is a user error.
    assert "│ 1 " not in farm("top", "2", "--once", "--db", busy_farm).stdout
    bad = farm("top", "7", "--once", "--db", busy_farm)
    assert bad.returncode == 2 and bad.stderr.strip() == "farm: error: no job 7 in this database; `farm jobs` lists " \
        "the jobs"


def _until(proc: subprocess.Popen[bytes], read: Callable[[], bytes], done: Callable[[bytes], bool],
           timeout: float = 60) -> bytes:
    """Read `proc`'s output with `read()` until `done(output)`, at most `timeout` seconds."""
    output = b""
    deadline = time.monotonic() + timeout
    while not done(output) and time.monotonic() < deadline and proc.poll() is None:
        output += read()
    return output


def test_status_watch_repeats_away_from_a_terminal_until_ctrl_c(busy_farm: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "farm", "status", "2", "--watch", "--interval", "0.3",
                             "--db", busy_farm], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    stdout = proc.stdout.fileno()
    output = _until(proc, lambda: os.read(stdout, 65536), lambda out: out.count(b"farm top") >= 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert output.count(b"farm top") >= 3 and b"18/64" in output and b"llvm-worker-1" in output


def test_top_redraws_in_place_on_a_terminal(busy_farm: str) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "farm", "top", "--interval", "0.3", "--db", busy_farm],
                            stdin=follower, stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": "160"})
    os.close(follower)

    def read() -> bytes:
        ready, _, _ = select.select([leader], [], [], 1)
        return os.read(leader, 65536) if ready else b""

    try:
        # rich Live redraws a frame over the previous one: cursor up (ESC [1A), erase line (ESC [2K).
        output = _until(proc, read, lambda out: b"llvm-worker-1" in out and b"\x1b[1A\x1b[2K" in out)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    assert b"llvm-worker-1" in output and b"18/64" in output and b"\x1b[1A\x1b[2K" in output, output[-2000:]
