"""A device of this machine as a farm worker: the RPC processes and the Worker measuring through them.

- `LocalTracker`: a TVM RPC tracker as a child process (the embedded farm's, and `farm predict
  --measure`'s); servers register with it under their device's key. It is kept running: if it
  dies, it is restarted on the same address within seconds, and the servers register with it
  again (workers.rpc_server).
- `ServerProcess`: the farm's RPC server for one device as a child process (pinned to a GPU
  with CUDA_VISIBLE_DEVICES, run with --no-fork for cuda), registered with a tracker; it can
  end the server's session processes when a kernel hangs (the server then serves again).
- `LocalDevice`: the one way the farm starts a device here: a server (and a tracker, when none
  is given) and a `Worker` measuring through it, which compiles at once and measures once the
  server is registered. Worker actors, the in-process worker pool and `farm predict --measure`
  all use it.

Every process started here runs in its own process group and is killed with it, and dies with
the process that started it, even one killed with SIGKILL (workers.lifeline).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from farm.core.backoff import Backoff
from farm.core.errors import FarmError
from farm.core.measure import MeasureResult
from farm.core.task import Task
from workers.worker import Worker, WorkerConfig

_REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("farm.device")


# Where `free_port` picks: above Ray's worker ports (10002-19999 by default), below the kernel's
# ephemeral range (Linux: 32768-60999 by default, /proc/sys/net/ipv4/ip_local_port_range).
PORTS_FROM = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a process started next to listen on.

    Picked at random below the kernel's ephemeral range where it can be, not by binding port 0:
    a port from bind(0) is ephemeral, and in the seconds before the process it is meant for binds
    it (a tracker imports TVM first) the kernel may hand it to any process that binds port 0 or
    connects, as Ray's components do by the dozen as they start. `farm tune` processes started at
    once on one GPU host lost a job so (docs/defaults.md#free-port). Where there is no room below
    the ephemeral range, an ephemeral port as before.
    """
    try:
        ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = PORTS_FROM  # unknown: no room, ephemeral ports
    draw = random.SystemRandom()  # not the random module's state, which tests and searches seed
    for _ in range(64 if ephemeral - PORTS_FROM >= 1000 else 0):
        port = draw.randrange(PORTS_FROM, ephemeral)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use (listening, connected or in TIME_WAIT): another
                continue
            return port
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


VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"  # the GPUs CUDA shows a process


@functools.cache
def gpu_count() -> int:
    """GPUs this process may use, 0 when there are none: those nvidia-smi lists, narrowed by
    CUDA_VISIBLE_DEVICES where it is set (`visible_gpus`; nvidia-smi itself ignores it). Asked
    once per process: nvidia-smi takes a second or more on a GPU host, and `farm tune` needs the
    answer twice (its worker count, Ray's GPU resources)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    listed = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return visible_gpus(listed, os.environ.get(VISIBLE_GPUS_ENV))


def visible_gpus(listed: int, visible: str | None) -> int:
    """How many of a machine's `listed` GPUs CUDA shows a process whose CUDA_VISIBLE_DEVICES is
    `visible` (None: unset, all of them): its comma-separated entries up to the first that names
    no GPU (CUDA stops there: "1,7" on a 2-GPU machine is GPU 1 alone, "" and "-1" hide them all).
    An entry is an index below `listed`, or a GPU or MIG UUID (taken to exist)."""
    if visible is None:
        return listed
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < listed)):
            break
        count += 1
    return min(count, listed)


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


class LocalDevice:
    """One device as a farm worker: `worker` measures `kind` kernels through its RPC server.

    With `own_server` (the default) the device's server is started here, pinned to `gpu` for
    cuda, registered with `tracker` (a tracker is started here when `tracker` is None) under
    `key` (default `farm-KIND-HOST-NAME`). Without it, `key` names a server someone else runs
    (a lab board with a stock TVM server): sessions are kept short there, since a hung kernel
    holds that device until its server ends the session. `close()` stops the worker and every
    process started here.

    `start()` returns as soon as the processes are started: the worker's build processes warm up
    and compile while the server comes up (a CUDA server takes seconds: TVM's import, the
    driver). Measuring waits until a free server is registered under `key` (its session then
    opens in the background); if none is within `register_timeout`, or the server exits first,
    `ready()` and every call of the worker fail with a FarmError saying so.
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
        self._registered: cf.Future[None] = cf.Future()

    @property
    def worker(self) -> Worker:
        assert self._worker is not None, "start() first"
        return self._worker

    def start(self) -> LocalDevice:
        started = time.monotonic()
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
            self._worker = Worker.create(config, on_hang=self.server.kill_sessions if self.server else None,
                                         ready=self._registered)
            # Start-up in parallel: the build processes (TVM imports, a first nvcc) start while the
            # server registers, and the session opens in the background once it has.
            self._worker.builder.warm(self.kind)
            threading.Thread(target=self._register, args=(self._worker, started), daemon=True,
                             name=f"farm-register-{self.name}").start()
        except BaseException:
            self.close()
            raise
        return self

    def _register(self, worker: Worker, started: float) -> None:
        """Wait for the server's registration, then open the session in the background."""
        try:
            wait_for_keys(self.tracker_address, [self.key], self.register_timeout,  # type: ignore[arg-type]
                          [self.server.proc] if self.server else [])
            # The first session opens after this, seconds after the server said it was serving, and
            # the first candidates may wait for it (docs/defaults.md#start-up).
            log.info("%s: the server under %s registered %.1f s after the device started", self.name, self.key,
                     time.monotonic() - started)
            if self.server is not None:  # registered once: from now on a server that ends is started again
                self.server.watch()
            worker.runner.warm()
            self._registered.set_result(None)
        except BaseException as e:
            self._registered.set_exception(e)

    def ready(self, timeout: float | None = None) -> LocalDevice:
        """Return once the device can measure (its server registered); its FarmError if it cannot."""
        self._registered.result(timeout)
        return self

    def process(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        """`Worker.process` on this device."""
        return self.worker.process(task, indices, shard, round_)

    def cancel(self) -> None:
        """`Worker.cancel` on this device: its calls in flight stop."""
        self.worker.cancel()

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
