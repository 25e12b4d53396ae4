"""How many candidates a worker keeps in flight (scheduler.pool.Lead): pure logic, from the build and
device seconds of the results it returned."""

from __future__ import annotations

from farm.core.measure import MeasureResult, Status
from scheduler.pool import Lead


def _results(n: int, build: float, run: float, status: Status = Status.OK) -> list[MeasureResult]:
    return [MeasureResult(i, {}, status, build_seconds=build, run_seconds=run) for i in range(n)]


def test_the_cap_holds_until_a_chunk_of_results_has_come_back() -> None:
    lead = Lead(chunk=4, most=32)
    assert lead.size == 32
    lead.observe(_results(3, build=1.6, run=0.25))
    assert lead.size == 32
    lead.observe(_results(1, build=1.6, run=0.25))
    assert lead.size == 15  # 1.6 / 0.25 = 6.4 compiling at once, 7, and two chunks


def test_a_device_that_sets_the_pace_gets_what_its_builds_need_and_builds_that_do_get_the_cap() -> None:
    device_bound, build_bound = Lead(chunk=4, most=32), Lead(chunk=4, most=32)
    device_bound.observe(_results(16, build=1.0, run=0.5))
    build_bound.observe(_results(16, build=1.0, run=0.02))  # a CPU device: 50 compiling would not be enough
    assert device_bound.size == 2 + 8
    assert build_bound.size == 32


def test_never_fewer_than_two_chunks_nor_more_than_the_cap() -> None:
    slow_device = Lead(chunk=4, most=32)
    slow_device.observe(_results(16, build=0.01, run=2.0))
    assert slow_device.size == 1 + 8  # one compiling, one chunk measured, one waiting
    instant_builds = Lead(chunk=4, most=32)
    instant_builds.observe(_results(16, build=0.0, run=2.0))
    assert instant_builds.size == 8
    small = Lead(chunk=2, most=3)  # a batch of 1 or 2: its cap is under two chunks
    small.observe(_results(8, build=0.01, run=2.0))
    assert small.size == 3


def test_failed_builds_take_no_device_time_and_old_results_leave_the_window() -> None:
    lead = Lead(chunk=4, most=64, window=8)
    lead.observe(_results(4, build=1.0, run=0.25) + _results(4, build=1.0, run=0.0, status=Status.BUILD_ERROR))
    # The device measures half of what is built: 0.125 s a candidate handed out, 8 compiling at once.
    assert lead.size == 8 + 8
    lead.observe(_results(8, build=0.5, run=0.5))  # the window now holds these alone
    assert lead.size == 1 + 8
    none_ran = Lead(chunk=4, most=32)
    none_ran.observe(_results(8, build=1.0, run=0.0, status=Status.BUILD_ERROR))
    assert none_ran.size == 32  # nothing says how fast the device goes
