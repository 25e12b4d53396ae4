"""Shared by the bench/ scripts of the cost model and the search: a memoising local device, and
tuning jobs run through the farm's own lifecycle and loop (farm.Client in process, with the
scheduler's tuning loop on an in-process worker pool whose one worker is that device).

Measuring: the device is the farm's (workers.device.LocalDevice: its Builder and RPC runner on a
local farm RPC server; outputs checked against NumPy, timed with the target's evaluator
settings). Each config of a workload is measured once per process: a run that proposes it again
gets the same result (the comparison between searches is then not blurred by re-measurement
noise, and repeated seeds cost nothing). With a cache file the results are kept across scripts:
bench/costmodel_features.py reads the random samples bench/costmodel_search.py measured. Also:
running a `farm tune` process, timed, and reading its tuning curve back (bench/farm_search.py,
bench/vs_metaschedule.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from db.store import ResultStore, open_store
from farm.client import Client
from farm.core.host import cpu_model
from farm.core.measure import MeasureResult, Status
from farm.core.task import Task
from farm.core.tir import is_script, tir_from_file
from farm.core.workloads import Workload, make_workload
from scheduler.local_pool import LocalWorkerPool
from workers.device import LocalDevice


def add_workload_arguments(parser: argparse.ArgumentParser, target: str = "cuda") -> None:
    """The options every farm-run benchmark takes: --workload, --params, --target."""
    parser.add_argument("--workload", default="resnet-last-conv",
                        help="workload or preset name, or a TVMScript file of a TIR kernel (bench/kernels/*.py)")
    parser.add_argument("--params", nargs="*", default=[], help="key=value workload parameters")
    parser.add_argument("--target", default=target)


def resolve_workload(name: str, params: Sequence[str]) -> Workload:
    """The workload `--workload` and `--params` name: a TVMScript file (FILE.py), or a workload or
    preset with key=value parameters."""
    if is_script(name):
        return tir_from_file(name)
    return make_workload(name, dict(p.split("=", 1) for p in params) or None)


def spread(values: Sequence[float]) -> str:
    """'median (min m, max M)' of `values`, as the reports quote a figure over seeds."""
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def machine() -> str:
    """One line: CPU model and core count, for the reports."""
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{cpu_model()}, {cores} cores"


class MemoDevice:
    """This machine's CPU (llvm) or first GPU (cuda) as one farm device whose measurements are
    memoised (see the module docstring). Use with ``with``; it serves any number of jobs."""

    def __init__(self, log_dir: Path | None = None, cache_file: Path | None = None, kind: str = "llvm") -> None:
        self.kind, self.name = kind, "bench"
        self.device = LocalDevice(kind, "bench", gpu="0", log_dir=log_dir or Path(tempfile.mkdtemp(prefix="farm-")))
        self.cache_file = cache_file
        self.cache = load_cache(cache_file) if cache_file is not None and cache_file.exists() else {}
        self.measured = 0  # configs actually built and measured by this process
        self._lock = threading.Lock()  # the loop runs two batches at once: one writer of the cache file

    def __enter__(self) -> MemoDevice:
        self.device.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.device.close()

    def measure(self, task: Task, indices: list[int], round_: int = 0) -> list[MeasureResult]:
        """One result per index, in order; configs measured before in this process are not re-run."""
        key = task.workload.key
        new = [i for i in dict.fromkeys(indices) if (key, i) not in self.cache]
        if new:
            measured = self.device.build_and_measure(task, new)
        with self._lock:
            for r in measured if new else []:
                self.cache[(key, r.config_index)] = r
            self.measured += len(new)
            if new and self.cache_file is not None:
                doc = [{"workload_key": k, **r.to_json()} for (k, _), r in self.cache.items()]
                self.cache_file.write_text(json.dumps(doc))
        return [replace(self.cache[(key, i)], round=round_) for i in indices]

    def build_and_measure(self, task: Task, indices: list[int], shard: int = 0, round_: int = 0) -> list[MeasureResult]:
        """The worker contract (scheduler.local_pool.BatchWorker), memoised."""
        return [replace(r, shard=shard) for r in self.measure(task, indices, round_)]

    def device_name(self) -> str:
        """The device's, as its results name it."""
        return self.device.device_name()

    def cancel(self) -> None:
        """Nothing to stop: a call returns at once, from the cache or after measuring in full."""

    def close(self) -> None:
        """Nothing: the device outlives the pools of the jobs it serves (``with`` closes it)."""


def load_cache(path: Path) -> dict[tuple[str, int], MeasureResult]:
    """Results a MemoDevice kept in `path`, by (workload key, config index)."""
    out = {}
    for doc in json.loads(path.read_text()):
        key = doc.pop("workload_key")
        out[(key, doc["config_index"])] = MeasureResult.from_json(doc)
    return out


def tune(device: MemoDevice, store: ResultStore, workload: Workload, search: str, seed: int, budget: int,
         batch: int) -> list[MeasureResult]:
    """One tuning job of `workload` on the device in `store` (its URL reopened by the client), run as
    `farm tune` runs it with one worker: the farm's job lifecycle and tuning loop, rounds of `batch`
    trials, the cost model retrained at every round close. A family model already in `store` guides
    the first round (transfer). Returns the results in trial order."""

    def one_device_pool(kind: str, count: int, keys: Sequence[str]) -> LocalWorkerPool:
        return LocalWorkerPool([device])

    with Client(store.url, in_process=True, pool_factory=one_device_pool) as client:
        job = client.submit([workload], device.kind, budget, search=search, seed=seed, batch_size=batch)
        job.wait(progress=False)
        frame = job.trials()  # in trial order
    return [MeasureResult(int(r.config_index), r.config, Status(r.status), r.error, list(r.latencies))
            for r in frame.itertuples()]


def fresh_store(folder: Path, name: str) -> ResultStore:
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
              name: str, extra: Sequence[str] = (), history: Path | None = None) -> tuple[float, Path]:
    """`python -m farm tune` on the embedded defaults into the SQLite store OUT/NAME.db, exporting
    OUT/NAME-best.json, with `extra` options; (wall seconds of the whole process, the store's path).

    The store is new, or with `history` a copy of that store: the job then starts from the cost
    model and trials its family has there, as a job on a farm that has tuned before does."""
    db = out / f"{name}.db"
    db.unlink(missing_ok=True)
    if history is not None:
        shutil.copyfile(history, db)
    seconds = timed([sys.executable, "-m", "farm", "tune", workload, *params, "--target", target, "--trials",
                     str(trials), "--search", search, "--seed", str(seed), "--db", f"sqlite:///{db}", "--export",
                     str(out / f"{name}-best.json"), "--log-dir", str(out / f"logs-{name}"), *extra],
                    out / f"{name}.log")
    return seconds, db


def farm_curve(db: Path) -> tuple[np.ndarray, dict[str, int]]:
    """Best-so-far latency (µs, NaN before the first correct trial) after each trial of the newest
    job in the store `db` (the one `farm_tune` ran, history or not), and its trials' status counts."""
    from farm.report import tuning_curves

    store = open_store(f"sqlite:///{db}")
    job = store.jobs(limit=1)[0]
    (curve,) = tuning_curves(store, [job["id"]])
    statuses = store.trials(job_id=job["id"])["status"].value_counts().to_dict()
    return curve.best_us, {k: int(v) for k, v in statuses.items()}
