"""The distributed farm for real: Ray worker actors owning TVM RPC servers, Postgres results,
schedulers and clients in separate processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from db.store import ResultStore, open_store
from farm.client import Client
from farm.core.errors import FarmError
from farm.core.jobspec import JobRequest
from scheduler.service import Scheduler
from scheduler.tuner import BRIDGE_CHUNKS, CHUNK
from tests.processes import stop

pytestmark = pytest.mark.slow

SMALL = [("matmul", {"M": 48, "N": 48, "K": 48})]


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """One local Ray instance for the in-process tests, with two logical GPUs."""
    import ray

    from scheduler.cluster import init_ray

    init_ray()
    yield
    ray.shutdown()


def test_local_ray_starts_only_what_the_farm_uses(ray_local: None) -> None:
    """The local instance has its GCS and raylet, not the dashboard's API server, the autoscaler's
    monitor or the log monitor (scheduler.cluster._HEAD_EXTRAS); Ray's node class is as it was."""
    import ray
    from ray._private import worker
    from ray._private.node import Node

    from scheduler.cluster import _HEAD_EXTRAS

    assert sorted(worker._global_node.all_processes) == ["gcs_server", "raylet"]
    assert all(getattr(Node, name).__module__ == "ray._private.node" for name in _HEAD_EXTRAS)

    @ray.remote(num_cpus=0)
    def add(a: int, b: int) -> int:
        return a + b

    assert ray.get(add.remote(40, 2)) == 42


def test_two_worker_actors_share_a_job_exactly(pg_url: str, ray_local: None) -> None:
    """Model-guided: the shards' searches run in Ray actors, and the model retrained after the
    first round guides the later ones."""
    store = open_store(pg_url)
    # Rounds of 10 (2 workers x batch 5): the first holds the task's baseline, which trains nothing,
    # and 9 configs, as many as a first model needs and more.
    request = JobRequest.build(SMALL, "llvm", 22, workers=2, batch_size=5, search="xgb")
    job_id = store.submit(request)
    with Scheduler(store) as scheduler:
        assert store.claim_job(scheduler.id, job_id=job_id) == job_id
        assert scheduler.run_job(job_id) == "done"
        # A search actor that died between jobs is replaced: the pool's next job runs, its search
        # spec with options reaching the actors and stored as given.
        import ray

        (pool,) = scheduler.pools()
        ray.kill(pool._search_actors[0])
        again = store.submit(JobRequest.build([("matmul", {"M": 32, "N": 48, "K": 48})], "llvm", 8, workers=2,
                                              batch_size=4, search="xgb:screen=8,epsilon=0.25"))
        assert scheduler.claim_and_run(again) == "done"
        assert len(store.trials(job_id=again)) == 8
        assert store.job(again)["search"] == "xgb:screen=8,epsilon=0.25"
    trials = store.trials(job_id=job_id)
    assert len(trials) == 22  # the budget, exactly
    assert trials["config_index"].is_unique  # no config measured twice
    assert set(trials["shard"]) == {0, 1}  # every shard visited
    assert set(trials["worker"]) == {"llvm-worker-0", "llvm-worker-1"}  # both workers measured
    assert (trials["status"] == "ok").sum() >= 20
    assert store.job_status(job_id) == "done"
    (task,) = store.tasks(job_id)
    rounds = store.rounds(task["id"])
    # A round closes every 10 results, or later while the previous round's model is still training in
    # the background; the last one closes with the budget.
    assert 2 <= len(rounds) <= 3 and rounds[-1]["trials"] == 22
    assert [r["trials"] for r in rounds] == sorted(r["trials"] for r in rounds) and rounds[0]["trials"] >= 10
    assert rounds[0]["model_id"] is None and rounds[1]["model_id"] is not None  # trained on the first round
    # Each trial says what proposed it: the first round's random draws, those that bridged the
    # wait for the first model (a chunk of 4 per worker at most), then the model's plan and its
    # screened exploration (half each, so both among the rest).
    assert set(trials[trials["round"] == 0]["origin"]) == {"baseline", "random"}
    later = trials[trials["round"] >= 1]["origin"]
    assert {"explore", "plan"} <= set(later) <= {"random", "explore", "plan"}
    assert (later == "random").sum() <= 2 * BRIDGE_CHUNKS * 4


def test_shard_searches_in_ray_actors_plan_as_in_process_ones(ray_local: None) -> None:
    """Each shard's SearchActor gets the model through the object store and proposes exactly what
    the same search in this process proposes; its results reach it before its next proposal. A
    second task's searches opened on the same actors (a model job's next slice) leave the first
    task's as they were: coming back to it, its proposals go on as the in-process search's do."""
    import numpy as np
    import ray

    from farm.core.costmodel import CostModel, StoredModel
    from farm.core.features import featurizer
    from farm.core.measure import MeasureResult, Status
    from farm.core.targets import parse_target
    from farm.core.task import Task
    from farm.core.workloads import make_workload
    from scheduler.local_searches import LocalSearches
    from scheduler.ray_searches import RaySearches, SearchActor

    task = Task(make_workload("matmul", {"M": 64, "N": 64, "K": 512}), parse_target("llvm"))
    feats = featurizer(task)
    indices = np.random.default_rng(0).choice(task.space.size, 200, replace=False)
    x = feats.features(feats.codes(indices))
    # Made-up scores that vary with the config (a constant column, such as a workload's, trains nothing).
    varying = x[:, x.std(axis=0) > 0].sum(axis=1)
    model = StoredModel(CostModel().fit(x, feats.names, (varying - varying.min()) / np.ptp(varying),
                                        np.zeros(200, dtype=np.int64)), 42)
    assert model.model.trained  # else both sides are random search, and the test proves less
    measured = dict.fromkeys(indices[:50].tolist(), 1e-3)
    actors = [ray.remote(SearchActor).options(num_cpus=0).remote() for _ in range(2)]
    try:
        remote = RaySearches(actors, "xgb", task, 5, measured)
        local = LocalSearches("xgb", task, 5, 2, measured)
        for searches in (remote, local):
            searches.set_model(model)
        for step in range(3):
            if step == 2:  # another task's searches on the same actors, then back to this task's
                other = RaySearches(actors, "random", Task(make_workload("matmul", {"M": 32, "N": 32, "K": 32}),
                                                            parse_target("llvm")), 1, {})
                assert all(f.result() for f in other.propose([(0, 4), (1, 4)]))
                other.close()
            wanted = [(0, 6), (1, 6), (0, 3)]
            proposed = [f.result() for f in remote.propose(wanted)]  # (index, origin) pairs
            assert proposed == [f.result() for f in local.propose(wanted)]
            origins = [origin for batch in proposed for _, origin in batch]
            assert set(origins) <= {"explore", "plan", "baseline"} and origins.count("baseline") == (step == 0)
            assert not {i for batch in proposed for i, _ in batch} & set(measured)
            for shard, batch in ((0, proposed[0]), (1, proposed[1])):
                results = [MeasureResult(i, {}, Status.OK, latencies=[1e-3]) for i, _ in batch]
                remote.observe(shard, results)
                local.observe(shard, results)
        info = remote.info()
        assert [i["model_id"] for i in info] == [42, 42]
        assert os.getpid() not in {i["pid"] for i in info}
    finally:
        for a in actors:
            ray.kill(a)


def _running_until(scheduler: Scheduler, store: ResultStore, job_id: int,
                   trials: int) -> tuple[threading.Thread, list[str]]:
    """Run the claimed job on `scheduler` in a thread; return (thread, [its final status, once it
    ends]) as soon as the job has stored `trials` trials (or after 120 s)."""
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(scheduler.run_job(job_id)))
    runner.start()
    deadline = time.monotonic() + 120
    while len(store.trials(job_id=job_id)) < trials and time.monotonic() < deadline:
        time.sleep(0.2)
    return runner, outcome


def test_a_worker_actor_killed_mid_job_is_replaced_and_loses_nothing(pg_url: str, ray_local: None) -> None:
    """kill -9 of a worker actor's process mid-job: its candidates are measured again (on the
    other worker or its replacement), the job ends with exactly its budget of real
    measurements, and the replacement serves the scheduler's next job."""
    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build([("matmul", {"M": 64, "N": 64, "K": 64})], "llvm", 40, workers=2,
                                           batch_size=4, search="random"))
    with Scheduler(store) as scheduler:
        assert store.claim_job(scheduler.id, job_id=job_id) == job_id
        pool = scheduler.pool_for(store.job(job_id)["spec"])
        victim = pool.infos[0]["pid"]
        runner, outcome = _running_until(scheduler, store, job_id, 8)
        killed_at = len(store.trials(job_id=job_id))
        os.kill(victim, signal.SIGKILL)
        runner.join(300)
        assert killed_at < 40  # it died mid-job
        assert outcome == ["done"]
        trials = store.trials(job_id=job_id)
        assert len(trials) == 40 and trials["config_index"].is_unique  # the budget exactly, no duplicate
        assert not trials["error"].str.contains("Actor|worker failed").any()  # no machinery failure stored
        assert (trials["status"] == "ok").all()
        assert pool.infos[0]["pid"] != victim  # replaced, under the same name
        again = store.submit(JobRequest.build(SMALL, "llvm", 8, workers=2, batch_size=4, search="random"))
        assert scheduler.claim_and_run(again) == "done"
        assert (store.trials(job_id=again)["status"] == "ok").sum() == 8


def test_jobs_of_different_shapes_one_after_another_on_one_scheduler(pg_url: str, ray_local: None) -> None:
    """2 workers after 1 and 1 after 2 on a 2-GPU cluster: each job's
    pool replaces the idle one of the previous shape, which gives its GPUs back."""
    store = open_store(pg_url)
    with Scheduler(store) as scheduler:
        for workers in (1, 2, 1):
            job_id = store.submit(JobRequest.build(SMALL, "llvm", 4, workers=workers, batch_size=2, search="random"))
            started = time.monotonic()
            assert scheduler.claim_and_run(job_id) == "done"
            assert time.monotonic() - started < 120
            trials = store.trials(job_id=job_id)
            assert len(trials) == 4 and trials["worker"].nunique() == workers
            assert len(scheduler.pools()) == 1  # only the pool of the job that ran last is kept
        # the same shape again reuses the kept pool: its actors stay the same processes
        (pool,) = scheduler.pools()
        pids = [info["pid"] for info in pool.infos]
        again = store.submit(JobRequest.build(SMALL, "llvm", 4, workers=1, batch_size=2, search="random"))
        assert scheduler.claim_and_run(again) == "done"
        assert [info["pid"] for info in scheduler.pool_for(store.job(again)["spec"]).infos] == pids


def test_jobs_at_once_share_the_cluster_and_a_larger_one_waits_for_devices(pg_url: str, ray_local: None) -> None:
    """The service runs two 1-worker jobs at once on a 2-GPU cluster; a 2-worker job queued behind
    them waits until both end (their idle pools then give the GPUs back); every budget is exact,
    and idle pools are closed once `keep_warm_seconds` pass."""
    store = open_store(pg_url)
    ids = [store.submit(JobRequest.build(SMALL, "llvm", 12, workers=w, batch_size=2, search="random"))
           for w in (1, 1, 2)]
    with Scheduler(store, keep_warm_seconds=3.0) as scheduler:
        service = threading.Thread(target=scheduler.serve, kwargs={"poll_seconds": 0.2}, daemon=True)
        service.start()
        deadline = time.monotonic() + 300
        while any(store.job_status(i) != "done" for i in ids) and time.monotonic() < deadline:
            assert all(store.job_status(i) in ("queued", "running", "done") for i in ids)
            time.sleep(0.5)
        ended = time.monotonic()
        while scheduler.pools() and time.monotonic() - ended < 30:
            time.sleep(0.5)
        assert scheduler.pools() == []  # idle past keep_warm_seconds: closed
        scheduler.stop()
        service.join(60)
    spans = []
    for i, workers in zip(ids, (1, 1, 2), strict=True):
        trials = store.trials(job_id=i)
        assert len(trials) == 12 and trials["config_index"].is_unique and (trials["status"] == "ok").all()
        assert trials["worker"].nunique() == workers
        spans.append((trials["created_at"].min(), trials["created_at"].max()))
    (a0, a1), (b0, b1), (c0, _) = spans
    assert a0 < b1 and b0 < a1  # the two 1-worker jobs ran at once
    assert c0 > max(a1, b1)  # the 2-worker job ran once both had ended


def test_an_embedded_client_runs_jobs_of_different_shapes_at_once(pg_url: str, ray_local: None) -> None:
    with Client(pg_url, in_process=True) as client:
        jobs = [client.submit(SMALL, "llvm", 8, workers=w, batch_size=2, search="random") for w in (2, 1, 1)]
        assert [job.wait(progress=False, timeout=300) for job in jobs] == ["done"] * 3
        for job, workers in zip(jobs, (2, 1, 1), strict=True):
            trials = job.trials()
            assert len(trials) == 8 and trials["config_index"].is_unique and (trials["status"] == "ok").all()
            assert trials["worker"].nunique() == workers


def test_a_job_submitted_while_its_prepared_pool_starts_waits_for_that_pool(pg_url: str, ray_local: None) -> None:
    """`farm tune` prepares the job's workers and submits the job at once: on a cluster with
    devices to spare (two logical GPUs here) the job still takes the pool starting for it, not a
    second one started beside it (which on a CPU host halved the cores of both start-ups)."""
    with Client(pg_url, in_process=True) as client:
        client.prepare("llvm", 1)
        job = client.submit(SMALL, "llvm", 4, workers=1, batch_size=2, search="random")
        assert job.wait(progress=False, timeout=300) == "done"
        assert set(job.trials()["worker"]) == {"llvm-worker-0"}
        assert len(client._scheduler_here().pools()) == 1


def test_tasks_of_one_job_with_the_same_configs_each_run_their_own_kernel(pg_url: str, ray_local: None) -> None:
    """Max and average pooling of one shape have the same space, and random search with one seed
    proposes the same config indices for both: each candidate must still run its own task's
    kernel (libraries were once named by config index alone, and the RPC server, loading a name
    it still had loaded, ran the other task's kernel: wrong results and crashes)."""
    pools = [("pool2d", dict(N=1, C=8, H=12, W=12, KH=3, KW=3, stride=1, pad=1, kind=kind)) for kind in ("max", "avg")]
    with Client(pg_url, in_process=True) as client:
        job = client.submit(pools, "llvm", 16, workers=1, batch_size=4, search="random")
        assert job.wait(progress=False, timeout=300) == "done"
        trials = job.trials()
    assert len(trials) == 16 and (trials["status"] == "ok").all(), trials[["status", "error"]]
    per_task = [set(group["config_index"]) for _, group in trials.groupby("task_id")]
    assert len(per_task) == 2 and per_task[0] & per_task[1]  # the case in question: shared indices


def test_a_scheduler_whose_job_was_taken_over_stops_it(pg_url: str, ray_local: None) -> None:
    """A scheduler whose heartbeats did not arrive (cut off from the database), whose job was
    requeued and claimed by another meanwhile, is told so by its next heartbeat: it stops the job
    within seconds and records nothing over the other scheduler's claim, so the job does not run twice."""
    from sqlalchemy import create_engine, text

    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build(SMALL, "llvm", 400, batch_size=2, search="random"))
    with Scheduler(store, heartbeat_seconds=0.5) as scheduler:
        assert store.claim_job(scheduler.id, job_id=job_id) == job_id
        runner, _ = _running_until(scheduler, store, job_id, 4)
        engine = create_engine(pg_url)
        with engine.begin() as connection:  # what requeue_stale and another scheduler's claim_job do
            connection.execute(text("UPDATE jobs SET claimed_by = 'scheduler@elsewhere' WHERE id = :id"),
                               {"id": job_id})
        engine.dispose()
        taken = time.monotonic()
        runner.join(60)
        assert not runner.is_alive() and time.monotonic() - taken < 20
    job = store.job(job_id)
    assert job["status"] == "running" and job["claimed_by"] == "scheduler@elsewhere"  # the other's, untouched
    assert len(store.trials(job_id=job_id)) < 400


def test_a_job_cancelled_before_it_runs_measures_nothing(pg_url: str, ray_local: None) -> None:
    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build(SMALL, "llvm", 12, workers=1, batch_size=4))
    with Scheduler(store) as scheduler:
        store.claim_job(scheduler.id, job_id=job_id)
        store.cancel_job(job_id)  # cancelled before it ran: nothing is measured
        assert scheduler.run_job(job_id) == "cancelled"
    assert len(store.trials(job_id=job_id)) == 0


def _scheduler_process(url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "farm", "scheduler", "--db", url, "--poll", "0.3", *extra],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def test_two_schedulers_never_run_the_same_job(pg_url: str, tmp_path: Path) -> None:
    store = open_store(pg_url)
    jobs = [store.submit(JobRequest.build([("matmul", {"M": 16 + 8 * i, "N": 32, "K": 32})], "llvm", 6, batch_size=3))
            for i in range(4)]
    procs = [_scheduler_process(pg_url, tmp_path / f"s{i}.log", "--once") for i in range(2)]
    try:
        for proc in procs:
            proc.wait(600)
    finally:
        for proc in procs:
            stop(proc)
    for proc, i in zip(procs, range(2), strict=True):
        assert proc.returncode == 0, (tmp_path / f"s{i}.log").read_text()[-3000:]
    claimed = {}
    for job_id in jobs:
        job = store.job(job_id)
        assert job is not None and job["status"] == "done", job
        assert job["trials"] == 6  # ran once: a second run would find nothing left to measure
        claimed[job_id] = job["claimed_by"]
    trials = store.trials()
    assert not trials.duplicated(["task_id", "config_index"]).any()
    assert len(set(claimed.values())) >= 1


def test_client_against_a_scheduler_process(pg_url: str, tmp_path: Path) -> None:
    proc = _scheduler_process(pg_url, tmp_path / "scheduler.log")
    try:
        with Client(pg_url) as client:
            job = client.submit(SMALL, target="llvm", trials=10, batch_size=5)
            assert job.wait(progress=False, timeout=300) == "done", (tmp_path / "scheduler.log").read_text()[-3000:]
            best = job.best()
            assert len(best) == 1 and best[0]["latency_us"] > 0
            frame = job.trials()
            assert len(frame) == 10 and set(frame["status"]) <= {"ok", "build_error", "wrong_result", "timeout"}
            out = job.export(tmp_path / "best.json")
            assert out.exists()
            # A big job, cancelled while it runs: it stops early and keeps what it measured.
            big = client.submit([("matmul", {"M": 64, "N": 64, "K": 64})], target="llvm", trials=400, batch_size=4)
            deadline = time.monotonic() + 300
            while big.status()["trials"] < 4 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert big.cancel()
            assert big.wait(progress=False, timeout=300) == "cancelled"
            assert 4 <= big.status()["trials"] < 400
            assert client.job(big.id).status()["status"] == "cancelled"
    finally:
        stop(proc)


def test_a_lab_device_with_only_a_stock_rpc_server_is_used_by_its_key(pg_url: str, ray_local: None,
                                                                        tmp_path: Path) -> None:
    """A board that runs TVM's own RPC server (no Ray, no farm code) measures a job that names its key."""
    from farm.core.host import free_port
    from workers.processes import spawn_module
    from workers.rpc_processes import LocalTracker, wait_for_keys

    store = open_store(pg_url)
    with LocalTracker(log=tmp_path / "tracker.log") as tracker:
        port = free_port()
        board = spawn_module(["tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tracker.port}", "--key", "lab-board",
                              "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 50)],
                             tmp_path / "board.log")
        try:
            wait_for_keys(tracker.address, ["lab-board"], 60, [board])
            job_id = store.submit(JobRequest.build(SMALL, "llvm", 8, batch_size=4, rpc_keys=["lab-board"]))
            with Scheduler(store, tracker=tracker.address) as scheduler:
                store.claim_job(scheduler.id, job_id=job_id)
                assert scheduler.run_job(job_id) == "done"
        finally:
            os.killpg(board.pid, signal.SIGKILL)
            board.wait()
    trials = store.trials(job_id=job_id)
    assert len(trials) == 8 and (trials["status"] == "ok").all(), trials["error"].tolist()
    assert all("lab-board" in d for d in trials["device"])  # measured on the board, named by its key


def test_embedded_client_runs_its_jobs_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  ray_local: None) -> None:
    """`Client()` with no URL: $FARM_DB (else sqlite:///farm.db), jobs run by this process."""
    monkeypatch.setenv("FARM_DB", f"sqlite:///{tmp_path}/embedded.db")
    with Client() as client:
        assert client.in_process and client.url.endswith("embedded.db")
        job = client.submit(SMALL, target="llvm", trials=6, batch_size=3)
        assert job.wait(progress=True, timeout=300) == "done"
        assert len(job.trials()) == 6 and job.best()
        with pytest.raises(FarmError, match="unknown workload"):
            client.submit(["conv3d"], trials=4)
    assert len(open_store(f"sqlite:///{tmp_path}/embedded.db").jobs()) == 1  # the bad job wrote nothing


def test_in_process_pool_runs_the_real_loop_without_ray(pg_url: str) -> None:
    """The in-process WorkerPool (scheduler.local_pool): two devices of this machine, each its own
    RPC server, the job's exact budget shared between them through the same lifecycle and loop."""
    from scheduler.local_pool import LocalWorkerPool

    with Client(pg_url, in_process=True, pool_factory=LocalWorkerPool.on_this_machine) as client:
        job = client.submit(SMALL, target="llvm", trials=12, workers=2, batch_size=3)
        assert job.wait(progress=False, timeout=300) == "done"
        trials = job.trials()
    assert len(trials) == 12 and trials["config_index"].is_unique
    assert set(trials["worker"]) == {"local-0", "local-1"}



def test_a_worker_that_joins_mid_task_gets_work_and_the_budget_stays_exact(pg_url: str) -> None:
    """The loop asks its pool to grow once a second (WorkerPool.grow: a GPU node joined the
    cluster): a device added mid-task measures part of it, searching worker 0's shard, and the
    job still measures its budget exactly, no config twice."""
    from scheduler.local_pool import LocalWorkerPool
    from workers.device import LocalDevice

    class JoinedMidTask(LocalWorkerPool):
        """One device, and a second one the first time the loop asks after 4 results are stored."""

        def grow(self) -> int:
            if len(self.workers) > 1 or store.trial_count(task_id) < 4:
                return 0
            self.workers.append(LocalDevice("llvm", "local-joined", self.tracker.address).start())  # type: ignore[union-attr]
            return 1

    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build(SMALL, "llvm", 40, workers=1, batch_size=4, search="xgb"))
    (task_id,) = [t["id"] for t in store.tasks(job_id)]
    with Scheduler(store, pool_factory=lambda kind, count, keys: JoinedMidTask.on_this_machine(kind, count)) as sched:
        assert sched.claim_and_run(job_id) == "done"
    trials = store.trials(job_id=job_id)
    assert len(trials) == 40 and trials["config_index"].is_unique
    assert (trials["status"] == "ok").all()
    assert set(trials["worker"]) == {"local-0", "local-joined"}


class _Wrapped:
    """A LocalWorkerPool's worker around `worker`, whose calls a subclass watches or holds
    (build_and_measure); the rest is the worker's."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.name = worker, worker.name

    def device_name(self) -> str:
        return self.worker.device_name()

    def cancel(self) -> None:
        self.worker.cancel()

    def close(self) -> None:
        self.worker.close()


def _run_with_worker_0(store: ResultStore, job_id: int, wrap: Callable[[Any], _Wrapped],
                       before_close: Callable[[], None] = lambda: None) -> tuple[str, Any, Any]:
    """Run job `job_id` on local workers whose worker 0 is `wrap(worker 0)`, calling `before_close` once
    the job has ended (the pool's close waits for its calls): (status, the job's trials, worker 0)."""
    from scheduler.local_pool import LocalWorkerPool

    wrapped: list[_Wrapped] = []

    def factory(kind: str, count: int, keys: Sequence[str]) -> LocalWorkerPool:
        pool = LocalWorkerPool.on_this_machine(kind, count, keys)
        wrapped.append(wrap(pool.workers[0]))
        pool.workers[0] = wrapped[0]
        return pool

    with Scheduler(store, pool_factory=factory) as scheduler:
        try:
            status = scheduler.claim_and_run(job_id)
            trials = store.trials(job_id=job_id)
        finally:
            before_close()
    return status, trials, wrapped[0]


class _Delayed(_Wrapped):
    """A worker whose calls first ask `gate(self, indices)`, which may hold them and says whether it
    did (their configs are then in `delayed`)."""

    def __init__(self, worker: Any, gate: Callable[[_Delayed, list[int]], bool]) -> None:
        super().__init__(worker)
        self.gate = gate
        self.delayed: list[int] = []
        self.returned = 0  # calls that came back

    def build_and_measure(self, task: Any, indices: list[int], shard: int = 0, round_: int = 0) -> list[Any]:
        if self.gate(self, indices):
            self.delayed.extend(indices)
        results = self.worker.build_and_measure(task, indices, shard, round_)
        self.returned += 1
        return results


def _run_with_delayed_worker(pg_url: str, budget: int,
                             gate_of: Callable[[ResultStore, int], Callable[[_Delayed, list[int]], bool]],
                             before_close: Callable[[], None], workers: int = 2) -> tuple[str, Any, _Delayed]:
    """Run a llvm job of `budget` trials on `workers` workers whose worker 0 is `_Delayed` by
    `gate_of(store, task_id)` (_run_with_worker_0)."""
    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build(SMALL, "llvm", budget, workers=workers, batch_size=4, search="random"))
    (task_id,) = [t["id"] for t in store.tasks(job_id)]
    return _run_with_worker_0(store, job_id, lambda worker: _Delayed(worker, gate_of(store, task_id)), before_close)


def test_a_task_ends_with_its_budget_without_waiting_for_a_held_worker(pg_url: str) -> None:
    """The end game (scheduler.tuner): once the budget is handed out, a worker idle for
    END_GAME_GRACE seconds measures new configs in place of another worker's last ones, and the
    task ends with its budget exactly while those are still out. Here worker 0, once it has
    returned results and 4 trials are stored, has its calls held (as if each waited for a build
    that does not end); worker 1 measures the rest of the budget and then stands in. Nothing of
    the held calls is recorded, and the task does not wait for them (without the end game it
    waited until they were released, after 60 s, and recorded them)."""
    release = threading.Event()
    released_before_the_end: list[bool] = []

    def gate_of(store: ResultStore, task_id: int) -> Callable[[_Delayed, list[int]], bool]:
        def gate(worker: _Delayed, indices: list[int]) -> bool:
            if worker.returned and store.trial_count(task_id) >= 4:
                release.wait(60)
                return True
            return False
        return gate

    def before_close() -> None:
        released_before_the_end.append(release.is_set())
        release.set()

    status, trials, worker = _run_with_delayed_worker(pg_url, 40, gate_of, before_close)
    assert status == "done"
    assert worker.delayed and released_before_the_end == [False]  # it ended while worker 0's calls were held
    assert len(trials) == 40 and trials["config_index"].is_unique and (trials["status"] == "ok").all()
    assert not set(worker.delayed) & set(trials["config_index"])  # the held calls' configs never became trials
    assert (trials["worker"] == "local-1").sum() > 20  # worker 1 measured in worker 0's place


def test_a_lone_worker_stands_in_for_its_own_slow_builds(pg_url: str) -> None:
    """The end game on one worker (a model job's slice on one GPU): its last call is held (as if its
    builds never ended), its device idle. After END_GAME_GRACE with no result it measures new
    configs itself, in its free build slots, and the task ends with its budget while the held
    call is still out; nothing of the held call is recorded."""
    release = threading.Event()
    released_before_the_end: list[bool] = []

    def gate_of(store: ResultStore, task_id: int) -> Callable[[_Delayed, list[int]], bool]:
        def gate(worker: _Delayed, indices: list[int]) -> bool:
            if not worker.delayed and worker.returned:  # its first call after one has returned results
                worker.delayed.extend(indices)  # this call alone: the stand-ins after it go through
                release.wait(60)
            return False
        return gate

    def before_close() -> None:
        released_before_the_end.append(release.is_set())
        release.set()

    status, trials, worker = _run_with_delayed_worker(pg_url, 16, gate_of, before_close, workers=1)
    assert status == "done" and released_before_the_end == [False]
    assert len(trials) == 16 and trials["config_index"].is_unique and (trials["status"] == "ok").all()
    assert worker.delayed and not set(worker.delayed) & set(trials["config_index"])


def test_the_end_game_waits_for_a_worker_that_has_not_returned_results(pg_url: str) -> None:
    """A worker slow to return its first results (still compiling its first candidates, still
    opening its first session) is waited for, not stood in for: here every call of worker 0 waits
    until all the other configs are stored and END_GAME_GRACE + 4 s more have passed. Its first
    results are then trials (had worker 1 stood in for it, worker 1 would have completed the
    budget during those seconds, and worker 0 would have none). Once it has returned results,
    its calls still queued may be stood in for, as any worker's."""
    from scheduler.tuner import END_GAME_GRACE

    opened = threading.Event()
    waiting: list[int] = []  # the configs of worker 0's calls waiting at the gate

    def gate_of(store: ResultStore, task_id: int) -> Callable[[_Delayed, list[int]], bool]:
        def gate(worker: _Delayed, indices: list[int]) -> bool:
            if opened.is_set():
                return False
            waiting.extend(indices)
            while store.trial_count(task_id) + len(waiting) < 16 and not opened.is_set():
                time.sleep(0.05)  # until the budget is all handed out and the rest measured
            opened.wait(END_GAME_GRACE + 4)  # then worker 1 idles past its grace
            opened.set()
            return True
        return gate

    status, trials, worker = _run_with_delayed_worker(pg_url, 16, gate_of, opened.set)
    assert status == "done" and len(trials) == 16 and trials["config_index"].is_unique
    assert worker.delayed and set(trials["config_index"][trials["worker"] == "local-0"]) <= set(worker.delayed)
    assert (trials["worker"] == "local-0").sum() >= 1


class _Counting(_Wrapped):
    """A worker that records, at every call, the candidates it was handed and has not returned yet:
    `calls`, one (task key, candidates in the call, results returned before it, candidates of each task
    out before it) per call."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.lock = threading.Lock()
        self.returned = 0
        self.out: dict[str, int] = {}
        self.calls: list[tuple[str, int, int, dict[str, int]]] = []

    def build_and_measure(self, task: Any, indices: list[int], shard: int = 0, round_: int = 0) -> list[Any]:
        key = task.workload.key
        with self.lock:
            self.calls.append((key, len(indices), self.returned, dict(self.out)))
            self.out[key] = self.out.get(key, 0) + len(indices)
        try:
            return self.worker.build_and_measure(task, indices, shard, round_)
        finally:
            with self.lock:
                self.out[key] -= len(indices)
                self.returned += len(indices)

    @property
    def in_flight(self) -> list[tuple[int, int]]:
        """At every call: (results returned before it, candidates out with it)."""
        return [(returned, sum(out.values()) + n) for _, n, returned, out in self.calls]

    @property
    def at_first(self) -> list[int]:
        """At the first call of each task, in the order the tasks came: the other tasks' candidates out."""
        firsts: dict[str, int] = {}
        for key, _, _, out in self.calls:
            firsts.setdefault(key, sum(out.values()))
        return list(firsts.values())


def test_a_worker_gets_what_its_builds_need_in_flight_not_two_batches(pg_url: str) -> None:
    """scheduler.pool.Lead in a real job: this machine's CPU measures a matmul 128³ candidate in
    about 0.06 s and builds one in about 0.4 s (7 compiling at once would keep it busy), so once its
    results are back a worker of batch 16 keeps about 7 + 2 chunks in flight, not two batches (32):
    what the loop hands out beyond that would wait and be proposed by an older model. Until its
    first results, it gets the two batches."""
    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build([("matmul", {"M": 128, "N": 128, "K": 128})], "llvm", 80, workers=1,
                                           batch_size=16, search="random"))
    status, trials, counting = _run_with_worker_0(store, job_id, _Counting)
    assert status == "done"
    assert len(trials) == 80 and trials["config_index"].is_unique
    assert max(out for _, out in counting.in_flight) > 24  # the start: two batches, nothing known yet
    later = [out for returned, out in counting.in_flight if returned >= 32]
    assert later and max(later) <= 24, counting.in_flight


class _RecordedSearches:
    """A task's searches (scheduler.local_searches.LocalSearches) that record, in order, each proposal's size
    ("propose", n), each batch of results ("observe", n) and each model handed to them ("model", whether
    it is trained)."""

    def __init__(self, searches: Any) -> None:
        self.searches, self.events = searches, []

    @property
    def count(self) -> int:
        return self.searches.count

    def propose(self, requests: Sequence[tuple[int, int]]) -> list[Any]:
        self.events += [("propose", n) for _, n in requests]
        return self.searches.propose(requests)

    def observe(self, shard: int, results: list[Any]) -> None:
        self.events.append(("observe", len(results)))
        self.searches.observe(shard, results)

    def set_model(self, model: Any) -> None:
        self.events.append(("model", model is not None and model.model.trained))
        self.searches.set_model(model)

    def close(self) -> None:
        self.searches.close()


@pytest.mark.parametrize("search", ["xgb", "random"])
def test_a_model_guided_search_waits_for_its_first_model(pg_url: str, search: str) -> None:
    """The first model's wait (scheduler.tuner): an xgb job of a family with no model hands out a
    round of unguided configs (one worker, batch 9: the task's baseline, which trains nothing, and 8
    configs, as many as a model needs, farm.core.costmodel) and waits for that round's retraining to
    reach the searches, handing out no more than the bridge meanwhile (a chunk of 4), where the
    worker's lead allows two batches (18) in flight. A random search needs no model and keeps its
    worker's queue full: by the time the first model arrives, the round's 9 results and at least
    two chunks in flight were proposed."""
    from scheduler.local_pool import LocalWorkerPool

    recorded: list[_RecordedSearches] = []

    class Recording(LocalWorkerPool):
        def searches(self, search: str, task: Any, seed: int, measured: Any) -> Any:
            recorded.append(_RecordedSearches(super().searches(search, task, seed, measured)))
            return recorded[-1]

    store = open_store(pg_url)
    job_id = store.submit(JobRequest.build(SMALL, "llvm", 32, workers=1, batch_size=9, search=search))
    with Scheduler(store, pool_factory=lambda kind, count, keys: Recording.on_this_machine(kind, count, keys)) as sched:
        assert sched.claim_and_run(job_id) == "done"
    trials = store.trials(job_id=job_id)
    assert len(trials) == 32 and trials["config_index"].is_unique and (trials["status"] == "ok").all()
    events = recorded[0].events
    first_model = events.index(("model", True))
    before = sum(n for kind, n in events[:first_model] if kind == "propose")
    if search == "xgb":
        assert 9 <= before <= 9 + BRIDGE_CHUNKS * 4, events
    else:
        assert before >= 18 > 9 + BRIDGE_CHUNKS * 4, events


def test_a_job_naming_an_rpc_key_no_device_has_fails_with_a_clear_error(pg_url: str) -> None:
    """No server under the job's key: its candidates compile, and after the register timeout the
    job fails saying which key and what to do; the scheduler is free for the next job."""
    from scheduler.local_pool import LocalWorkerPool

    def factory(kind: str, count: int, rpc_keys: Sequence[str]) -> LocalWorkerPool:
        # A short wait only for servers someone else should run: the next job's own server needs
        # its usual start-up (TVM's import) on a loaded 2-core machine.
        return LocalWorkerPool.on_this_machine(kind, count, rpc_keys, register_timeout=3.0 if rpc_keys else 90.0)

    with Client(pg_url, in_process=True, pool_factory=factory) as client:
        started = time.monotonic()
        job = client.submit(SMALL, target="llvm", trials=8, batch_size=4, rpc_keys=["no-such-device"])
        with pytest.raises(FarmError, match="no free RPC server registered under no-such-device"):
            job.wait(progress=False, timeout=120)
        assert time.monotonic() - started < 60
        assert job.status()["status"] == "failed" and len(job.trials()) == 0  # no machinery failure stored
        after = client.submit(SMALL, target="llvm", trials=4, batch_size=4)
        assert after.wait(progress=False, timeout=300) == "done"


def test_the_next_slice_starts_once_the_unguided_round_is_out(pg_url: str) -> None:
    """A model job's first slice of a task is a round of unguided configs, then a wait for its first
    model in which it hands out only its bridge, once most of the round is measured. The next slice
    starts when the round is out, not when the bridge is: the worker then still holds most of the
    round to measure while the next task's first candidates build. (Started after the bridge, it found
    at most the bridge's candidates left, and the device idled through its first builds: about 1 s a
    task on an H200, docs/benchmarks/models-2026-11-29c.md.)"""
    from farm.core.model import load_model, model_job
    from farm.core.targets import parse_target
    from tests.prom import real_model

    store = open_store(pg_url)
    net = load_model(real_model())
    kernels = len(net.tasks(parse_target("llvm")))
    # First slices of 20 trials each (WARMUP_SHARE of 40 per kernel): a round of 16, then a bridge of
    # 4, the whole first slice (once handed out, the slice lets the next start in any case).
    job_id = store.submit(model_job(net, "llvm", 40 * kernels, workers=1, batch_size=16))
    status, trials, worker = _run_with_worker_0(store, job_id, _Counting)
    assert status == "done" and len(trials) == 40 * kernels
    assert len(worker.at_first) == kernels and worker.at_first[0] == 0
    assert max(worker.at_first[1:]) > BRIDGE_CHUNKS * CHUNK, worker.at_first


class _HoldsOnePerTask(_Wrapped):
    """A worker that holds one call of each task, the first made after one of the task's calls has
    returned (as if its builds never ended), until `release` (or for 60 s: `outlasted` counts the holds
    that ended so, the job having waited for them); `held`: task -> configs."""

    def __init__(self, worker: Any, release: threading.Event) -> None:
        super().__init__(worker)
        self.release = release
        self.lock = threading.Lock()
        self.returned: set[str] = set()
        self.held: dict[str, list[int]] = {}
        self.outlasted = 0

    def build_and_measure(self, task: Any, indices: list[int], shard: int = 0, round_: int = 0) -> list[Any]:
        key = task.workload.key
        with self.lock:
            hold = key in self.returned and key not in self.held
            if hold:
                self.held[key] = list(indices)
        if hold and not self.release.wait(60):
            self.outlasted += 1
        results = self.worker.build_and_measure(task, indices, shard, round_)
        with self.lock:
            self.returned.add(key)
        return results


def test_open_slices_that_each_wait_on_a_held_call_stand_in(pg_url: str) -> None:
    """A model job's two slices open at once on one worker (scheduler.tuner._allocate), each with its
    last call held (as if its builds never ended), so the device idles: after END_GAME_GRACE each
    stands in for its own held call, and the job ends with its budget while both are still out.
    (A slice that counted the other slice's candidates on the worker as work for its device waited
    for the other's held call, each for the other's, until they were released.)"""
    from farm.core.model import load_model, model_job
    from tests.prom import real_model

    store = open_store(pg_url)
    # Two kernels, first slices of 8 (WARMUP_SHARE of 16 each): more than the worker's lead of 4, so
    # that each slice makes calls after its first ones returned, one of which is held.
    job_id = store.submit(model_job(load_model(real_model()), "llvm", 32, workers=1, batch_size=2,
                                    search="random"))
    release = threading.Event()
    released_before_the_end: list[bool] = []

    def before_close() -> None:
        released_before_the_end.append(release.is_set())
        release.set()

    status, trials, worker = _run_with_worker_0(store, job_id, lambda w: _HoldsOnePerTask(w, release), before_close)
    assert status == "done" and released_before_the_end == [False]
    assert len(trials) == 32 and (trials["status"] == "ok").all()
    assert len(worker.held) == 2 and worker.outlasted == 0  # both held, neither waited for
    for task_id, key in {t["id"]: t["workload_key"] for t in store.tasks(job_id)}.items():
        configs = trials["config_index"][trials["task_id"] == task_id]
        assert configs.is_unique and not set(worker.held[key]) & set(configs)
