"""TVM's RPC processes on this machine, as children of this process (workers.processes):

- `LocalTracker`: a TVM RPC tracker as a child process (the embedded farm's, and `farm predict
  --measure`'s); servers register with it under their device's key. It is kept running: if it
  dies, it is restarted on the same address within seconds, and the servers register with it
  again (workers.rpc_server).
- `ServerProcess`: the farm's RPC server for one device as a child process (pinned to a GPU
  with CUDA_VISIBLE_DEVICES, run with --no-fork for cuda), registered with a tracker; it can
  end the server's session processes when a kernel hangs (the server then serves again).
- `wait_for_keys`: waits until a free server is registered under each key.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from farm.core.errors import FarmError
from farm.core.host import VISIBLE_GPUS_ENV, free_port
from workers.processes import KeptRunning, exited, spawn_module


def wait_for_keys(tracker: tuple[str, int], keys: list[str], timeout: float,
                  procs: Sequence[subprocess.Popen[bytes]] = ()) -> None:
    """Return once a free server is registered under each key; FarmError after `timeout`
    or as soon as one of `procs` has exited."""
    from tvm import rpc

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise FarmError(f"an RPC process exited with status {proc.returncode} (see its log: --log-dir)")
        try:
            # TVM's client waits 5 s between tries of a tracker that does not listen yet: only ask
            # one that accepts connections.
            socket.create_connection(tracker, timeout=1).close()
            queues = rpc.connect_tracker(*tracker).summary()["queue_info"]
            missing = [k for k in keys if queues.get(k, {}).get("free", 0) < 1]
            if not missing:
                return
            last = f"not registered yet: {', '.join(missing)}"
        except Exception as e:  # the tracker is still starting
            last = str(e).splitlines()[0] if str(e) else type(e).__name__
        time.sleep(0.3)
    raise FarmError(f"no free RPC server registered under {', '.join(keys)} with the tracker at "
                    f"{tracker[0]}:{tracker[1]} within {timeout:.0f} s ({last}); start the device's server "
                    f"with that key (python -m workers.rpc_server --tracker HOST:PORT --key KEY) or check the key")


class ServerProcess:
    """The farm RPC server of one device, as a child process of this one. Once `watch()`ed (its
    owner calls it when the server has registered), a server that ends is started again
    (KeptRunning), and registers with the tracker again under its key."""

    def __init__(self, tracker: tuple[str, int], key: str, kind: str, gpu: str | None = None,
                 host: str = "127.0.0.1", log: Path | None = None, no_fork: bool | None = None) -> None:
        """`no_fork` (default: for cuda) spawns session processes instead of forking them."""
        self.tracker, self.key, self.kind = tracker, key, kind
        port = free_port(host)
        args = ["workers.rpc_server", "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", key,
                "--host", host, "--port", str(port), "--port-end", str(port + 100)]
        env = {}
        if kind == "cuda" if no_fork is None else no_fork:
            args += ["--no-fork", "--kind", kind]  # a forked process fails its first CUDA allocation
        if gpu is not None:
            env[VISIBLE_GPUS_ENV] = gpu
        self._kept = KeptRunning(f"the RPC server for key {key}", functools.partial(spawn_module, args, log, env))

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The server's process now (another one after a restart)."""
        return self._kept.proc

    @property
    def restarts(self) -> int:
        return self._kept.restarts

    def watch(self) -> None:
        """Start it again whenever it ends, from now on, until `stop()`."""
        self._kept.watch()

    def kill_sessions(self) -> None:
        """End the server's session processes (a hung kernel), each with its own children; the
        server serves again. A process of the server's that holds no TCP connection is not a
        session: the standby that will serve the next one (workers.rpc_server.Standby) is kept,
        or that session would wait seconds for a process to start."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                if child.net_connections("tcp"):
                    for proc in [child, *child.children(recursive=True)]:
                        proc.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        self._kept.stop()


class LocalTracker:
    """A TVM RPC tracker on this machine, kept running until `stop()` (or leaving `with`).

    A watchdog thread restarts it on the same address when it ends (killed, out of memory):
    within `KeptRunning.WATCH_SECONDS`, plus its start-up (about 2 s, TVM's import). The farm's RPC servers
    register with the new one by themselves (workers.rpc_server), and a worker waits for a
    session only a few seconds (workers.runner). A tracker that keeps failing to start is tried
    again less and less often (every 30 s at most).

    It binds to `host` (127.0.0.1 by default: an RPC server executes whatever it is sent)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log: Path | None = None) -> None:
        self.host, self.port, self.log = host, port, log
        self._kept: KeptRunning | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The tracker's process now (another one after a restart); None before `start()`."""
        return self._kept.proc if self._kept is not None else None

    @property
    def restarts(self) -> int:
        return self._kept.restarts if self._kept is not None else 0

    def start(self, timeout: float = 30.0, wait: bool = True) -> LocalTracker:
        """Start it and its watchdog; with `wait`, return once it accepts connections (FarmError if
        it does not), else at once (its clients retry while it starts)."""
        self.port = self.port or free_port(self.host)
        self._kept = KeptRunning(f"the RPC tracker on {self.host}:{self.port}", functools.partial(
            spawn_module, ["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                           "--port-end", str(self.port + 1), "--silent"], self.log))
        if wait:
            self._wait_listening(timeout)
        self._kept.watch()
        return self

    def _wait_listening(self, timeout: float) -> None:
        assert self._kept is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if exited(self._kept.proc):
                self.stop()
                raise FarmError(f"the RPC tracker exited with status {self._kept.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        raise FarmError(f"the RPC tracker did not listen on {self.host}:{self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        """End the tracker and its watchdog (the tracker is not restarted after this)."""
        if self._kept is not None:
            self._kept.stop()

    def __enter__(self) -> LocalTracker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
