"""Which features pay off: knob values alone, the farm's features (knobs, derived quantities,
footprints, shape), and those plus MetaSchedule's PerStoreFeature of the scheduled kernel; and
the ranking objective against plain regression. Rank correlation on held-out measurements and
featurizing time per config.

    python bench/costmodel_features.py [--out /tmp/farm-bench-costmodel] [--splits 10] [--target llvm]

Reads the uniform random samples bench/costmodel_search.py measured (OUT/measured.json; run it
first): no measuring here. For each workload and training size n, `--splits` random splits of
the sample: fit on n configs, rank the rest; reported: Spearman correlation with measured
throughput (failed configs slowest) and top-8 regret (the best measured latency among the 8
configs ranked best, over the best of the held-out configs; 1.00 = found it).

Transfer across shapes (what the shape and derived features are for): with the measurements of
bench/costmodel_zeroshot.py (--zeroshot-out), a model fitted on every measured config of a
family's training shapes ranks the measured configs of each held-out shape.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_common import load_cache, machine
from costmodel_search import WORKLOADS
from costmodel_zeroshot import FAMILIES

import farm.core.costmodel as cm
from farm.core.costmodel import CostModel, relative_throughput, spearman
from farm.core.features import featurizer
from farm.core.search import RandomSearch
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload


def per_store_features(task: Task, indices: list[int]) -> tuple[np.ndarray, float, float]:
    """MetaSchedule's PerStoreFeature of each config's scheduled module, summed and maxed over its
    stores: (matrix, seconds of the one-time setup, seconds per config)."""
    from tvm.s_tir import meta_schedule as ms

    start = time.perf_counter()
    first = task.schedule(task.space.get(indices[0]))
    context = ms.TuneContext(mod=first.mod, target=task.target.tvm(), num_threads=1)
    extractor = ms.feature_extractor.PerStoreFeature()
    setup = time.perf_counter() - start
    start = time.perf_counter()
    rows = []
    for i in indices:
        sch = task.schedule(task.space.get(i))
        candidate = ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"]))
        stores = extractor.extract_from(context, [candidate])[0].numpy()
        rows.append(np.concatenate([stores.sum(axis=0), stores.max(axis=0)]))
    return np.array(rows, dtype=np.float32), setup, (time.perf_counter() - start) / len(indices)


def evaluate(x: np.ndarray, names: list[str], latency: np.ndarray, n: int, splits: int,
             objective: str = "rank:pairwise") -> tuple[float, float]:
    """Mean Spearman and mean top-8 regret over random splits (train on n, rank the rest)."""
    params = dict(cm.XGB_PARAMS)
    if objective != params["objective"]:
        cm.XGB_PARAMS = {k: v for k, v in params.items() if not k.startswith("lambdarank")} | {"objective": objective}
    try:
        rho, regret = [], []
        for split in range(splits):
            order = np.random.default_rng(split).permutation(len(latency))
            train, test = order[:n], order[n:]
            labels = relative_throughput(latency[train], np.zeros(n, dtype=np.int64))
            model = CostModel().fit(x[train], names, labels, np.zeros(n, dtype=np.int64))
            scores = model.predict(x[test], names)
            rho.append(spearman(scores, relative_throughput(latency[test], np.zeros(len(test), dtype=np.int64))))
            measured = np.where(np.isnan(latency[test]), np.inf, latency[test])
            regret.append(measured[np.argsort(-scores)[:8]].min() / measured.min())
        return float(np.mean([r for r in rho if r is not None])), float(np.mean(regret))
    finally:
        cm.XGB_PARAMS = params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-bench-costmodel"))
    parser.add_argument("--random", type=int, default=256, help="the search benchmark's --random")
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--zeroshot-out", type=Path, help="--out of bench/costmodel_zeroshot.py, for transfer")
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"], help="the target the runs measured")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    target = parse_target(args.target)
    within_shape(load_cache(args.out / "measured.json"), args.random, args.splits, target)
    if args.zeroshot_out is not None:
        across_shapes(load_cache(args.zeroshot_out / "measured.json"), target)


def across_shapes(cache: dict[tuple[str, int], Any], target: TargetSpec) -> None:
    """Spearman on each held-out shape of a model fitted on the family's training shapes (families
    the run did not measure are skipped)."""
    measured = {k for k, _ in cache}
    for family, (train_shapes, held_out) in FAMILIES.items():
        if not all(wl.key in measured for wl in [*train_shapes, *held_out]):
            continue
        for label, keep in (("knob values only", lambda n: n.startswith("knob.")), ("farm features", lambda n: True)):
            blocks, names = [], None
            for wl in train_shapes:
                task = Task(wl, target)
                feats = featurizer(task)
                results = [r for (k, _), r in cache.items() if k == wl.key]
                latency = np.array([r.latency if r.latency is not None else np.nan for r in results])
                x = feats.features(feats.codes([r.config_index for r in results]))
                columns = [j for j, n in enumerate(feats.names) if keep(n)]
                names = [feats.names[j] for j in columns]
                blocks.append((x[:, columns], relative_throughput(latency, np.zeros(len(results), dtype=np.int64))))
            groups = np.concatenate([np.full(len(y), g) for g, (_, y) in enumerate(blocks)])
            model = CostModel().fit(np.vstack([x for x, _ in blocks]), names, np.concatenate([y for _, y in blocks]),
                                    groups)
            cells = []
            for wl in held_out:
                feats = featurizer(Task(wl, target))
                results = [r for (k, _), r in cache.items() if k == wl.key]
                latency = np.array([r.latency if r.latency is not None else np.nan for r in results])
                scores = model.predict(feats.features(feats.codes([r.config_index for r in results])), feats.names)
                rho = spearman(scores, relative_throughput(latency, np.zeros(len(results), dtype=np.int64)))
                cells.append(f"{wl}: rho {rho:.2f} on {len(results)} configs")
            print(f"transfer, {family}, {label:16s} " + "; ".join(cells), flush=True)


def within_shape(cache: dict[tuple[str, int], Any], size: int, splits: int, target: TargetSpec) -> None:
    """Rank correlation and regret of feature sets and objectives within each workload's sample."""
    for name, (preset, params) in WORKLOADS.items():
        task = Task(make_workload(preset, params), target)
        sample = RandomSearch(task, task.space.shards(1)[0], seed=1000).propose(size)
        results = [cache[(task.workload.key, i)] for i in sample if (task.workload.key, i) in cache]
        if len(results) < len(sample):
            print(f"{name}: only {len(results)} of {len(sample)} sample configs measured; run costmodel_search.py")
            continue
        latency = np.array([r.latency if r.latency is not None else np.nan for r in results])
        feats = featurizer(task)
        start = time.perf_counter()
        farm_x = feats.features(feats.codes(sample))
        farm_seconds = (time.perf_counter() - start) / len(sample)
        knobs = [j for j, n in enumerate(feats.names) if n.startswith("knob.")]
        psf, setup, psf_seconds = per_store_features(task, sample)
        psf_names = [f"psf.{j}" for j in range(psf.shape[1])]
        sets: dict[str, tuple[np.ndarray, list[str], str]] = {
            "knob values only": (farm_x[:, knobs], [feats.names[j] for j in knobs], "rank:pairwise"),
            "farm features": (farm_x, feats.names, "rank:pairwise"),
            "farm + PerStoreFeature": (np.hstack([farm_x, psf]), feats.names + psf_names, "rank:pairwise"),
            "farm features, reg:squarederror": (farm_x, feats.names, "reg:squarederror"),
        }
        print(f"{name} ({task.workload}, {len(sample)} random configs, {np.isnan(latency).sum()} failed): "
              f"featurize {farm_seconds * 1e6:.1f} µs/config (farm), PerStoreFeature {psf_seconds * 1e3:.2f} ms/config "
              f"(schedule + extract) + {setup:.1f} s once")
        for label, (x, names, objective) in sets.items():
            cells: list[Any] = []
            for n in (n for n in (32, 64, 128) if n <= size - 32):  # leave at least 32 to rank
                rho, regret = evaluate(x, names, latency, n, splits, objective)
                cells.append(f"n={n}: rho {rho:.2f}, top-8 regret {regret:.2f}")
            print(f"  {label:34s} " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
