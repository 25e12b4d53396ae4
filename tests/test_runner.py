"""The measure stage against a real TVM RPC tracker and server: results, and failures as data."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.core.measure import Status
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from workers.compiler import BuildResult
from workers.rpc_processes import LocalTracker, ServerProcess, wait_for_keys
from workers.runner import RPCRunner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["fork", "no-fork"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tracker and one farm RPC server for llvm, as `farm tune` starts them; also with
    spawned session processes (--no-fork), as every cuda server runs."""
    logs = tmp_path_factory.mktemp("rpc-logs")
    with LocalTracker(log=logs / "tracker.log") as tracker:
        server = ServerProcess(tracker.address, "test-cpu", "llvm", log=logs / "server.log",
                               no_fork=request.param == "no-fork")
        try:
            wait_for_keys(tracker.address, [server.key], 60, [server.proc])
            yield server
        finally:
            server.stop()


def _export(tmp: Path, name: str, size: int, offset: float = 0.0) -> BuildResult:
    """A matmul library built straight from TE (unscheduled loops), adding `offset` to C."""
    import tvm
    from tvm import te

    a = te.placeholder((size, size), name="A")
    b = te.placeholder((size, size), name="B")
    k = te.reduce_axis((0, size), name="k")
    c = te.compute((size, size), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    out = te.compute((size, size), lambda i, j: c[i, j] + offset, name="out")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([a, b, out])}), target=parse_target("llvm").tvm())
    path = tmp / f"{name}.so"
    lib.export_library(str(path))
    return BuildResult(0, {}, library=str(path))


def _matmul(size: int) -> Task:
    return Task(make_workload("matmul", {"M": size, "N": size, "K": size}), parse_target("llvm"))


def _runner(server: ServerProcess, **kw: Any) -> RPCRunner:
    return RPCRunner(server.tracker, server.key, "llvm", on_hang=server.kill_sessions, **kw)


def test_correct_kernels_share_one_session(server: ServerProcess, tmp_path: Path) -> None:
    runner = _runner(server)
    task = _matmul(32)
    results = runner.measure(task, [_export(tmp_path, f"ok{i}", 32) for i in range(4)])
    assert [r.status for r in results] == [Status.OK] * 4, [r.error for r in results]
    for r in results:
        assert len(r.latencies) == runner.evaluator.repeat and r.latency and r.latency > 0
        assert r.device
    assert runner.sessions_opened == 1


def test_wrong_output_is_recorded(server: ServerProcess, tmp_path: Path) -> None:
    runner = _runner(server)
    (r,) = runner.measure(_matmul(32), [_export(tmp_path, "off", 32, offset=1.0)])
    assert r.status is Status.WRONG_RESULT and "relative error" in r.error
    assert r.latencies == []


def test_build_failures_pass_through(server: ServerProcess) -> None:
    runner = _runner(server)
    failed = BuildResult(7, {"x": 1}, Status.BUILD_ERROR, "nvcc: error", build_seconds=0.5)
    (r,) = runner.measure(_matmul(32), [failed])
    assert (r.status, r.error, r.config_index, r.build_seconds) == (Status.BUILD_ERROR, "nvcc: error", 7, 0.5)
    assert runner.sessions_opened == 0


def test_crashing_kernel_is_recorded_and_the_run_goes_on(server: ServerProcess, tmp_path: Path) -> None:
    src = tmp_path / "boom.c"
    src.write_text("#include <stdlib.h>\n__attribute__((constructor)) static void boom(void) { abort(); }\n")
    lib = tmp_path / "boom.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    runner = _runner(server)
    task = _matmul(32)
    crash, after = runner.measure(task, [BuildResult(1, {}, library=str(lib)), _export(tmp_path, "after", 32)])
    assert crash.status is Status.RUNTIME_ERROR, crash
    assert after.status is Status.OK, after.error


def _session_processes(server: ServerProcess) -> dict[int, str]:
    """Spawned session processes of the server (standing by or serving): pid -> working folder."""
    import psutil

    found = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "multiprocessing.spawn" in " ".join(p.cmdline()):
                found[p.pid] = p.cwd()
        except psutil.NoSuchProcess:
            pass
    return found


def test_hanging_kernel_times_out_and_the_run_goes_on(server: ServerProcess, tmp_path: Path) -> None:
    """The hung session's process is killed; with --no-fork the one standing by for the next
    session is not, and serves it."""
    import tempfile

    runner = _runner(server, timeout=1.0)
    slow, after = runner.measure(_matmul(1024), [_export(tmp_path, "slow", 1024)])[0], None
    assert slow.status is Status.TIMEOUT, slow
    standing_by: list[int] = []
    if "--no-fork" in server.proc.args:
        # The standby moves to the temporary folder once TVM is imported: seconds on 2 cores that
        # the hung kernel kept busy.
        deadline = time.monotonic() + 30
        while not standing_by and time.monotonic() < deadline:
            time.sleep(0.2)
            standing_by = [pid for pid, cwd in _session_processes(server).items() if cwd == tempfile.gettempdir()]
        assert len(standing_by) == 1, _session_processes(server)
    else:
        assert _session_processes(server) == {}
    runner.timeout = 30.0
    (after,) = runner.measure(_matmul(32), [_export(tmp_path, "after", 32)])
    assert after.status is Status.OK, after.error
    serving = _session_processes(server)
    assert all(serving.get(pid, tempfile.gettempdir()) != tempfile.gettempdir() for pid in standing_by), serving


def test_once_a_best_is_known_a_hang_costs_about_a_second(server: ServerProcess, tmp_path: Path) -> None:
    """`timeout` bounds a candidate until the session holds the workload and a best is known; then
    the bound is what a candidate near the best could take (a second and a little, here)."""
    src = tmp_path / "hang.c"
    src.write_text("#include <unistd.h>\n__attribute__((constructor)) static void hang(void) { sleep(120); }\n")
    lib = tmp_path / "hang.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    runner = _runner(server, timeout=60.0)
    task = _matmul(32)
    assert runner.time_limit(task) == 60.0
    (ok,) = runner.measure(task, [_export(tmp_path, "ok", 32)])
    assert ok.status is Status.OK, ok.error
    limit = runner.time_limit(task)
    assert 1.0 < limit < 2.0, limit
    start = time.monotonic()
    (hung,) = runner.measure(task, [BuildResult(1, {}, library=str(lib))])
    assert hung.status is Status.TIMEOUT and f"{limit:.1f} s" in hung.error, hung
    assert time.monotonic() - start < limit + 5
    assert runner.time_limit(task) == 60.0  # the next session uploads the inputs again
    (after,) = runner.measure(task, [_export(tmp_path, "after", 32)])
    assert after.status is Status.OK, after.error


def test_candidates_far_slower_than_the_best_are_timed_once(server: ServerProcess, tmp_path: Path) -> None:
    runner = _runner(server, screen_factor=0.5)  # every kernel after the first counts as "slow"
    first, second = runner.measure(_matmul(64), [_export(tmp_path, f"k{i}", 64) for i in range(2)])
    assert first.ok and len(first.latencies) == runner.evaluator.repeat
    assert second.ok and len(second.latencies) == 1 and second.latency and second.latency > 0
    runner.close()  # a device serves one session at a time
    unscreened = _runner(server, screen_factor=None)
    results = unscreened.measure(_matmul(64), [_export(tmp_path, f"u{i}", 64) for i in range(2)])
    assert [len(r.latencies) for r in results] == [3, 3], [r.error for r in results]



def test_a_spawning_server_serves_each_session_in_a_process_started_before_it(tmp_path: Path) -> None:
    """--no-fork (every cuda server): the process that serves a session was spawned before the
    client connected (workers.rpc_server.Standby), and so was the next session's, once the first
    had started; both sessions call the farm's functions."""
    import tempfile
    import time

    from tvm import rpc

    with LocalTracker(log=tmp_path / "tracker.log") as tracker:
        server = ServerProcess(tracker.address, "test-standby", "llvm", log=tmp_path / "server.log", no_fork=True)
        try:
            wait_for_keys(tracker.address, [server.key], 60, [server.proc])
            for _ in range(2):
                deadline = time.monotonic() + 60
                while not (before := _session_processes(server)) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert before, "no session process stands by for the next session"
                sess = rpc.connect_tracker(*tracker.address).request(server.key, session_timeout=60)
                assert sess.get_function("farm.device.name")("llvm").startswith("CPU ")
                # One that stood by now works in the session's folder (a standby waits in the temp folder).
                now = _session_processes(server)
                assert [pid for pid in before if now.get(pid, tempfile.gettempdir()) != tempfile.gettempdir()]
                del sess
        finally:
            server.stop()
    assert "standby session process was gone" not in (tmp_path / "server.log").read_text()


def test_a_killed_server_is_started_again_and_registers_under_its_key(tmp_path: Path) -> None:
    """kill -9 of a watched server (a device's, once registered): it is started again, registers
    under the same key, and serves the next session; nothing of the killed one is left."""
    import os
    import signal
    import time

    import psutil

    with LocalTracker(log=tmp_path / "tracker.log") as tracker:
        server = ServerProcess(tracker.address, "test-restart", "llvm", log=tmp_path / "server.log", no_fork=True)
        try:
            wait_for_keys(tracker.address, [server.key], 60, [server.proc])
            server.watch()
            killed = psutil.Process(server.proc.pid)
            group = [killed, *killed.children(recursive=True)]  # the server and its standby
            os.kill(killed.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while server.restarts < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.restarts == 1 and server.proc.pid != killed.pid
            assert not psutil.wait_procs(group, timeout=10)[1]
            wait_for_keys(tracker.address, [server.key], 60, [server.proc])
            (result,) = _runner(server).measure(_matmul(32), [_export(tmp_path, "after-restart", 32)])
            assert result.status is Status.OK, result.error
        finally:
            server.stop()
