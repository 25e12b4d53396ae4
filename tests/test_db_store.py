"""Conformance tests of the ResultStore contract, run against SQLite and Postgres alike."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd
import pytest
from sqlalchemy import event, insert, update
from sqlalchemy.exc import IntegrityError

from db.base import TRIAL_COLUMNS, ResultStore
from db.engine import session_factory
from db.models import JobRecord, TrialRecord, WorkerRecord, utcnow
from db.sql_store import SQLResultStore
from db.store import open_store
from db.writer import NOTIFY_CHANNEL, trial_row
from farm.core.errors import FarmError
from farm.core.measure import MeasureResult, Status

FAMILY = "cuda_tiled|cuda|conv2d_nchw"


def task_dict(n: int = 0, family: str = FAMILY, budget: int = 64) -> dict[str, Any]:
    params = {"N": 1, "CI": 64 + n, "H": 7, "W": 7, "CO": 64, "KH": 3, "KW": 3}
    return {
        "workload": {"name": "conv2d_nchw", "params": params},
        "workload_key": f'{{"name": "conv2d_nchw", "CI": {64 + n}}}',
        "target": {"kind": "cuda", "arch": "sm_90"},
        "target_kind": "cuda",
        "template": "cuda_tiled",
        "template_version": "1",
        "space_size": 18_000_000_000,  # beyond 32 bits
        "budget": budget,
        "family_key": family,
    }


def make_job(store: ResultStore, n_tasks: int = 1, name: str = "job", family: str = FAMILY) -> int:
    spec = {"workloads": ["resnet-last-conv"], "target": {"kind": "cuda"}, "trials": 64, "seed": 0}
    tasks = [task_dict(n, family) for n in range(n_tasks)]
    return store.create_job(name, spec, trials_budget=64, search="xgb", tasks=tasks)


def ok(index: int, *latencies: float, round: int = 0) -> MeasureResult:
    return MeasureResult(
        index,
        {"tile_x": [1, 2, index], "unroll": index % 2},
        Status.OK,
        latencies=list(latencies),
        build_seconds=0.5,
        run_seconds=0.1,
        device="H100",
        worker="w0",
        shard=index % 3,
        round=round,
        origin="plan",
    )


def failed(index: int, status: Status = Status.BUILD_ERROR) -> MeasureResult:
    return MeasureResult(index, {"tile_x": [index]}, status, error=f"config {index} failed")


def store_at(store: ResultStore, task_id: int, result: MeasureResult, when: datetime) -> None:
    """Store one trial as stored at `when` (the writer stamps rows with the time it is handed them)."""
    with store.engine.begin() as connection:  # type: ignore[attr-defined]
        connection.execute(insert(TrialRecord.__table__), [trial_row(task_id, result, when)])


def _claim_in_child(store: ResultStore, scheduler_id: str, start: Any, results: Any) -> None:
    """Runs in a spawned process: the store arrives pickled, as it does in a Ray actor."""
    start.wait()
    claimed = []
    with store.writer(flush_seconds=None) as writer:
        while (job_id := store.claim_job(scheduler_id)) is not None:
            claimed.append(job_id)
            writer.record(store.tasks(job_id)[0]["id"], ok(job_id, 1e-3))
    results.put(claimed)


class TestResultStore:
    """One contract, every backend (Optuna's storage tests do the same)."""

    # Jobs -------------------------------------------------------------------------------

    def test_create_job_stores_job_and_tasks(self, store: ResultStore) -> None:
        job_id = make_job(store, n_tasks=2)
        job = store.job(job_id)
        assert job is not None
        assert job["status"] == "queued" and job["name"] == "job" and job["search"] == "xgb"
        assert job["spec"]["workloads"] == ["resnet-last-conv"] and job["trials_budget"] == 64
        assert job["created_at"].tzinfo is not None and job["started_at"] is None
        assert [t["workload"]["params"]["CI"] for t in job["tasks"]] == [64, 65]
        assert job["tasks"] == [{**t, "counts": {}, "trials": 0, "best_latency": None, "reused": False}
                                for t in store.tasks(job_id)]
        assert [t["weight"] for t in job["tasks"]] == [1, 1]  # a kernel tuned on its own: called once
        task = store.tasks(job_id)[0]
        assert {key: task[key] for key in task_dict()} == task_dict()
        assert task["space_size"] == 18_000_000_000
        assert store.job(job_id + 100) is None

    def test_create_job_is_one_transaction(self, store: ResultStore) -> None:
        bad = {**task_dict(1), "budget": None}  # NOT NULL: fails after the job row is inserted
        with pytest.raises(IntegrityError):
            store.create_job("half", {}, 10, "random", [task_dict(0), bad])
        assert store.jobs() == []
        with pytest.raises(ValueError, match="missing keys"):
            store.create_job("x", {}, 10, "random", [{"workload": {}}])
        with pytest.raises(ValueError, match="at least one task"):
            store.create_job("x", {}, 10, "random", [])

    def test_claim_takes_oldest_queued_job(self, store: ResultStore) -> None:
        first, second = make_job(store, name="a"), make_job(store, name="b")
        assert store.claim_job("sched-1") == first
        job = store.job(first)
        assert job is not None and job["status"] == "running" and job["claimed_by"] == "sched-1"
        assert job["started_at"] is not None and job["heartbeat_at"] is not None
        assert store.claim_job("sched-2") == second
        assert store.claim_job("sched-1") is None

    def test_claim_a_given_job(self, store: ResultStore) -> None:
        first, second = make_job(store), make_job(store)
        assert store.claim_job("tune", job_id=second) == second
        assert store.claim_job("other", job_id=second) is None  # taken already
        assert store.claim_job("other", job_id=second + 1) is None  # no such job
        assert store.claim_job("other") == first

    def test_concurrent_claimers_never_share_a_job(self, store: ResultStore) -> None:
        job_ids = [make_job(store, name=f"j{i}") for i in range(40)]
        claims: dict[str, list[int]] = {}
        barrier = threading.Barrier(4)

        def claimer(scheduler_id: str, own: ResultStore) -> None:
            barrier.wait()
            mine = claims.setdefault(scheduler_id, [])
            while (job_id := own.claim_job(scheduler_id)) is not None:
                mine.append(job_id)

        # Each thread its own store (a pickled copy), as each scheduler process has.
        copies = [pickle.loads(pickle.dumps(store)) for _ in range(4)]
        threads = [threading.Thread(target=claimer, args=(f"s{i}", copies[i])) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        claimed = [job_id for mine in claims.values() for job_id in mine]
        assert sorted(claimed) == job_ids  # every job once, none twice
        for scheduler_id, mine in claims.items():
            assert all(store.job(job_id)["claimed_by"] == scheduler_id for job_id in mine)  # type: ignore[index]
        for copy in copies:
            copy.close()

    def test_two_processes_claim_distinct_jobs(self, store: ResultStore) -> None:
        job_ids = [make_job(store, name=f"j{i}") for i in range(20)]
        context = multiprocessing.get_context("spawn")
        start, results = context.Barrier(2), context.Queue()
        children = [context.Process(target=_claim_in_child, args=(store, name, start, results)) for name in ("a", "b")]
        for child in children:
            child.start()
        claimed = [results.get(timeout=60), results.get(timeout=60)]
        for child in children:
            child.join()
            assert child.exitcode == 0
        assert sorted(claimed[0] + claimed[1]) == job_ids
        assert len(store.trials()) == 20  # each child wrote through its own writer

    def test_heartbeat_finish_and_cancel(self, store: ResultStore) -> None:
        running, queued = make_job(store), make_job(store)
        assert store.claim_job("sched") == running
        assert store.heartbeat(running, "sched") is True
        assert store.heartbeat(running, "intruder") is False
        assert store.heartbeat(queued, "sched") is False

        assert store.cancel_job(queued) is True
        assert store.job_status(queued) == "cancelled"
        assert store.cancel_job(queued) is False
        assert store.claim_job("sched") is None  # a cancelled job is never claimed

        assert store.cancel_job(running) is True
        assert store.heartbeat(running, "sched") is False  # how the scheduler learns of it
        assert store.finish_job(running, "done") is False  # cancelled stays cancelled
        job = store.job(running)
        assert job is not None and job["status"] == "cancelled" and job["finished_at"] is not None

        failing = make_job(store)
        store.claim_job("sched")
        assert store.finish_job(failing, "failed", error="worker lost") is True
        job = store.job(failing)
        assert job is not None and job["status"] == "failed" and job["error"] == "worker lost"
        with pytest.raises(ValueError, match="status must be one of"):
            store.finish_job(failing, "running")

    def test_a_scheduler_finishes_only_a_job_it_still_holds(self, store: ResultStore) -> None:
        """What a scheduler that could not reach the database records once it is back: nothing, if the
        job was requeued and claimed by another meanwhile."""
        job_id = make_job(store)
        assert store.claim_job("first", job_id=job_id) == job_id and store.give_back(job_id, "first")
        assert store.claim_job("second", job_id=job_id) == job_id
        assert store.finish_job(job_id, "failed", "database unavailable", scheduler_id="first") is False
        assert store.job_status(job_id) == "running"
        assert store.finish_job(job_id, "done", scheduler_id="second") is True

    def test_requeue_stale_counts_only_the_database_uptime(self, store: ResultStore) -> None:
        """A job whose scheduler sent no heartbeat for `seconds` is queued again; on Postgres only if the
        server has been up that long (no scheduler could send heartbeats to a server that was down)."""
        job_id = make_job(store)
        store.claim_job("gone", job_id=job_id)
        ten_years = 10 * 365 * 86400.0
        with store.engine.begin() as connection:
            connection.execute(update(JobRecord.__table__).where(JobRecord.__table__.c.id == job_id)
                               .values(heartbeat_at=utcnow() - timedelta(seconds=ten_years)))
        postgres = store.engine.dialect.name == "postgresql"
        assert store.requeue_stale(ten_years - 86400) == ([] if postgres else [job_id])
        assert store.requeue_stale(60) == ([job_id] if postgres else [])
        assert store.job_status(job_id) == "queued"

    def test_job_status_of_unknown_job_is_a_user_error(self, store: ResultStore) -> None:
        with pytest.raises(FarmError, match="no job 12345") as info:
            store.job_status(12345)
        assert "\n" not in str(info.value)

    def test_jobs_lists_newest_first_with_trial_counts(self, store: ResultStore) -> None:
        old, new = make_job(store, name="old"), make_job(store, name="new")
        with store.writer(flush_seconds=None) as writer:
            for i in range(3):
                writer.record(store.tasks(old)[0]["id"], ok(i, 1e-3))
        listed = store.jobs()
        assert [(j["id"], j["trials"]) for j in listed] == [(new, 0), (old, 3)]
        assert [j["id"] for j in store.jobs(limit=1)] == [new]

    # Writer and trials ------------------------------------------------------------------

    def test_writer_batches_and_ignores_duplicates(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        writer = store.writer(batch_size=4, flush_seconds=None)
        inserts = []

        def count_inserts(connection: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.startswith("INSERT INTO trials"):
                inserts.append(connection.in_transaction())

        event.listen(store.engine, "before_cursor_execute", count_inserts)
        for i in range(3):
            writer.record(task_id, ok(i, 1e-3))
        assert writer.pending == 3 and store.trial_count(task_id) == 0 and inserts == []
        writer.record(task_id, ok(3, 1e-3))  # fills the batch: one multi-row INSERT
        assert writer.pending == 0 and store.trial_count(task_id) == 4 and inserts == [True]

        writer.record(task_id, ok(2, 9.0))  # already stored: ignored, first result kept
        writer.record(task_id, ok(10, 2e-3))
        writer.record(task_id, ok(10, 3e-3))  # duplicate within one batch
        assert writer.flush() == 1
        assert writer.flush() == 0
        writer.close()
        assert writer.inserted == 5 and len(inserts) == 2
        measured = store.measured(task_id)  # each config once, its first result kept
        assert set(measured) == {0, 1, 2, 3, 10} and measured[2] == pytest.approx(1e-3)
        assert measured[10] == pytest.approx(2e-3)
        assert store.best(task_id, k=10)[-1]["latency"] == pytest.approx(2e-3)
        with pytest.raises(RuntimeError, match="after close"):
            writer.record(task_id, ok(11, 1e-3))

        other = store.writer(flush_seconds=None)  # a second writer meets the same unique key
        other.record(task_id, ok(0, 5.0))
        assert other.flush() == 0
        other.close()

    def test_writer_flushes_in_background(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        writer = store.writer(batch_size=1000, flush_seconds=0.05)
        writer.record(task_id, ok(1, 1e-3))
        deadline = time.monotonic() + 5
        while store.trial_count(task_id) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.trial_count(task_id) == 1 and writer.pending == 0
        writer.close()

    def test_writer_is_thread_safe(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        with store.writer(batch_size=16, flush_seconds=0.01) as writer:

            def produce(offset: int) -> None:
                for i in range(offset, offset + 100):  # producers overlap by half
                    writer.record(task_id, ok(i, 1e-3 + i * 1e-6))

            threads = [threading.Thread(target=produce, args=(50 * n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert writer.inserted == 250
        assert set(store.measured(task_id)) == set(range(250))

    def test_failed_flush_keeps_rows(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        writer = store.writer(flush_seconds=None)
        writer.record(task_id, ok(1, 1e-3))
        writer.record(task_id + 999, ok(2, 1e-3))  # no such task: the foreign key rejects the batch
        with pytest.raises(IntegrityError):
            writer.flush()
        assert writer.pending == 2 and store.trial_count(task_id) == 0

    def test_trials_dataframe(self, store: ResultStore) -> None:
        job_id = make_job(store, n_tasks=2)
        first, second = (task["id"] for task in store.tasks(job_id))
        other = store.tasks(make_job(store))[0]["id"]
        with store.writer(flush_seconds=None) as writer:
            writer.record(first, ok(5, 3e-3, 1e-3, 2e-3, round=1))
            writer.record(first, failed(6, Status.TIMEOUT))
            writer.record(second, ok(1, 4e-3))
            writer.record(other, ok(1, 9e-3))

        frame = store.trials(job_id=job_id)
        assert list(frame.columns) == list(TRIAL_COLUMNS)
        assert frame["task_id"].tolist() == [first, first, second]
        row = frame.iloc[0]
        assert row["config_index"] == 5 and row["config"] == {"tile_x": [1, 2, 5], "unroll": 1}
        assert row["status"] == "ok" and row["latencies"] == [3e-3, 1e-3, 2e-3]
        assert row["latency"] == pytest.approx(2e-3)  # the median
        assert (row["device"], row["worker"], row["shard"], row["round"]) == ("H100", "w0", 2, 1)
        assert row["origin"] == "plan" and pd.isna(frame.iloc[1]["origin"])  # unknown: null
        assert row["build_seconds"] == 0.5 and row["run_seconds"] == 0.1
        assert row["workload_key"] == task_dict(0)["workload_key"]
        assert pd.Timestamp(row["created_at"]).tzinfo is not None
        timeout = frame.iloc[1]
        assert timeout["status"] == "timeout" and timeout["error"] == "config 6 failed"
        assert pd.isna(timeout["latency"]) and timeout["latencies"] == []

        assert store.trials(task_id=second)["config_index"].tolist() == [1]
        assert len(store.trials()) == 4
        empty = store.trials(task_id=other + 1)
        assert empty.empty and list(empty.columns) == list(TRIAL_COLUMNS)
        only_failures = store.trials(task_id=first).iloc[1:]
        assert only_failures["latency"].dtype == "float64"

        job = store.job(job_id)
        assert job is not None and job["trials"] == 3
        assert job["tasks"][0]["counts"] == {"ok": 1, "timeout": 1}
        assert job["tasks"][0]["best_latency"] == pytest.approx(2e-3)

    def test_best(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        with store.writer(flush_seconds=None) as writer:
            writer.record(task_id, ok(0, 5e-3))
            writer.record(task_id, failed(1))
            writer.record(task_id, ok(2, 1e-3, 9.0, 2e-3))  # median 2e-3
            writer.record(task_id, ok(3, 3e-3))
            writer.record(task_id, MeasureResult(4, {}, Status.WRONG_RESULT, latencies=[1e-6]))
        assert [t["config_index"] for t in store.best(task_id)] == [2]
        best = store.best(task_id, k=10)
        assert [t["config_index"] for t in best] == [2, 3, 0]  # ok trials only, fastest first
        assert best[0]["latency"] == pytest.approx(2e-3) and best[0]["config"] == ok(2).config
        assert store.best(task_id + 1) == []

    def test_task_budgets_move_and_earlier_jobs_records_are_found(self, store: ResultStore) -> None:
        """A model job's budget moves between its tasks (set_task_budget); prior_best finds the
        fastest ok trial of a kernel in every other job, one per task, with the task's template."""
        first, second, third = make_job(store), make_job(store), make_job(store)
        a, b = store.tasks(first)[0], store.tasks(second)[0]
        store.set_task_budget(a["id"], 7)
        assert store.tasks(first)[0]["budget"] == 7 and store.tasks(second)[0]["budget"] == 64
        with store.writer(flush_seconds=None) as writer:
            writer.record(a["id"], ok(0, 5e-3))
            writer.record(a["id"], ok(1, 2e-3))
            writer.record(a["id"], MeasureResult(2, {}, Status.WRONG_RESULT, latencies=[1e-6]))
            writer.record(b["id"], ok(3, 3e-3))
            writer.record(b["id"], MeasureResult(4, {}, Status.OK, latencies=[4e-3], origin="reused"))
        found = store.prior_best(a["workload_key"], a["target_kind"], exclude_job=third)
        assert [(r["job_id"], r["config_index"]) for r in found] == [(first, 1), (second, 3)]  # fastest first
        assert found[0]["latency"] == pytest.approx(2e-3) and found[0]["template"] == a["template"]
        assert found[0]["template_version"] == a["template_version"] and found[0]["target"] == a["target"]
        assert [r["job_id"] for r in store.prior_best(a["workload_key"], a["target_kind"], exclude_job=first)] \
            == [second]
        assert store.prior_best(a["workload_key"], "metal") == []  # another target kind
        assert [t["reused"] for t in store.job(second)["tasks"]] == [True]

    def test_trial_activity_counts_per_job_worker_and_status(self, store: ResultStore) -> None:
        first, second = make_job(store), make_job(store, n_tasks=2)
        a, (b, c) = store.tasks(first)[0]["id"], [t["id"] for t in store.tasks(second)]
        now = datetime.now(UTC)

        def stored(task_id: int, result: MeasureResult, seconds_ago: float, worker: str) -> None:
            store_at(store, task_id, replace(result, worker=worker), now - timedelta(seconds=seconds_ago))

        stored(a, ok(0, 1e-3), 300, "w0")  # before the window
        stored(a, ok(1, 1e-3), 50, "w0")
        stored(a, failed(2), 20, "w0")
        stored(a, ok(3, 1e-3), 10, "w0")
        stored(b, ok(0, 1e-3), 30, "w1")
        stored(c, failed(0, Status.TIMEOUT), 5, "w1")  # a second task of the same job
        since = now - timedelta(seconds=60)
        rows = store.trial_activity(since)
        assert [(r["job_id"], r["worker"], r["status"], r["trials"]) for r in rows] == [
            (first, "w0", "build_error", 1), (first, "w0", "ok", 2), (second, "w1", "ok", 1),
            (second, "w1", "timeout", 1)]
        assert rows[1]["last_at"] == now - timedelta(seconds=10) and rows[1]["last_at"].tzinfo is not None
        assert [r["job_id"] for r in store.trial_activity(since, [second])] == [second, second]
        assert store.trial_activity(since, []) == []
        assert sum(r["trials"] for r in store.trial_activity(now - timedelta(seconds=600), [first])) == 4
        assert store.trial_activity(now + timedelta(seconds=1)) == []

    # Rounds and cost models -------------------------------------------------------------

    def test_rounds(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        model_id = store.save_model(FAMILY, task_id, b"ubj", ["f0"], 10, 0.1)
        store.add_round(task_id, 0, trials=32, best_latency=None)
        store.add_round(task_id, 1, trials=64, best_latency=2e-3, rank_corr=0.5, model_id=model_id)
        store.add_round(task_id, 1, trials=65, best_latency=1e-3, rank_corr=0.6, model_id=model_id)  # replaces
        rounds = store.rounds(task_id)
        assert [(r["round"], r["trials"], r["best_latency"]) for r in rounds] == [(0, 32, None), (1, 65, 1e-3)]
        assert rounds[1]["rank_corr"] == 0.6 and rounds[1]["model_id"] == model_id
        assert rounds[0]["rank_corr"] is None and rounds[0]["model_id"] is None

    def test_model_bytes_round_trip_and_versions(self, store: ResultStore) -> None:
        task_id = store.tasks(make_job(store))[0]["id"]
        assert store.latest_model(FAMILY) is None
        blob = bytes(range(256)) * 400 + b"\x00\xff{UBJ"  # every byte value, NULs included
        first = store.save_model(FAMILY, task_id, blob, ["a", "b"], training_rows=100, training_seconds=0.25)
        second = store.save_model(FAMILY, None, blob[::-1], ["a", "b", "c"], 200, 0.5)
        store.save_model("other|llvm|matmul", None, b"x", [], 1, 0.0)

        latest = store.latest_model(FAMILY)
        assert latest is not None and latest["id"] == second and latest["version"] == 2
        assert isinstance(latest["model"], bytes) and latest["model"] == blob[::-1]
        assert latest["feature_names"] == ["a", "b", "c"] and latest["training_rows"] == 200
        assert latest["task_id"] is None and latest["rank_corr"] is None

        store.set_model_rank_corr(second, 0.75)
        latest = store.latest_model(FAMILY)
        assert latest is not None and latest["rank_corr"] == 0.75
        with pytest.raises(KeyError):
            store.set_model_rank_corr(second + 100, 0.1)
        assert first != second

    def test_trials_for_family(self, store: ResultStore) -> None:
        a = store.tasks(make_job(store))[0]["id"]
        b = store.tasks(make_job(store, n_tasks=2))[1]["id"]
        elsewhere = store.tasks(make_job(store, family="cuda_tiled|cuda|matmul"))[0]["id"]
        with store.writer(flush_seconds=None) as writer:
            writer.record(a, ok(1, 1e-3))
            writer.record(b, ok(2, 2e-3))
            writer.record(elsewhere, ok(3, 3e-3))
            writer.record(a, failed(4))
        frame = store.trials_for_family(FAMILY)
        assert list(frame.columns) == [*TRIAL_COLUMNS, "params"]
        assert frame["config_index"].tolist() == [1, 2, 4]
        assert [p["CI"] for p in frame["params"]] == [64, 65, 64]
        assert store.trials_for_family(FAMILY, limit=2)["config_index"].tolist() == [2, 4]  # the newest
        assert store.trials_for_family("nobody").empty

    # Exports and workers ----------------------------------------------------------------

    def test_exports_and_workers(self, store: ResultStore) -> None:
        job_id = make_job(store)
        assert store.add_export(job_id, "farm", "/tmp/best.json", 3) > 0

        worker_id = store.register_worker("gpu0", "node-a", "H100", "cuda")
        store.worker_seen("gpu0", "busy")
        (worker,) = store.workers()
        assert (worker["name"], worker["host"], worker["status"]) == ("gpu0", "node-a", "busy")
        assert worker["last_seen_at"] >= worker["started_at"]
        assert store.register_worker("gpu0", "node-b", "H200", "cuda") == worker_id  # a restart
        assert [(w["host"], w["device"], w["status"]) for w in store.workers()] == [("node-b", "H200", "idle")]
        store.register_worker("gpu1", "node-a", "H100", "cuda")
        assert [w["name"] for w in store.workers()] == ["gpu0", "gpu1"]
        with pytest.raises(KeyError, match="register_worker"):
            store.worker_seen("ghost", "busy")

    # Pickling, sessions -----------------------------------------------------------------

    def test_pickled_store_rebuilds_its_engine(self, store: ResultStore) -> None:
        job_id = make_job(store)
        assert isinstance(store, SQLResultStore)
        store.engine  # noqa: B018 - build the engine, which must not travel
        data = pickle.dumps(store)
        assert b"Engine" not in data and len(data) < 1000
        copy = pickle.loads(data)
        assert copy._engine is None and copy.url == store.url
        assert copy.claim_job("copy") == job_id
        assert copy.engine is not store.engine
        assert store.job_status(job_id) == "running"
        copy.close()

    def test_forked_child_rebuilds_its_engine(self, store: ResultStore) -> None:
        job_id = make_job(store)
        assert store.job_status(job_id) == "queued"  # the parent's pool now holds a connection
        pid = os.fork()
        if pid == 0:  # the child: claim through its own connection, never the parent's
            code = 0 if store.claim_job("child") == job_id else 1
            store.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.job_status(job_id) == "running"  # the parent's connection still works

    def test_session_factory(self, store: ResultStore) -> None:
        assert isinstance(store, SQLResultStore)
        with session_factory(store.engine)() as session, session.begin():
            session.add(WorkerRecord(name="orm", host="h", device="d", rpc_key="k", status="idle"))
        assert [w["name"] for w in store.workers()] == ["orm"]


def test_url_is_resolved_at_construction(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative SQLite path and $FARM_DB are fixed when the store is made, not where it lands."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FARM_DB", "sqlite:///env.db")
    store = open_store(None)
    assert store.url == f"sqlite:///{tmp_path}/env.db"
    monkeypatch.chdir("/")
    monkeypatch.delenv("FARM_DB")
    copy = pickle.loads(pickle.dumps(store))
    make_job(copy)
    assert os.path.exists(tmp_path / "env.db") and len(copy.jobs()) == 1
    store.close()
    copy.close()


def test_in_memory_sqlite_is_refused() -> None:
    for url in ("sqlite://", "sqlite:///:memory:"):
        with pytest.raises(FarmError, match="in-memory"):
            SQLResultStore(url)


def test_postgres_notifies_listeners(pg_url: str) -> None:
    import psycopg2

    store = open_store(pg_url)
    job_id = make_job(store, n_tasks=2)
    task_ids = [task["id"] for task in store.tasks(job_id)]
    listener = psycopg2.connect(pg_url.replace("+psycopg2", ""))
    listener.autocommit = True
    with listener.cursor() as cursor:
        cursor.execute(f"LISTEN {NOTIFY_CHANNEL}")
    with store.writer(flush_seconds=None) as writer:
        writer.record(task_ids[0], ok(1, 1e-3))
        writer.record(task_ids[1], ok(1, 1e-3))
        assert writer.flush() == 2
        writer.record(task_ids[0], ok(1, 1e-3))
        assert writer.flush() == 0  # nothing stored: nothing announced

    payloads = []
    deadline = time.monotonic() + 5
    while not payloads and time.monotonic() < deadline:
        select.select([listener], [], [], 0.1)
        listener.poll()
        payloads.extend(n.payload for n in listener.notifies)
        listener.notifies.clear()
    time.sleep(0.1)
    listener.poll()
    payloads.extend(n.payload for n in listener.notifies)
    assert payloads == [str(job_id)]  # one per job per flush, not per trial
    listener.close()
    store.close()
