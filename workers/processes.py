"""Supervision of the farm's child processes: started as modules in their own process group,
dying with the process that started them (workers.lifeline), killed group and all, and kept
running (`KeptRunning`: started again each time they end).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from farm.core.backoff import Backoff

_REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("farm.device")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill every process of `proc`'s process group, `proc` included, and reap it.

    The group is signalled even when `proc` itself has ended, as long as it is not reaped yet (see
    `exited`): what it started may live on (a TVM tracker's serving process outlives its launcher).
    Once reaped, its id may belong to another process group, which is left alone.
    """
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether `proc` has ended, without reaping it: until it is reaped its id stays its own and its
    group's, so that `kill_group` can still end what it started."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by another waiter
        return True


def spawn_module(args: list[str], log: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m ARGS` in its own process group, this checkout importable, output to `log`; the
    group is killed when this process ends (workers.lifeline)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), full_env.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "workers.lifeline", str(os.getpid()), *args]
    with open(log, "ab") if log is not None else open(os.devnull, "wb") as out:  # the child keeps its copy
        return subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # a Ctrl-C in the terminal reaches the farm only


class KeptRunning:
    """A child process (`spawn()`, a `spawn_module` one) started again each time it ends (killed,
    out of memory, crashed), until `stop()`: within `WATCH_SECONDS` of its end, its whole process
    group killed first (what it started might hold its port). One that keeps ending is started
    again less and less often (every 30 s at most); up `HEALTHY_SECONDS`, it counts as healthy
    again and the next restart comes at once. The watchdog runs from `watch()` on."""

    WATCH_SECONDS = 0.25
    HEALTHY_SECONDS = 10.0

    def __init__(self, what: str, spawn: Callable[[], subprocess.Popen[bytes]]) -> None:
        self.what, self._spawn = what, spawn
        self.proc = spawn()
        self.restarts = 0  # by the watchdog
        self._lock = threading.Lock()  # `proc`, between the watchdog and stop()
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    def watch(self) -> None:
        if self._watchdog is None and not self._stopped.is_set():
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name=f"farm-watch-{self.what}")
            self._watchdog.start()

    def _watch(self) -> None:
        backoff = Backoff(1.0, 30.0)
        started = time.monotonic()
        delay = self.WATCH_SECONDS
        while not self._stopped.wait(delay):
            with self._lock:
                if self._stopped.is_set():
                    return
                if not exited(self.proc):
                    if time.monotonic() - started >= self.HEALTHY_SECONDS:
                        backoff.reset()
                    delay = self.WATCH_SECONDS
                    continue
                kill_group(self.proc)
                self.restarts += 1
                log.warning("%s ended (status %s); restarting it", self.what, self.proc.returncode)
                self.proc = self._spawn()
                started = time.monotonic()
            delay = backoff.next()

    def stop(self) -> None:
        """End the process and its watchdog (it is not started again after this)."""
        self._stopped.set()
        with self._lock:
            kill_group(self.proc)
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()
            self._watchdog = None
