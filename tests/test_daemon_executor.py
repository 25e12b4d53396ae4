"""scheduler.daemon_executor: calls run in order, results and errors reach their futures, a
shutdown cancels what has not started, and an exiting process does not wait for the call under way
(a cost model's retraining: tests/test_stopping.py stops whole jobs)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from scheduler.daemon_executor import DaemonExecutor


def test_calls_run_in_order_and_report_their_results_and_errors() -> None:
    executor = DaemonExecutor("test-executor")
    ran: list[int] = []
    futures = [executor.submit(ran.append, i) for i in range(5)]
    failing = executor.submit(int, "not a number")
    done = executor.submit(threading.current_thread)
    assert done.result(5).name == "test-executor" and done.result().daemon
    assert ran == list(range(5)) and all(f.result() is None for f in futures)
    with pytest.raises(ValueError):
        failing.result()
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.submit(print)


def test_shutdown_cancels_the_calls_not_started_and_waits_only_when_asked() -> None:
    executor = DaemonExecutor("test-executor")
    release = threading.Event()
    running = executor.submit(release.wait, 10)
    queued = executor.submit(time.sleep, 0)
    while not running.running():
        time.sleep(0.01)
    executor.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and not running.done()
    release.set()
    assert running.result(5) is True


def test_a_process_exits_without_waiting_for_the_call_under_way() -> None:
    program = ("import time\nfrom scheduler.daemon_executor import DaemonExecutor\n"
               "e = DaemonExecutor('x')\ne.submit(time.sleep, 60)\ntime.sleep(0.2)\n")
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", program], check=True, timeout=30)
    assert time.monotonic() - started < 10
