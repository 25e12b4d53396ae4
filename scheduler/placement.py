"""Placement of the scheduler's worker pools on the cluster's devices: `Placement`.

It owns the pools (their slots: starting, in a job's use, or idle) and the device accounting: a
job gets an idle pool of its shape, the one starting for it, or a new one once the cluster has
the devices (idle pools of other shapes are closed to free theirs); else it waits, first come,
first served. It knows nothing of Ray: the scheduler (scheduler.service) hands it what starts a
pool, what counts the cluster's devices and what to do when the pools change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.pool import WorkerPool

log = logging.getLogger("farm.scheduler")

# A pool's shape: (target kind, device count, RPC keys of devices that run only a TVM server).
Shape = tuple[str, int, tuple[str, ...]]


@dataclass
class _Slot:
    """A worker pool of the scheduler: starting (`pool` None), in a job's use, or idle since `idle_since`."""

    shape: Shape
    name: str  # its workers are NAME-0, NAME-1, ... (their RPC keys and metrics carry it)
    pool: WorkerPool | None = None
    job: int | None = None
    idle_since: float = 0.0

    @property
    def devices(self) -> int:
        """Ray devices it holds: GPUs (logical ones on a CPU cluster); none for RPC-key devices."""
        return 0 if self.shape[2] else self.shape[1]


class Stopped(Exception):
    """A job stopped (cancelled, interrupted, taken over) while it waited for devices."""


class Placement:
    """The scheduler's worker pools and the devices they hold (see the module docstring).

    `start_pool(shape, name)` starts a pool (seconds: called outside the lock); `devices()` counts
    the cluster's devices (None: unknown, and any other pool is in the way); `on_change(pools)` is
    called with the pools up whenever a pool has started or closed. Thread safe: `changed` guards
    the slots and is notified when a pool is freed.
    """

    def __init__(self, start_pool: Callable[[Shape, str], WorkerPool], devices: Callable[[], int | None],
                 on_change: Callable[[list[WorkerPool]], None]) -> None:
        self._start_pool, self._devices, self._on_change = start_pool, devices, on_change
        self._slots: list[_Slot] = []
        self.changed = threading.Condition()  # guards _slots; notified when a pool is freed
        self.waiting = 0  # jobs waiting for devices
        self.placing: dict[int, threading.Event] = {}  # set once the job holds or waits for devices

    def pools(self) -> list[WorkerPool]:
        """The pools up now, in jobs' use or idle."""
        with self.changed:
            return [slot.pool for slot in self._slots if slot.pool is not None]

    def acquire(self, job_id: int | None, shape: Shape, stopped: Callable[[], bool]) -> WorkerPool:
        """A pool of `shape` for job `job_id` (None: a pool left idle for the next job, which
        `pool_for` starts): an idle one of that shape, the one starting for the next job (waited
        for, not started twice), or a new one once the cluster has the devices (idle pools of
        other shapes are closed to free theirs; else it waits for a running job to end).
        Stopped if `stopped()` meanwhile."""
        waiting = False
        try:
            with self.changed:
                while True:
                    mine: _Slot | None = None
                    for slot in self._slots:
                        if slot.shape == shape and slot.job is None:
                            if slot.pool is not None:
                                slot.job = job_id
                                self._placed(job_id)
                                return slot.pool
                            mine = slot  # starting for the next job: this one, unless it fails
                    if mine is not None:
                        self._placed(job_id)
                        if stopped():
                            raise Stopped
                        self.changed.wait(1.0)
                        continue
                    if self._fits(shape):
                        mine = _Slot(shape, self._free_name(shape[0]), job=job_id)
                        self._slots.append(mine)
                        self._placed(job_id)
                        break
                    idle = [slot for slot in self._slots if slot.job is None and slot.pool is not None]
                    if idle:  # an idle pool of another shape gives its devices back
                        victim = min(idle, key=lambda slot: slot.idle_since)
                        self._slots.remove(victim)
                        self.changed.release()
                        try:
                            log.info("closing the idle pool of %d %s worker(s) for a job of another shape",
                                     victim.shape[1], victim.shape[0])
                            victim.pool.close()  # type: ignore[union-attr]
                        finally:
                            self.changed.acquire()
                        continue
                    if not waiting:
                        waiting, self.waiting = True, self.waiting + 1
                        self._placed(job_id)
                        log.info("job %s waits for %d free %s device(s)", job_id, shape[1], shape[0])
                    if stopped():
                        raise Stopped
                    self.changed.wait(1.0)
            try:
                mine.pool = self._start_pool(shape, mine.name)
            except BaseException:
                with self.changed:
                    self._slots.remove(mine)
                    self.changed.notify_all()
                raise
            with self.changed:  # a job waiting for this pool (see above) takes it now
                mine.idle_since = time.monotonic()
                self.changed.notify_all()
            self._on_change(self.pools())
            return mine.pool
        finally:
            if waiting:
                with self.changed:
                    self.waiting -= 1

    def _free_name(self, kind: str) -> str:
        """A worker name prefix no pool up or starting uses (the caller holds the lock): KIND-worker,
        else KIND-worker2, KIND-worker3, ...; two pools at once never share RPC keys or logs."""
        taken = {slot.name for slot in self._slots}
        return next(name for n in range(1, len(taken) + 2)
                    if (name := f"{kind}-worker" + (str(n) if n > 1 else "")) not in taken)

    def _placed(self, job_id: int | None) -> None:
        """Job `job_id` holds its devices or waits for them (see `placing`)."""
        placed = self.placing.get(job_id) if job_id is not None else None
        if placed is not None:
            placed.set()

    def _fits(self, shape: Shape) -> bool:
        """Whether a new pool of `shape` can start now beside the pools up or starting (the caller
        holds the lock): its RPC keys held by none, its devices free in the cluster. Without a count
        of the cluster's devices (`devices()` None: a `pool_factory`), any other pool is in the way. A job larger than
        the whole cluster starts alone (its workers wait for devices to join)."""
        if shape[2]:
            return not any(set(shape[2]) & set(slot.shape[2]) for slot in self._slots)
        held = sum(slot.devices for slot in self._slots)
        total = self._devices()
        if total is None:
            return held == 0
        return held + shape[1] <= total or held == 0

    def release(self, pool: WorkerPool) -> None:
        """`pool`'s job ended: keep it idle for the next job of its shape."""
        with self.changed:
            for slot in self._slots:
                if slot.pool is pool:
                    slot.job, slot.idle_since = None, time.monotonic()
            self.changed.notify_all()

    def close_idle(self, older_than: float = 0.0) -> int:
        """Close the pools idle for more than `older_than` seconds; how many."""
        now = time.monotonic()
        with self.changed:
            idle = [slot for slot in self._slots
                    if slot.job is None and slot.pool is not None and now - slot.idle_since > older_than]
            for slot in idle:
                self._slots.remove(slot)
        for slot in idle:
            log.info("closing the pool of %d %s worker(s), idle for %.0f s", slot.shape[1], slot.shape[0],
                     now - slot.idle_since)
            slot.pool.close()  # type: ignore[union-attr]
        if idle:
            self._on_change(self.pools())
        return len(idle)

    def close(self) -> None:
        """Close every pool."""
        with self.changed:
            slots, self._slots = self._slots, []
        for slot in slots:
            if slot.pool is not None:
                slot.pool.close()
