"""A device of this machine as a farm worker: the RPC processes and the Worker measuring through them.

- `LocalTracker`: a TVM RPC tracker as a child process (the embedded farm's, and `farm predict
  --measure`'s); servers register with it under their device's key.
- `ServerProcess`: the farm's RPC server for one device as a child process (pinned to a GPU
  with CUDA_VISIBLE_DEVICES, run with --no-fork for cuda), registered with a tracker; it can
  end the server's session processes when a kernel hangs (the server then serves again).
- `LocalDevice`: the one way the farm starts a device here: a server (and a tracker, when none
  is given), waiting until it is registered, and a `Worker` measuring through it. Worker actors,
  the in-process worker pool and `farm predict --measure` all use it.

Every process started here runs in its own process group and is killed with it.
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

from farm.core.errors import FarmError
from farm.core.measure import MeasureResult
from farm.core.task import Task
from workers.worker import Worker, WorkerConfig

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


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill `proc` and every process it started (its process group), and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()


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
        kill_group(self.proc)


class LocalTracker:
    """A TVM RPC tracker on this machine; `stop()` (or leaving `with`) ends it.

    It binds to `host` (127.0.0.1 by default: an RPC server executes whatever it is sent)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log: Path | None = None) -> None:
        self.host, self.port, self.log = host, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def start(self, timeout: float = 30.0, wait: bool = True) -> LocalTracker:
        """Start it; with `wait`, return once it accepts connections (FarmError if it does not),
        else at once (its clients retry while it starts)."""
        self.port = self.port or free_port(self.host)
        self.proc = spawn_module(["tvm.exec.rpc_tracker", "--host", self.host, "--port", str(self.port),
                                  "--port-end", str(self.port + 1), "--silent"], self.log)
        if not wait:
            return self
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
        if self.proc is not None:
            kill_group(self.proc)

    def __enter__(self) -> LocalTracker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalDevice:
    """One device as a farm worker: `worker` measures `kind` kernels through its RPC server.

    With `own_server` (the default) the device's server is started here, pinned to `gpu` for
    cuda, registered with `tracker` (a tracker is started here when `tracker` is None) under
    `key` (default `farm-KIND-HOST-NAME`). Without it, `key` names a server someone else runs
    (a lab board with a stock TVM server): sessions are kept short there, since a hung kernel
    holds that device until its server ends the session. `start()` returns once the server is
    registered (FarmError after `register_timeout` or if it exits); `close()` stops the worker
    and every process started here.
    """

    def __init__(self, kind: str, name: str = "local", tracker: tuple[str, int] | None = None,
                 key: str | None = None, gpu: str | None = None, own_server: bool = True,
                 host: str = "127.0.0.1", build_workers: int | None = None, log_dir: Path | None = None,
                 register_timeout: float = 90.0) -> None:
        self.kind, self.name, self.gpu, self.own_server, self.host = kind, name, gpu, own_server, host
        self.key = key or f"farm-{kind}-{socket.gethostname()}-{name}"
        self.build_workers, self.log_dir, self.register_timeout = build_workers, log_dir, register_timeout
        self.tracker: LocalTracker | None = None
        self.tracker_address = tracker
        self.server: ServerProcess | None = None
        self._worker: Worker | None = None

    @property
    def worker(self) -> Worker:
        assert self._worker is not None, "start() first"
        return self._worker

    def start(self) -> LocalDevice:
        try:
            if self.tracker_address is None:
                self.tracker = LocalTracker(log=self.log_dir / "tracker.log" if self.log_dir else None).start()
                self.tracker_address = self.tracker.address
            if self.own_server:
                log = self.log_dir / f"{self.name}.log" if self.log_dir else None
                self.server = ServerProcess(self.tracker_address, self.key, self.kind,
                                            self.gpu if self.kind == "cuda" else None, host=self.host, log=log)
            config = WorkerConfig(name=self.name, tracker=self.tracker_address, key=self.key, kind=self.kind,
                                  build_workers=self.build_workers,
                                  session_timeout=600.0 if self.own_server else 120.0)
            self._worker = Worker.create(config, on_hang=self.server.kill_sessions if self.server else None)
            # Start-up in parallel: the build processes (TVM imports, a first nvcc) start while the
            # server registers, and the session opens in the background once it has.
            self._worker.builder.warm(self.kind)
            if self.server is not None:
                wait_for_keys(self.tracker_address, [self.key], self.register_timeout, [self.server.proc])
            self._worker.runner.warm()
        except BaseException:
            self.close()
            raise
        return self

    def process(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        """`Worker.process` on this device."""
        return self.worker.process(task, indices, shard, round_)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.tracker is not None:
            self.tracker.stop()
            self.tracker = None

    def __enter__(self) -> LocalDevice:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
