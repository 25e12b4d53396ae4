"""The build stage's slots: a hung or crashing compile costs only its own candidate."""

from __future__ import annotations

import concurrent.futures as cf
import time

from farm.core.measure import Status
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from tests.build_faults import CRASH, HANG, faulty_build
from workers.builder import ProcessPoolBuilder

TASK = Task(make_workload("matmul", {"M": 32, "N": 32, "K": 32}), parse_target("llvm"))


def test_hang_and_crash_are_recorded_and_the_rest_builds() -> None:
    indices = list(range(10))
    with ProcessPoolBuilder(workers=2, timeout=8, build=faulty_build) as builder:
        results = builder.build(TASK, indices)
        by_index = {r.config_index: r for r in results}
        assert [r.config_index for r in results] == indices  # one result per index, in order
        assert by_index[HANG].status is Status.TIMEOUT
        assert by_index[CRASH].status is Status.BUILD_ERROR and "crashed" in by_index[CRASH].error
        others = [r for i, r in by_index.items() if i not in (HANG, CRASH)]
        assert all(r.status in (None, Status.INVALID) for r in others), [r.error for r in others]
        assert any(r.ok and r.library for r in others)
        # The replaced processes serve later candidates.
        again = builder.build(TASK, [11, 12])
        assert all(r.status in (None, Status.INVALID) for r in again)


def test_timeout_counts_from_the_start_of_the_build_not_the_queue() -> None:
    """Twelve candidates queued behind one slot: waiting is not building, none times out."""
    with ProcessPoolBuilder(workers=1, timeout=6) as builder:
        builder.warm("llvm")
        results = builder.build(TASK, list(range(20, 32)))
    assert not [r for r in results if r.status is Status.TIMEOUT]


def test_results_arrive_as_each_candidate_is_built() -> None:
    with ProcessPoolBuilder(workers=2, timeout=20, build=faulty_build) as builder:
        futures = builder.submit(TASK, [HANG, 0, 1])
        start = time.monotonic()
        done, _ = cf.wait(futures[1:], timeout=18)
        assert len(done) == 2 and time.monotonic() - start < 18  # not held back by the hung one
        assert futures[0].result(timeout=40).status is Status.TIMEOUT
