"""Stopping the farm as operators do, and cancelling jobs: the running jobs are given back (or
cancelled) within seconds, their trials kept, nothing left running; a cancelled job frees its
devices at once (issue 44; docs/reliability.md, "Faults").

Each process under test carries a tag of its own in its environment (tests/processes.py), which
everything it starts inherits (Ray's processes, RPC servers, build processes): "nothing left" is
checked by that tag, whoever the processes' parents are by then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from db.store import ResultStore, open_store
from farm.core.jobspec import JobRequest
from tests import processes

pytestmark = pytest.mark.slow

TAG = "FARM_STOP_TAG"
# A job with many candidates in flight when it is stopped: two workers, batches of 16 (up to 32
# candidates in flight each), random search (no wait for a first model).
JOB = [("matmul", {"M": 128, "N": 128, "K": 128})]
STORED_BEFORE_STOP = 24
GIVE_BACK_SECONDS = 5.0  # the bounds
NOTHING_LEFT_SECONDS = 10.0


def _start(args: list[str], log: Path, tag: str) -> subprocess.Popen[bytes]:
    """`args` in a session of its own (as a service manager starts a service), tagged `tag`."""
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, TAG: tag})


def _farm(*args: str) -> list[str]:
    return [sys.executable, "-m", "farm", *args]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str, log: Path | None = None,
              proc: subprocess.Popen[bytes] | None = None) -> float:
    """Seconds until `predicate()` held; fails with `what` (and the log's tail) after `timeout`."""
    start = time.monotonic()
    while not predicate():
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        assert proc is None or proc.poll() is None, f"the process ended before {what}:\n{tail}"
        assert time.monotonic() - start < timeout, f"not {what} within {timeout:.0f} s:\n{tail}"
        time.sleep(0.05)
    return time.monotonic() - start


def _stored(store: ResultStore, job_id: int) -> int:
    return int(store.job(job_id)["trials"])


def _left(tag: str) -> list[psutil.Process]:
    """The tagged processes still running NOTHING_LEFT_SECONDS from now at the latest (none, once
    they are all gone); listed in the assertion."""
    return processes.left_behind(tag, TAG, grace=NOTHING_LEFT_SECONDS)


def _describe(procs: list[psutil.Process]) -> str:
    return "\n".join(processes.describe(p) for p in procs)


def _pid_one(proc: subprocess.Popen[bytes]) -> int:
    """The process `unshare --fork` runs as PID 1 of its PID namespace, as this namespace sees it."""
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(proc.pid).children()):
        assert time.monotonic() < deadline and proc.poll() is None, "unshare started nothing"
        time.sleep(0.05)
    return children[0].pid


def _can_unshare() -> bool:
    return os.geteuid() == 0 and subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                capture_output=True).returncode == 0


# How a service manager, a container runtime or a terminal stops `farm scheduler`.
WAYS = {
    # systemd (KillMode=mixed), `kill PID`: SIGTERM to the service's main process, a session leader.
    "service": ("TERM to the session leader", signal.SIGTERM, False, False),
    # Ctrl-C in a terminal: SIGINT to the whole foreground process group, Ray's processes included.
    "terminal": ("INT to the process group", signal.SIGINT, True, False),
    # `docker stop`: SIGTERM to the container's PID 1, which has no default action for it.
    "container": ("TERM to PID 1 of a PID namespace", signal.SIGTERM, False, True),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_stopped_scheduler_gives_its_job_back_and_leaves_nothing(pg_url: str, tmp_path: Path, way: str) -> None:
    """`farm scheduler` stopped as `way` says, while 2 workers have tens of candidates in flight:
    the job is queued again within 5 s with its trials, and every process the scheduler started
    (Ray's too) is gone within 10 s. (Ray's own SIGTERM handlers used to abort the process 3 s in,
    the job left `running` for the stale-heartbeat rule; a job with little in flight was given back
    before that, which is why a small job did not show it.) In the `service` way another scheduler
    then finishes the job: the budget exact, nothing measured twice."""
    _, signum, to_group, in_namespace = WAYS[way]
    if in_namespace and not _can_unshare():
        if os.environ.get("FARM_CI"):
            pytest.fail("`unshare --pid --fork --mount-proc` is needed (root) for the container case")
        pytest.skip("needs root for `unshare --pid` (a container's PID namespace)")
    store = open_store(pg_url)
    budget = 120 if way == "service" else 400
    job_id = store.submit(JobRequest.build(JOB, "llvm", budget, workers=2, search="random"))
    tag, log = uuid.uuid4().hex, tmp_path / "scheduler.log"
    command = _farm("scheduler", "--db", pg_url, "--poll", "0.3")
    proc = _start(["unshare", "--pid", "--fork", "--mount-proc", *command] if in_namespace else command, log, tag)
    try:
        _wait_for(lambda: _stored(store, job_id) >= STORED_BEFORE_STOP, 240, "trials stored", log, proc)
        target = _pid_one(proc) if in_namespace else proc.pid
        stopped = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(target, signum)
        given_back = _wait_for(lambda: store.job(job_id)["status"] == "queued", 30, "given back", log)
        left = _left(tag)
        gone = time.monotonic() - stopped
        proc.wait(30)
    finally:
        processes.stop(proc)
    job = store.job(job_id)
    assert given_back < GIVE_BACK_SECONDS, log.read_text()[-3000:]
    assert not left, f"{len(left)} process(es) still running {gone:.1f} s after the signal:\n{_describe(left)}"
    assert job["claimed_by"] is None and STORED_BEFORE_STOP <= job["trials"] < budget, job
    assert "given back" in log.read_text()
    if way != "service":
        return
    second = _start(_farm("scheduler", "--db", pg_url, "--poll", "0.3", "--once"), tmp_path / "second.log", tag)
    try:
        second.wait(600)
    finally:
        processes.stop(second)
    trials = store.trials(job_id=job_id)
    assert store.job_status(job_id) == "done" and len(trials) == budget and trials["config_index"].is_unique


def _interrupted_job(store: ResultStore, proc: subprocess.Popen[bytes], log: Path, tag: str,
                     signum: signal.Signals, status: int, dump_first: bool = False) -> None:
    """Signal `proc` (which runs one job of `store` in process) once it has stored trials: it exits
    within 5 s with `status` (0: any non-zero one), the job cancelled ("interrupted") with its trials,
    nothing left. `dump_first`: SIGUSR1 before, which prints the tuning loop's stack (among every
    thread's) to the log and leaves the job running."""
    try:
        _wait_for(lambda: bool(store.jobs(1)) and _stored(store, store.jobs(1)[0]["id"]) >= STORED_BEFORE_STOP,
                  240, "trials stored", log, proc)
        job_id = store.jobs(1)[0]["id"]
        if dump_first:
            proc.send_signal(signal.SIGUSR1)
            _wait_for(lambda: "in run_job" in log.read_text(errors="replace"), 10, "the stacks", log, proc)
            assert proc.poll() is None and store.job(job_id)["status"] == "running"
        stopped = time.monotonic()
        proc.send_signal(signum)
        proc.wait(30)
        exited = time.monotonic() - stopped
        left = _left(tag)
    finally:
        processes.stop(proc)
    job = store.job(job_id)
    ended_as_it_should = proc.returncode == status if status else proc.returncode != 0
    assert exited < GIVE_BACK_SECONDS and ended_as_it_should, (exited, proc.returncode, log.read_text()[-3000:])
    assert job["status"] == "cancelled" and job["error"] == "interrupted" and job["trials"] >= STORED_BEFORE_STOP, job
    assert not left, f"{len(left)} process(es) still running after the exit:\n{_describe(left)}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_farm_tune_stopped_cancels_its_job_and_leaves_nothing(pg_url: str, tmp_path: Path,
                                                              signum: signal.Signals) -> None:
    """`farm tune` stopped by SIGTERM (it used to die at once, its job left `running`) or SIGINT.
    Its job is cancelled, not given back: no service watches an embedded database to run it again.
    Before it, SIGUSR1 prints its threads' stacks and stops nothing (docs/cli.md)."""
    tag, log = uuid.uuid4().hex, tmp_path / "tune.log"
    proc = _start(_farm("tune", "matmul", "M=128", "N=128", "K=128", "--target", "llvm", "--trials", "400",
                        "--workers", "2", "--search", "random", "--db", pg_url), log, tag)
    _interrupted_job(open_store(pg_url), proc, log, tag, signum, 130, dump_first=signum == signal.SIGTERM)
    assert "farm: interrupted" in log.read_text()


EMBEDDED = """
import sys
from farm import Client
with Client(sys.argv[1], in_process=True) as client:
    job = client.submit([("matmul", {"M": 128, "N": 128, "K": 128})], target="llvm", trials=400, workers=2,
                        search="random")
    job.wait(progress=False)
"""


def test_an_embedding_program_stopped_by_sigterm_cancels_its_jobs(pg_url: str, tmp_path: Path) -> None:
    """A program that runs jobs in an in-process `Client` (and sets no SIGTERM handler of its own) is
    stopped like `farm tune`: leaving its `with Client()` block stops the jobs. It ends as a Python
    program ends on an uncaught KeyboardInterrupt."""
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED)
    tag, log = uuid.uuid4().hex, tmp_path / "embedded.log"
    proc = _start([sys.executable, str(script), pg_url], log, tag)
    _interrupted_job(open_store(pg_url), proc, log, tag, signal.SIGTERM, 0)


def test_a_cancelled_job_frees_its_devices_at_once(pg_url: str, tmp_path: Path) -> None:
    """`farm cancel` of a running job with tens of candidates in flight on 2 workers: no candidate
    of it starts on a device later than a second after the cancel, the last one measured ends
    within 2 s of it, and the next job, which waits for the same devices, has its first candidate
    compiling on them within 3 s. (The chunks in flight used to run to their end: 50 more trials
    over 24 s, the next job waiting as long.)"""
    store = open_store(pg_url)
    big = store.submit(JobRequest.build(JOB, "llvm", 400, workers=2, search="random"))
    after = store.submit(JobRequest.build([("matmul", {"M": 64, "N": 64, "K": 64})], "llvm", 8, workers=2,
                                          search="random"))
    tag, log = uuid.uuid4().hex, tmp_path / "scheduler.log"
    proc = _start(_farm("scheduler", "--db", pg_url, "--poll", "0.3"), log, tag)
    try:
        _wait_for(lambda: _stored(store, big) >= STORED_BEFORE_STOP, 240, "trials stored", log, proc)
        assert _stored(store, after) == 0  # it waits for the devices the big job holds
        cancelled = time.time()
        assert store.cancel_job(big)  # what `farm cancel` does
        _wait_for(lambda: store.job(after)["status"] == "done", 240, "the next job done", log, proc)
    finally:
        processes.stop(proc)
    measured = [t["measure"] for t in store.trials(job_id=big)["timeline"] if t and "measure" in t]
    last_start = max(start for start, _ in measured) - cancelled
    last_end = max(end for _, end in measured) - cancelled
    next_build = min(t["build"][0] for t in store.trials(job_id=after)["timeline"] if t and "build" in t) - cancelled
    assert last_start < 1.0 and last_end < 2.0 and next_build < 3.0, (last_start, last_end, next_build,
                                                                       log.read_text()[-3000:])
    assert store.job(big)["status"] == "cancelled" and STORED_BEFORE_STOP <= store.job(big)["trials"] < 400
