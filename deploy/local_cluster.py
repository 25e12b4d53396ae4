"""The one-machine farm: a local Ray instance and a TVM RPC tracker as a child process.

`farm tune` and the embedded `farm.Client()` start these when no cluster is given: Ray on
this machine (with logical GPU resources where there are no GPUs, so worker actors can be
scheduled one per "device" and measure llvm kernels on the CPU) and a tracker on a free
loopback port that the actors' RPC servers register with. Everything binds to 127.0.0.1:
an RPC server executes whatever it is sent.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

from farm.errors import FarmError
from workers.device import free_port, spawn_module


class LocalTracker:
    """A TVM RPC tracker on this machine; `stop()` (or leaving `with`) ends it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log: Path | None = None) -> None:
        self.host, self.port, self.log = host, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def start(self, timeout: float = 30.0) -> LocalTracker:
        self.port = self.port or free_port(self.host)
        self.proc = spawn_module(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                                  "--port-end", str(self.port + 1), "--silent"], self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FarmError(f"the RPC tracker exited with status {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return self
            time.sleep(0.1)
        self.stop()
        raise FarmError(f"the RPC tracker did not listen on {self.host}:{self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def __enter__(self) -> LocalTracker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def init_ray(address: str | None = None, logical_gpus: int = 0) -> None:
    """Connect to the Ray cluster at `address`, or start a local one (once per process).

    A local instance without GPUs gets `logical_gpus` GPU resources, so that one worker actor
    per "device" can be placed; those actors measure llvm kernels on the CPU.
    """
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return
    from workers.device import gpu_count

    gpus = gpu_count()
    logging.getLogger("ray").setLevel(logging.ERROR)  # its start-up notices are not the user's business
    ray.init(num_gpus=max(gpus, logical_gpus), include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False, configure_logging=False)
