"""A worker's device: the `workers.rpc_server` process that measures on it.

`ServerProcess` starts the farm's RPC server for one device as a child process (pinned to a
GPU with CUDA_VISIBLE_DEVICES and run with --no-fork for cuda), registered with a tracker
under its key, and can end the server's session processes when a kernel hangs (the server
then serves again). Used by the one-machine cluster and by worker actors alike.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from farm.errors import FarmError

_REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, "unknown" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def gpu_count() -> int:
    """GPUs visible to this process (nvidia-smi), 0 when there are none."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def spawn_module(args: list[str], log: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m ARGS` in its own process group, this checkout importable, output to `log`."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), full_env.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    out: IO[bytes] | int = subprocess.DEVNULL
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", *args], env=full_env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)  # a Ctrl-C in the terminal reaches the farm only


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
            queues = rpc.connect_tracker(*tracker).summary()["queue_info"]
            missing = [k for k in keys if queues.get(k, {}).get("free", 0) < 1]
            if not missing:
                return
            last = f"not registered yet: {', '.join(missing)}"
        except Exception as e:  # the tracker is still starting
            last = str(e).splitlines()[0] if str(e) else type(e).__name__
        time.sleep(0.3)
    raise FarmError(f"RPC servers did not register with the tracker at {tracker[0]}:{tracker[1]} "
                    f"within {timeout:.0f} s ({last})")


class ServerProcess:
    """The farm RPC server of one device, as a child process of this one."""

    def __init__(self, tracker: tuple[str, int], key: str, kind: str, gpu: str | None = None,
                 host: str = "127.0.0.1", log: Path | None = None, no_fork: bool | None = None) -> None:
        """`no_fork` (default: for cuda) spawns session processes instead of forking them."""
        self.tracker, self.key, self.kind = tracker, key, kind
        port = free_port(host)
        args = ["workers.rpc_server", "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", key,
                "--host", host, "--port", str(port), "--port-end", str(port + 100)]
        env = {}
        if kind == "cuda" if no_fork is None else no_fork:
            args.append("--no-fork")  # a forked process fails its first CUDA allocation
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.proc = spawn_module(args, log, env)

    def kill_sessions(self) -> None:
        """End the server's session processes (a hung kernel); the server serves again."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()
