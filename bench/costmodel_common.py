"""Shared by the bench/ scripts of the cost model and the search: a local device that measures
through the farm's Builder and RPC runner (memoised), and a tuning loop that retrains at every
round close exactly as scheduler.tuner is to call scheduler.retrain.

Measuring: a batch is first built (farm Builder, one process per core), then measured over a
kept-open RPC session on a local farm RPC server (farm RPCRunner: output checked against NumPy,
then timed with the llvm evaluator settings). Building and measuring do not overlap, so on a
2-core machine no compile runs while a kernel is timed. Each config of a workload is measured
once per process: a run that proposes it again gets the same result (the comparison between
searches is then not blurred by re-measurement noise, and repeated seeds cost nothing). With a
cache file the results are kept across scripts: bench/costmodel_features.py reads the random
samples bench/costmodel_search.py measured. Also: running a `farm tune` process, timed, and
reading its tuning curve back (bench/farm_search.py, bench/vs_metaschedule.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from db.store import open_store
from farm.jobs import JobRequest
from farm.measure import MeasureResult
from farm.search import make_search
from farm.task import Task
from farm.workloads import Workload
from scheduler.retrain import retrain, starting_model
from workers.device import cpu_model


def machine() -> str:
    """One line: CPU model and core count, for the reports."""
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{cpu_model()}, {cores} cores"


class LocalDevice:
    """This machine's CPU (llvm) or first GPU (cuda) as one farm device (see the module
    docstring). Use with ``with``."""

    def __init__(self, log_dir: Path | None = None, cache_file: Path | None = None, kind: str = "llvm") -> None:
        from deploy.local_cluster import LocalTracker
        from workers.builder import Builder

        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="farm-bench-"))
        self.builder = Builder()
        self.tracker = LocalTracker(log=self.log_dir / "tracker.log")
        self.kind = kind
        self.cache_file = cache_file
        self.cache = load_cache(cache_file) if cache_file is not None and cache_file.exists() else {}
        self.measured = 0  # configs actually built and measured by this process

    def __enter__(self) -> LocalDevice:
        from workers.device import ServerProcess, wait_for_keys
        from workers.runner import RPCRunner

        self.tracker.start()
        key = f"bench-{self.kind}"
        self.server = ServerProcess(self.tracker.address, key, self.kind, "0" if self.kind == "cuda" else None,
                                    log=self.log_dir / "server.log")
        wait_for_keys(self.tracker.address, [key], 120, [self.server.proc])
        self.runner = RPCRunner(self.tracker.address, key, self.kind, timeout=60, on_hang=self.server.kill_sessions)
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.close()
        self.server.stop()
        self.tracker.stop()
        self.builder.close()

    def measure(self, task: Task, indices: list[int], round_: int = 0) -> list[MeasureResult]:
        """One result per index, in order; configs measured before in this process are not re-run."""
        key = task.workload.key
        new = [i for i in dict.fromkeys(indices) if (key, i) not in self.cache]
        if new:
            for r in self.runner.measure(task, self.builder.build(task, new)):
                self.cache[(key, r.config_index)] = r
            self.measured += len(new)
            if self.cache_file is not None:
                doc = [{"workload_key": k, **r.to_json()} for (k, _), r in self.cache.items()]
                self.cache_file.write_text(json.dumps(doc))
        return [replace(self.cache[(key, i)], round=round_) for i in indices]


def load_cache(path: Path) -> dict[tuple[str, int], MeasureResult]:
    """Results a LocalDevice kept in `path`, by (workload key, config index)."""
    out = {}
    for doc in json.loads(path.read_text()):
        key = doc.pop("workload_key")
        out[(key, doc["config_index"])] = MeasureResult.from_json(doc)
    return out


def tune(device: LocalDevice, store: Any, workload: Workload, search: str, seed: int, budget: int,
         batch: int) -> list[MeasureResult]:
    """One tuning job of `workload` on the device in `store`, in rounds of `batch` trials, as the farm's
    scheduler runs it with one worker: propose, measure, write, observe; at each round close
    flush, retrain (scheduler.retrain), record the round, hand the new model to the search. A
    family model already in `store` guides the first round (transfer). Returns the results in
    trial order."""
    job = JobRequest.build([workload], device.kind, budget, search=search, seed=seed, batch_size=batch).submit(store)
    row = store.tasks(job)[0]
    task = Task.from_json(row)
    strategy = make_search(search, task, task.space.shards(1)[0], seed)
    current = starting_model(store, row)
    if current is not None:
        strategy.set_model(current.model)
    results: list[MeasureResult] = []
    with store.writer() as writer:
        for round_ in range(-(-budget // batch)):
            indices = strategy.propose(min(batch, budget - len(results)))
            if not indices:
                break
            measured = device.measure(task, indices, round_)
            for r in measured:
                writer.add(row["id"], r)
            strategy.observe(measured)
            results += measured
            writer.flush()
            out = retrain(store, row, task, current, measured)
            best = min((r.latency for r in results if r.latency is not None), default=None)
            store.add_round(row["id"], round_, len(results), best, out.rank_corr,
                            current.model_id if current else None)
            current = out.current
            strategy.set_model(current.model)
    store.finish_job(job, "done")
    return results


def fresh_store(folder: Path, name: str) -> Any:
    """A new SQLite store `folder/name.db` (an existing one is replaced)."""
    path = folder / f"{name}.db"
    path.unlink(missing_ok=True)
    return open_store(f"sqlite:///{path}")


def best_so_far(results: list[MeasureResult]) -> np.ndarray:
    """Best latency (s) after each trial; inf before the first correct one."""
    lat = np.array([r.latency if r.latency is not None else np.inf for r in results])
    return np.minimum.accumulate(lat)


def trials_to(curve: np.ndarray, threshold: float) -> int | None:
    """1-based number of trials until the curve is at or below `threshold`; None if never."""
    hits = np.nonzero(curve <= threshold)[0]
    return int(hits[0]) + 1 if len(hits) else None


def timed(command: list[str], log: Path) -> float:
    """Run `command` (output to `log`); its wall seconds. Exits with the log's tail on failure."""
    start = time.perf_counter()
    with log.open("wb") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{' '.join(command[:4])}... failed (exit {code}):\n{log.read_text()[-3000:]}")
    return seconds


def farm_tune(workload: str, params: list[str], target: str, trials: int, search: str, seed: int, out: Path,
              name: str) -> tuple[float, Path]:
    """`python -m farm tune` on the embedded defaults into the new SQLite store OUT/NAME.db, exporting
    OUT/NAME-best.json; (wall seconds of the whole process, the store's path)."""
    db = out / f"{name}.db"
    db.unlink(missing_ok=True)
    seconds = timed([sys.executable, "-m", "farm", "tune", workload, *params, "--target", target, "--trials",
                     str(trials), "--search", search, "--seed", str(seed), "--db", f"sqlite:///{db}", "--export",
                     str(out / f"{name}-best.json"), "--log-dir", str(out / f"logs-{name}")], out / f"{name}.log")
    return seconds, db


def farm_curve(db: Path) -> tuple[np.ndarray, dict[str, int]]:
    """Best-so-far latency (µs, NaN before the first correct trial) after each trial of the one job
    in the store `db`, and its trials' status counts."""
    from farm.report import tuning_curves

    store = open_store(f"sqlite:///{db}")
    (job,) = store.jobs()
    (curve,) = tuning_curves(store, [job["id"]])
    statuses = store.trials(job_id=job["id"])["status"].value_counts().to_dict()
    return curve.best_us, {k: int(v) for k, v in statuses.items()}
