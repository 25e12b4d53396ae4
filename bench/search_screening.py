"""Where the cost model puts fast configs it has not measured: the case for screened exploration.

    python bench/search_screening.py RUNS.json [--workload resnet-last-conv] [--params k=v ...]
                                     [--target cuda] [--train 32 64 96] [--fast-us 18] [--uniform 5000]
                                     [--screen 16 32 64] [--near 1.10] [--xgb-param KEY=VALUE ...]

RUNS.json is bench/farm_search.py's JSON (its runs' `config_index` and `latency_us`). For each xgb
run and each n of `--train`, a model is trained as the farm trains it (farm.core.costmodel.train)
on that run's first n trials, and scores a uniform sample of the space: the random runs' trials
where RUNS.json holds 100 or more of them, else `--uniform` valid configs drawn from the space.
Then, against that sample's scores:

- the percentile of the run's own best measured config (the plan's annealing starts from it and
  proposes what scores highest: where the model puts it decides whether the plan leaves its
  region);
- the percentiles of the fast configs (latency <= `--fast-us`, default the median of the random
  runs' bests) that other runs measured, and how many of them the model's top 5, 10 and 20% of
  uniform configs hold (recall), over that share (enrichment: how much more often a config the
  model screens in is fast than a uniform one);
- where the uniform sample has latencies: for each screen size N of `--screen`, the chance that a
  screened pick (XGBSearch's exploration: the best-scored of N uniform draws, here drawn from the
  sample) is fast, and that it is within `--near` of fast (default 1.10: a tenth slower), against
  a uniform pick's. It is computed exactly from the scores' ranks (the sample's config of rank r
  from the top is the best of N draws with replacement with probability ((S-r+1)/S)^N -
  ((S-r)/S)^N for S configs), so the figures do not hang on how the sample falls into groups; a
  sample of S configs resolves N well below S (the best of N is about its top 1/N).
  Then, per n and N, the mean of those chances over the xgb runs.

`--xgb-param KEY=VALUE ...` trains with those XGBoost parameters over the farm's
(farm.core.costmodel.XGB_PARAMS; a value is read as JSON where it parses, else as a string): a
study of the model itself, on the same trials.

Reads only; measures nothing. Prints one line per run and n, and the means.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
from costmodel_common import add_workload_arguments

from farm.core.costmodel import XGB_PARAMS, CostModel, train
from farm.core.features import featurizer
from farm.core.jobspec import JobRequest
from farm.core.search import RandomSearch
from farm.core.task import Task
from farm.core.workloads import make_workload


def frame(task: Task, indices: list[int], latency_us: list[float | None]) -> pd.DataFrame:
    """Trials as `store.trials_for_family` gives them to `train`: one shape, failed ones NaN."""
    ok = [v is not None for v in latency_us]
    return pd.DataFrame({
        "workload_key": task.workload.key, "params": [task.workload.p] * len(indices),
        "config": [task.space.get(i).to_json() for i in indices], "status": ["ok" if k else "error" for k in ok],
        "latency": [v * 1e-6 if v is not None else np.nan for v in latency_us]})


def scores(model: CostModel, task: Task, indices: list[int] | np.ndarray) -> np.ndarray:
    feats = featurizer(task)
    return model.predict(feats.features(feats.codes(np.asarray(indices, dtype=np.int64))), feats.names)


def best_of_chance(score: np.ndarray, size: int) -> np.ndarray:
    """Per config of a sample, the chance it is the best-scored of `size` uniform draws from the
    sample with replacement (ties broken by order). Sums to 1."""
    count = len(score)
    rank = np.empty(count)
    rank[np.argsort(-score, kind="stable")] = np.arange(1, count + 1)
    return ((count - rank + 1) / count) ** size - ((count - rank) / count) ** size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="bench/farm_search.py's JSON")
    add_workload_arguments(parser)
    parser.add_argument("--train", type=int, nargs="+", default=[32, 64, 96], help="trials to train on")
    parser.add_argument("--fast-us", type=float, help="a fast config's latency at most (default: the median "
                        "of the random runs' bests)")
    parser.add_argument("--uniform", type=int, default=5000, help="uniform configs drawn when RUNS.json has "
                        "no random run of 100 trials or more")
    parser.add_argument("--screen", type=int, nargs="+", default=[16, 32, 64], help="screen sizes N: the "
                        "chance that the best-scored of N uniform configs is fast")
    parser.add_argument("--near", type=float, default=1.10, help="'near fast': latency at most this times fast")
    parser.add_argument("--xgb-param", nargs="+", default=[], metavar="KEY=VALUE",
                        help="XGBoost parameters over the farm's, for a study of the model (max_depth=3)")
    args = parser.parse_args()
    for item in args.xgb_param:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        XGB_PARAMS[key] = value  # this process only: the study's models, not the farm's
    workload = make_workload(args.workload, dict(p.split("=", 1) for p in args.params) or None)
    (task,) = JobRequest.build([workload], args.target, 1).tasks
    runs = json.loads(args.runs.read_text())["runs"]
    if any("config_index" not in r for r in runs):
        raise SystemExit(f"search_screening: {args.runs} has runs without config_index; it needs the JSON of "
                         "bench/farm_search.py of this version or later")
    xgb = [r for r in runs if r["search"] != "random"]  # every guided spec's runs
    random_runs = [r for r in runs if r["search"] == "random"]
    fast_us = args.fast_us or statistics.median(min(v for v in r["latency_us"] if v is not None) for r in random_runs)
    measured_uniform = [r for r in random_runs if len(r["config_index"]) >= 100]
    if measured_uniform:
        uniform = [i for r in measured_uniform for i in r["config_index"]]
        uniform_us = np.array([np.inf if v is None else v for r in measured_uniform for v in r["latency_us"]])
        source = f"the random runs' {len(uniform)} measured configs"
    else:
        uniform = RandomSearch(task, task.space.shards(1)[0], seed=99).propose(args.uniform)
        uniform_us = None
        source = f"{len(uniform)} uniform valid configs"
    print(f"model: XGBoost {XGB_PARAMS}")
    print(f"{workload} on {args.target}: fast = at most {fast_us:.2f} µs, near = at most "
          f"{fast_us * args.near:.2f} µs; scored against {source}")
    means: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (n, N) -> per run (fast, near) chances
    for run in xgb:
        others = [r for r in runs if r is not run]
        fast = sorted({i for r in others for i, v in zip(r["config_index"], r["latency_us"], strict=True)
                       if v is not None and v <= fast_us})
        for n in args.train:
            model, _, _ = train(frame(task, run["config_index"][:n], run["latency_us"][:n]), task)
            uniform_raw = scores(model, task, uniform)
            uniform_scores = np.sort(uniform_raw)
            own = [(v, i) for i, v in zip(run["config_index"][:n], run["latency_us"][:n], strict=True) if v is not None]
            own_best_us, own_best = min(own)
            own_pct = np.searchsorted(uniform_scores, scores(model, task, [own_best])[0]) / len(uniform)
            line = (f"  {run['search']} seed {run['seed']}, trained on {n}: own best {own_best_us:.2f} µs at "
                    f"percentile {own_pct:.3f}")
            if fast:
                pct = np.searchsorted(uniform_scores, scores(model, task, fast)) / len(uniform)
                held = ", ".join(f"top {q:.0%} holds {np.mean(pct >= 1 - q):.0%} ({np.mean(pct >= 1 - q) / q:.1f}x)"
                                 for q in (0.05, 0.10, 0.20))
                line += f"; {len(fast)} fast configs of other runs: median percentile {np.median(pct):.3f}, {held}"
            if uniform_us is not None:
                fast_mask, near_mask = uniform_us <= fast_us, uniform_us <= fast_us * args.near
                line += f"; a uniform pick fast {fast_mask.mean():.2%}, near {near_mask.mean():.2%}"
                for size in args.screen:
                    chance = best_of_chance(uniform_raw, size)
                    shares = (chance[fast_mask].sum(), chance[near_mask].sum())
                    means.setdefault((n, size), []).append(shares)
                    line += f"; best of {size}: fast {shares[0]:.2%}, near {shares[1]:.2%}"
            print(line, flush=True)
    for (n, size), shares in sorted(means.items()):
        fast_mean, near_mean = np.mean(shares, axis=0)
        print(f"  trained on {n}, best of {size}: fast {fast_mean:.2%}, near {near_mean:.2%} "
              f"(mean of {len(shares)} runs)")


if __name__ == "__main__":
    main()
