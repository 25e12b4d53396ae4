"""The one-machine cluster: a TVM RPC tracker and RPC servers as child processes.

`farm tune` with no cluster starts one of these: a tracker on a free loopback port and one
`workers.rpc_server` per device (CPU: `count` servers measuring llvm kernels; cuda: one per
GPU, pinned with CUDA_VISIBLE_DEVICES and run with --no-fork), each under its own key
(`keys[i]`) so that each worker owns one device. `servers=False` starts the tracker alone
(worker actors start their own servers). Everything binds to 127.0.0.1: an RPC server
executes whatever it is sent. `stop()` (or leaving the `with` block) ends every process it
started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from farm.errors import FarmError
from workers.device import ServerProcess, free_port, spawn_module, wait_for_keys


@dataclass
class LocalCluster:
    """A tracker and `count` RPC servers (see the module docstring)."""

    kind: str = "llvm"
    count: int = 1
    key: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    log_dir: Path | None = None
    servers: bool = True
    tracker_proc: subprocess.Popen[bytes] | None = None
    server_procs: list[ServerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.key = self.key or f"farm-{self.kind}-{socket.gethostname()}-{os.getpid()}"

    @property
    def keys(self) -> list[str]:
        """The RPC key of each server (device)."""
        return [f"{self.key}-{i}" for i in range(self.count)]

    @property
    def tracker(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _log(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir is not None else None

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Start the tracker (and servers); return once every server is registered."""
        self.port = self.port or free_port(self.host)
        self.tracker_proc = spawn_module(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                                          "--port-end", str(self.port + 1), "--silent"], self._log("tracker"))
        self._wait_for_tracker(timeout)
        if self.servers:
            for i, key in enumerate(self.keys):
                gpu = str(i) if self.kind == "cuda" else None
                self.server_procs.append(ServerProcess(self.tracker, key, self.kind, gpu, self.host,
                                                       self._log(f"server{i}")))
            try:
                wait_for_keys(self.tracker, self.keys, timeout,
                              [self.tracker_proc, *(s.proc for s in self.server_procs)])
            except FarmError:
                self.stop()
                raise
        return self

    def _wait_for_tracker(self, timeout: float) -> None:
        # Servers started before the tracker listens retry only every 5 s.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.tracker_proc is not None
            if self.tracker_proc.poll() is not None:
                raise FarmError(f"the RPC tracker exited with status {self.tracker_proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        raise FarmError(f"the RPC tracker did not listen on {self.host}:{self.port} within {timeout:.0f} s")

    def kill_sessions(self, server: int) -> None:
        """End server `server`'s session processes (a hung kernel); the server serves again."""
        self.server_procs[server].kill_sessions()

    def stop(self) -> None:
        for server in self.server_procs:
            server.stop()
        self.server_procs.clear()
        if self.tracker_proc is not None and self.tracker_proc.poll() is None:
            try:
                os.killpg(self.tracker_proc.pid, 9)
            except ProcessLookupError:
                pass
            self.tracker_proc.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
