"""The processes a test session starts: stopping them, and finding those left behind.

Every process the suite starts carries ``FARM_TEST_SESSION=<this session's id>`` in its environment
(tests/conftest.py sets it in the pytest process, and children inherit it, however far they are
handed on: Ray workers, RPC servers, a PostgreSQL daemon). A test can tag what it starts with a
variable of its own the same way. Only processes found by such a tag are ever counted or killed:
other people's runs share this machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil

SESSION_ENV = "FARM_TEST_SESSION"


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop `proc` (started with start_new_session) as a person would, Ctrl-C to its process group,
    so that it closes its pools and RPC tracker on the way out; SIGKILL if it has not ended after
    `timeout` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tagged(value: str, name: str = SESSION_ENV) -> list[psutil.Process]:
    """The running processes (zombies left out) whose environment has `name`=`value`, this one
    excepted (its environment as it started has no tag: conftest sets it afterwards)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(name) == value \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def describe(proc: psutil.Process) -> str:
    """`pid command line` on one line, cut to 200 characters."""
    try:
        command = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        command = "(gone)"
    return f"{proc.pid} {command[:200]}"


def left_behind(value: str, name: str = SESSION_ENV, grace: float = 10.0,
                counts: Callable[[psutil.Process], bool] = lambda _: True) -> list[psutil.Process]:
    """The processes tagged `name`=`value` for which `counts` holds, still running after waiting up
    to `grace` seconds for them to end."""
    deadline = time.monotonic() + grace
    while True:
        alive = [p for p in tagged(value, name) if counts(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.25)
