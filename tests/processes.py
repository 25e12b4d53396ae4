"""Stopping the farm processes a test started."""

from __future__ import annotations

import os
import signal
import subprocess


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
