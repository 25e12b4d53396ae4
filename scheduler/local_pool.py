"""A WorkerPool in this process: each worker's batches run in threads of the scheduler's process.

It runs the real tuning loop (scheduler.tuner.run_job) without a Ray cluster. Its workers are
anything with the worker's `build_and_measure`/`cancel`/`close` (a workers.device.LocalDevice, or a caller's own,
such as the benchmarks' memoising device); the shards' searches are objects of this process
(scheduler.local_searches.LocalSearches).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from farm.core.measure import MeasureResult
from farm.core.task import Task
from scheduler.local_searches import LocalSearches
from scheduler.pool import MAX_CALLS
from workers.device import LocalDevice
from workers.rpc_processes import LocalTracker


class BatchWorker(Protocol):
    """What a LocalWorkerPool runs batches on (workers.worker.Worker's contract)."""

    name: str

    def build_and_measure(self, task: Task, indices: list[int], shard: int = 0,
                          round_: int = 0) -> list[MeasureResult]: ...

    def device_name(self) -> str: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class LocalWorkerPool:
    """`workers` measuring in this process; the pool owns them (and `tracker`) and closes them.

    A worker here has no process of its own that could die and be replaced: an exception it
    raises fails that call's future, and the tuning loop measures the configs again.
    """

    def __init__(self, workers: Sequence[BatchWorker], tracker: LocalTracker | None = None) -> None:
        self.workers = list(workers)
        self.tracker = tracker
        self._threads = cf.ThreadPoolExecutor(len(self.workers) * MAX_CALLS, thread_name_prefix="farm-worker")

    @classmethod
    def on_this_machine(cls, kind: str, count: int = 1, rpc_keys: Sequence[str] = (),
                        tracker: tuple[str, int] | None = None, build_workers: int | None = None,
                        log_dir: Path | None = None, register_timeout: float = 90.0) -> LocalWorkerPool:
        """`count` devices of this machine (GPU i for the i-th with cuda), or one worker per
        entry of `rpc_keys` (servers someone else runs), registered with `tracker` (one is
        started here when None); a device with no free server registered within
        `register_timeout` fails its calls with a FarmError (workers.device.LocalDevice)."""
        own = None if tracker is not None else LocalTracker(log=log_dir / "tracker.log" if log_dir else None).start()
        address = tracker or own.address  # type: ignore[union-attr]
        devices: list[LocalDevice] = []
        try:
            if rpc_keys:
                devices = [LocalDevice(kind, f"local-{i}", address, key=k, own_server=False,
                                       build_workers=build_workers, register_timeout=register_timeout).start()
                           for i, k in enumerate(rpc_keys)]
            else:
                devices = [LocalDevice(kind, f"local-{i}", address, gpu=str(i), build_workers=build_workers,
                                       log_dir=log_dir, register_timeout=register_timeout).start()
                           for i in range(count)]
        except BaseException:
            for d in devices:
                d.close()
            if own is not None:
                own.stop()
            raise
        return cls(devices, own)

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def dispatch(self, worker: int, task: Task, indices: list[int], shard: int,
               round_: int) -> cf.Future[list[MeasureResult]]:
        return self._threads.submit(self.workers[worker].build_and_measure, task, indices, shard, round_)

    def searches(self, search: str, task: Task, seed: int, measured: Mapping[int, float | None]) -> LocalSearches:
        return LocalSearches(search, task, seed, self.size, measured)

    def devices(self, timeout: float) -> set[str]:
        calls = [self._threads.submit(w.device_name) for w in self.workers]
        done, _ = cf.wait(calls, timeout)
        return {f.result() for f in done if f.exception() is None}

    def cancel(self) -> None:
        for w in self.workers:
            w.cancel()

    def grow(self) -> int:
        """Never: this pool's workers are the ones it was given."""
        return 0

    def ready(self, worker: int) -> bool:
        """Always: a worker here is an object of this process."""
        return True

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for w in self.workers:
            w.close()
        self.workers.clear()
        if self.tracker is not None:
            self.tracker.stop()
