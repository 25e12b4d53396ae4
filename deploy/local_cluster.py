"""The one-machine cluster: a TVM RPC tracker and RPC servers as child processes.

`farm tune` with no cluster starts one of these: a tracker on a free loopback port and one
`workers.rpc_server` per device (CPU: `count` servers measuring llvm kernels; cuda: one per
GPU, pinned with CUDA_VISIBLE_DEVICES and run with --no-fork), each under its own key
(`keys[i]`) so that each worker owns one device. Everything binds to
127.0.0.1: an RPC server executes whatever it is sent. `stop()` (or leaving the `with`
block) ends every process it started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from farm.errors import FarmError

_REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_count() -> int:
    """GPUs visible to this process (nvidia-smi), 0 when there are none."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


@dataclass
class LocalCluster:
    """A tracker and `count` RPC servers registered under `key` (see the module docstring)."""

    kind: str = "llvm"
    count: int = 1
    key: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    log_dir: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.key = self.key or f"farm-{self.kind}-{os.getpid()}"

    @property
    def keys(self) -> list[str]:
        """The RPC key of each server (device)."""
        return [f"{self.key}-{i}" for i in range(self.count)]

    @property
    def tracker(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _spawn(self, args: list[str], name: str, extra_env: dict[str, str] | None = None) -> None:
        log = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "ab")  # the child process owns it
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", *args], env=_env(extra_env), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the farm, not these
        ))

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Start the tracker and servers; return once all servers are registered."""
        self.port = self.port or free_port()
        self._spawn(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                     "--port-end", str(self.port + 1), "--silent"], "tracker")
        self._wait_for_port(self.port, timeout)
        for i in range(self.count):
            port = free_port()
            args = ["workers.rpc_server", "--tracker", f"{self.host}:{self.port}", "--key", self.keys[i],
                    "--host", self.host, "--port", str(port), "--port-end", str(port + 100)]
            env = None
            if self.kind == "cuda":
                args.append("--no-fork")
                env = {"CUDA_VISIBLE_DEVICES": str(i)}
            self._spawn(args, f"server{i}", env)
        self.wait_for_servers(timeout)
        return self

    def _wait_for_port(self, port: int, timeout: float) -> None:
        # Servers started before the tracker listens retry only every 5 s.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.host, port)) == 0:
                    return
            time.sleep(0.1)

    def wait_for_servers(self, timeout: float) -> None:
        from tvm import rpc

        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    self.stop()
                    raise FarmError(f"a local RPC process exited with status {proc.returncode} "
                                    f"(run with --log-dir to see its log)")
            try:
                summary = rpc.connect_tracker(self.host, self.port).summary()
                free = sum(q["free"] for k, q in summary["queue_info"].items() if k in self.keys)
                if free >= self.count:
                    return
                last = f"{free}/{self.count} servers registered"
            except Exception as e:  # the tracker is still starting
                last = str(e).splitlines()[0] if str(e) else type(e).__name__
            time.sleep(0.3)
        self.stop()
        raise FarmError(f"local RPC servers did not start within {timeout:.0f} s ({last})")

    def kill_sessions(self, server: int) -> None:
        """End server `server`'s session processes (a hung kernel); the server restarts."""
        import psutil

        try:
            children = psutil.Process(self.procs[server + 1].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
