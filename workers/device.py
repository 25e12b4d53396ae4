"""A device of this machine as a farm worker: `LocalDevice`, its RPC processes and the Worker
measuring through them.

- `LocalDevice`: the one way the farm starts a device here: a server (and a tracker, when none
  is given) and a `Worker` measuring through it, which compiles at once and measures once the
  server is registered. Worker actors, the in-process worker pool and `farm predict --measure`
  all use it.

Its RPC processes (a tracker, a server) are those of workers.rpc_processes; every process started
here runs in its own process group and is killed with it, and dies with the process that started
it, even one killed with SIGKILL (workers.processes, workers.lifeline).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import socket
import threading
import time
from pathlib import Path

from farm.core.measure import MeasureResult
from farm.core.task import Task
from workers.rpc_processes import LocalTracker, ServerProcess, wait_for_keys
from workers.worker import Worker, WorkerConfig

log = logging.getLogger("farm.device")


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

    def build_and_measure(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        """`Worker.build_and_measure` on this device."""
        return self.worker.build_and_measure(task, indices, shard, round_)

    def device_name(self) -> str:
        """`Worker.device_name` of this device."""
        return self.worker.device_name()

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
