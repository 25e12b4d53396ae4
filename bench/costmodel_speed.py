"""How long the cost model's steps take: retraining at 10,000 trials, scoring 100,000 candidates,
planning a batch (XGBSearch's annealing), and a zero-shot prediction.

    python bench/costmodel_speed.py [--trials 10000] [--candidates 100000] [--repeat 5] [--busy N]

Timing only, so the trials' latencies are synthetic (a fixed function of the features plus
noise): what is timed (reading the family's trials from SQLite, featurizing them, fitting,
saving; featurizing and scoring candidates) does not depend on the values. The family has four
shapes of resnet-last-conv's conv2d on cuda (79 features, the largest space: 10.4 million
configs); every figure is the median of --repeat runs. XGBoost runs on
farm.core.costmodel.XGB_THREADS threads. With --busy N, N processes spin on the CPU while the
steps are timed, as a GPU host's build processes do in a wave of builds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from costmodel_common import machine

from db.store import open_store
from farm.core.costmodel import XGB_THREADS, training_set
from farm.core.features import featurizer
from farm.core.jobspec import JobRequest
from farm.core.measure import MeasureResult, Status
from farm.core.search import XGBSearch
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from farm.predict import predict
from scheduler.retrain import retrain

SHAPES = [dict(CI=512, CO=512, H=7, W=7), dict(CI=256, CO=256, H=14, W=14), dict(CI=128, CO=128, H=28, W=28),
          dict(CI=64, CO=64, H=56, W=56)]


def timed(f: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median seconds of `repeat` calls, and the last call's result."""
    seconds, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = f()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def synthetic(task: Task, indices: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    feats = featurizer(task)
    x = feats.features(feats.codes(indices))
    weights = np.random.default_rng(0).normal(0, 0.05, x.shape[1])
    return 1e-4 * np.exp(np.nan_to_num(x) @ weights + rng.normal(0, 0.1, len(indices)))


def spin() -> None:
    """A CPU-bound process, for --busy."""
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--candidates", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="processes spinning on the CPU while the steps are timed (builds' load)")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the start")
    rng = np.random.default_rng(1)
    store = open_store(f"sqlite:///{Path(tempfile.mkdtemp()) / 'speed.db'}")
    rows = []
    for shape in SHAPES:
        wl = make_workload("conv2d_nchw", dict(N=1, KH=3, KW=3, pad=1, **shape))
        job = store.submit(JobRequest.build([wl], "cuda", args.trials, search="xgb"))
        rows.append(store.tasks(job)[0])
    with store.writer() as writer:
        for row in rows:
            task = Task.from_json(row)
            indices = rng.choice(task.space.size, args.trials // len(rows), replace=False)
            for i, latency in zip(indices.tolist(), synthetic(task, indices, rng).tolist(), strict=True):
                failed = rng.random() < 0.1
                writer.record(row["id"], MeasureResult(i, task.space.get(i).to_json(),
                                                    Status.RUNTIME_ERROR if failed else Status.OK,
                                                    latencies=[] if failed else [latency]))
    row, task = rows[0], Task.from_json(rows[0])
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    if spinners:
        print(f"{len(spinners)} processes spinning on the CPU from now on")

    read, trials = timed(lambda: store.trials_for_family(row["family_key"]), args.repeat)
    featurize, data = timed(lambda: training_set(trials, task), args.repeat)
    total, out = timed(lambda: retrain(store, row, task, None, []), args.repeat)
    print(f"retrain at {out.training_rows:,} trials ({len(data.feature_names)} features, {len(SHAPES)} shapes): "
          f"{total:.2f} s (read from SQLite {read:.2f} s, featurize {featurize:.2f} s, "
          f"fit {out.training_seconds - featurize:.2f} s, save the rest)")

    model = out.current.model
    feats = featurizer(task)
    candidates = rng.integers(0, task.space.size, args.candidates)
    features, _ = timed(lambda: feats.features(feats.codes(candidates)), args.repeat)
    scoring, _ = timed(lambda: model.predict(feats.features(feats.codes(candidates)), feats.names), args.repeat)
    print(f"scoring {args.candidates:,} candidates: {scoring:.3f} s (features {features:.3f} s, "
          f"model {scoring - features:.3f} s)")

    def plan() -> list[int]:
        search = XGBSearch(task, task.space.shards(1)[0], seed=int(rng.integers(1 << 30)))
        search.set_model(model)
        return search.propose(16)

    planning, _ = timed(plan, args.repeat)
    default = XGBSearch(task, task.space.shards(1)[0])
    print(f"XGBSearch batch of 16 (annealing {default.chains} chains x {default.steps} steps, validity checks, "
          f"diverse picks): {planning:.3f} s")

    untuned = make_workload("conv2d_nchw", dict(N=1, CI=384, CO=384, H=14, W=14, KH=3, KW=3, pad=1))
    zero_shot, _ = timed(lambda: predict(untuned, parse_target("cuda"), store, top=5), args.repeat)
    print(f"predict top 5 for an untuned shape ({untuned}): {zero_shot:.3f} s")
    print(f"load average {os.getloadavg()[0]:.1f} at the end; XGBoost threads: {XGB_THREADS}")
    for p in spinners:
        p.kill()


if __name__ == "__main__":
    main()
