"""The scheduler's parts on their own, without Ray, a database or devices: the placement of pools
(scheduler.placement) and the recording of how jobs ended (scheduler.recording)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from db.outage import DatabaseUnavailable
from scheduler.placement import Placement, Shape, Stopped
from scheduler.recording import JobEnds

LLVM_1: Shape = ("llvm", 1, ())
LLVM_2: Shape = ("llvm", 2, ())


class FakePool:
    def __init__(self, shape: Shape, name: str) -> None:
        self.shape, self.name, self.closed = shape, name, False

    def close(self) -> None:
        self.closed = True


def placement(devices: int | None) -> tuple[Placement, list[FakePool], list[list[Any]]]:
    started: list[FakePool] = []
    changes: list[list[Any]] = []

    def start(shape: Shape, name: str) -> Any:
        started.append(FakePool(shape, name))
        return started[-1]

    return Placement(start, lambda: devices, changes.append), started, changes


def test_a_released_pool_serves_the_next_job_of_its_shape() -> None:
    slots, started, changes = placement(devices=2)
    pool = slots.acquire(1, LLVM_1, lambda: False)
    assert started == [pool] and pool.name == "llvm-worker" and changes == [[pool]]
    slots.release(pool)
    assert slots.acquire(2, LLVM_1, lambda: False) is pool and len(started) == 1
    other = slots.acquire(3, LLVM_1, lambda: False)  # the first is in use: a second, under its own name
    assert other is not pool and other.name == "llvm-worker2" and slots.pools() == [pool, other]


def test_an_idle_pool_of_another_shape_gives_its_devices_back() -> None:
    slots, _, changes = placement(devices=2)
    small = slots.acquire(1, LLVM_1, lambda: False)
    slots.release(small)
    large = slots.acquire(2, LLVM_2, lambda: False)
    assert small.closed and slots.pools() == [large] and changes[-1] == [large]


def test_a_job_waits_for_devices_held_by_another_until_stopped() -> None:
    slots, _, _ = placement(devices=1)
    slots.acquire(1, LLVM_1, lambda: False)
    placed = threading.Event()
    slots.placing[2] = placed
    with pytest.raises(Stopped):
        slots.acquire(2, LLVM_2, lambda: placed.is_set())  # it waits, so placed is set
    assert placed.is_set() and slots.waiting == 0


def test_idle_pools_are_closed_and_close_closes_them_all() -> None:
    slots, _, _ = placement(devices=None)  # devices unknown: any other pool is in the way
    first = slots.acquire(1, LLVM_1, lambda: False)
    slots.release(first)
    assert slots.close_idle(older_than=3600) == 0 and slots.close_idle() == 1 and first.closed
    second = slots.acquire(2, LLVM_1, lambda: False)
    slots.close()
    assert second.closed and slots.pools() == []


class FlakyStore:
    """A store that is unavailable until `back` is set; records what it is told."""

    def __init__(self) -> None:
        self.back, self.calls = False, []

    def finish_job(self, job_id: int, status: str, error: str, scheduler_id: str | None = None) -> bool:
        if not self.back:
            raise DatabaseUnavailable("down")
        self.calls.append(("finish", job_id, status, error, scheduler_id))
        return True

    def give_back(self, job_id: int, scheduler_id: str) -> bool:
        if not self.back:
            raise DatabaseUnavailable("down")
        self.calls.append(("give_back", job_id, scheduler_id))
        return True


def test_a_job_end_is_kept_while_the_database_is_unavailable_and_recorded_once_it_is_back() -> None:
    store = FlakyStore()
    ends = JobEnds(store, "me")  # type: ignore[arg-type]
    ends.record(1, "done", "")
    ends.record(2, "queued", "")
    assert ends.unrecorded == {1: ("done", ""), 2: ("queued", "")} and store.calls == []
    store.back = True
    ends.record_unrecorded()
    assert ends.unrecorded == {}
    assert sorted(store.calls) == [("finish", 1, "done", "", "me"), ("give_back", 2, "me")]
