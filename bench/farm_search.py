"""Model-guided search against random search through the whole farm: trials to come within 95% of
the best latency, and the best latency at each budget.

    python bench/farm_search.py [--workload resnet-last-conv] [--params k=v ...] [--target cuda]
                                [--seeds 3] [--trials 128] [--random-trials 384] [--history STORE]
                                [--out DIR] [--json FILE]

Every run is a `python -m farm tune` process on the embedded defaults (local Ray, RPC tracker and
server, SQLite), each in a new store so that no run learns from another: `--seeds` runs with
`--search xgb` of `--trials` each (seeds 0, 1, ...), then one run with `--search random` of
`--random-trials` (seed 1000). With `--history STORE` (a SQLite store of an earlier job of the same
family on other shapes, such as another run's OUT/xgb-0.db) each xgb run's store starts as a copy of
it instead: the run starts from that family's cost model and trials, as a job on a farm that has
tuned before does (farm.core.costmodel: one model per family, all shapes). The store must hold a
model of the family and no trial of the shape tuned here, or the script stops before any run.
(bench/costmodel_search.py compares the two searches on memoised measurements of a local device
instead; this script measures what a user of `farm tune` gets, pipelining and all.)

A random search run is a uniform sample of valid configs without replacement, so besides its own
curve, its trials to a threshold are given as the expectation over orders, (R + 1) / (k + 1) for
k hits among its R trials (a lower bound, "> R", when k = 0). Thresholds: best / 0.95 and
best / 0.90, best being the fastest latency any run measured. Also the xgb runs' budget against
the trials random search needed for the xgb runs' median best; and the trials the xgb runs need
to reach random search's best against random's expected trials to it (issue 15's measure).
Writes the curves' plot to OUT/curves.png and, with --json, every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
from costmodel_common import add_workload_arguments, farm_curve, farm_tune, trials_to

from db.store import open_store
from farm.core.errors import FarmError
from farm.core.jobspec import JobRequest, family_key
from farm.core.workloads import Workload, make_workload
from farm.report import Curve, plot_curves


def expected_random_trials(latency_us: np.ndarray, threshold: float) -> tuple[float, int]:
    """(expected trials of a random order of the sample to reach `threshold`, hits in the sample)."""
    hits = int((latency_us <= threshold).sum())
    return (len(latency_us) + 1) / (hits + 1), hits


def check_history(history: Path, workload: Workload, target: str) -> str:
    """What `history` holds for the task tuned here, in words; FarmError unless it holds a model of
    the task's family and no trial of its shape (the runs would then not be learning from other
    shapes but from this one)."""
    if not history.is_file():
        raise FarmError(f"--history {history}: no such store (give an earlier run's OUT/xgb-0.db)")
    (task,) = JobRequest.build([workload], target, 1).tasks
    family = family_key(task)
    store = open_store(f"sqlite:///{history}")
    if store.latest_model(family) is None:
        raise FarmError(f"--history {history}: no cost model of {family} there; tune another shape of "
                        f"{task.workload.name} for {task.target.kind} with --search xgb into it first")
    trials = store.trials_for_family(family)
    if (trials["workload_key"] == task.workload.key).any():
        raise FarmError(f"--history {history}: it holds trials of {task.workload} itself; give a store of "
                        "other shapes only")
    return f"{len(trials)} trials of {trials['workload_key'].nunique()} other shape(s) of {family}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=128, help="trials of each xgb run")
    parser.add_argument("--random-trials", type=int, default=384)
    parser.add_argument("--history", type=Path, help="a store of other shapes of the family each xgb run starts "
                        "from (a copy of it); default: a new store")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-search"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workload = make_workload(args.workload, dict(p.split("=", 1) for p in args.params) or None)
    try:
        history = check_history(args.history, workload, args.target) if args.history else None
    except FarmError as e:
        raise SystemExit(f"farm_search: {e}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{workload} on {args.target}: {args.seeds} xgb runs of {args.trials} trials"
          + (f", each starting from {history}" if history else "") + f", random search {args.random_trials}",
          flush=True)
    runs = []
    for seed in range(args.seeds):
        seconds, db = farm_tune(args.workload, args.params, args.target, args.trials, "xgb", seed, args.out,
                                f"xgb-{seed}", history=args.history)
        curve, statuses = farm_curve(db)
        runs.append({"search": "xgb", "seed": seed, "wall_s": seconds, "statuses": statuses, "curve_us": curve})
        print(f"  xgb seed {seed}: best {np.nanmin(curve):.2f} µs in {seconds:.0f} s", flush=True)
    # Seed 1000: xgb runs start as random search with their own seed until a model exists, and
    # would share their first configs with a random run of the same seed.
    seconds, db = farm_tune(args.workload, args.params, args.target, args.random_trials, "random", 1000, args.out,
                            "random")
    random_curve, statuses = farm_curve(db)
    trials = open_store(f"sqlite:///{db}").trials()
    random_us = np.where(trials["latency"].isna(), np.inf, trials["latency"].to_numpy(dtype=float) * 1e6)
    runs.append({"search": "random", "seed": 1000, "wall_s": seconds, "statuses": statuses, "curve_us": random_curve})
    print(f"  random: best {np.nanmin(random_curve):.2f} µs in {seconds:.0f} s", flush=True)

    best = min(float(np.nanmin(r["curve_us"])) for r in runs)
    xgb_curves = [np.nan_to_num(r["curve_us"], nan=np.inf) for r in runs if r["search"] == "xgb"]
    figures: dict = {"workload": str(workload), "target": args.target, "history": history, "best_us": best,
                     "thresholds": {},
                     "runs": [{**r, "curve_us": [None if np.isnan(v) else v for v in r["curve_us"]]} for r in runs]}
    print(f"best of all runs: {best:.2f} µs")
    for fraction in (0.95, 0.90):
        threshold = best / fraction
        xgb = [trials_to(c, threshold) for c in xgb_curves]
        xgb_median = statistics.median(xgb) if all(t is not None for t in xgb) else None
        expected, hits = expected_random_trials(random_us, threshold)
        ratio = expected / xgb_median if xgb_median and hits else None
        figures["thresholds"][str(fraction)] = {"xgb_trials": xgb, "xgb_median": xgb_median, "random_hits": hits,
                                                "random_expected": expected, "ratio": ratio}
        random_text = f"{expected:.0f} expected ({hits} hits)" if hits else f"> {len(random_us)} (no hit)"
        bound = f"{ratio:.1f}x" if ratio else (f"> {len(random_us) / xgb_median:.1f}x" if xgb_median else "n/a")
        print(f"  to {fraction:.0%} of best ({threshold:.2f} µs): xgb {xgb} (median {xgb_median}), "
              f"random {random_text}: {bound} fewer trials with the model")
    # Issue 15's measure: the trials the xgb runs need to reach random search's best, against the
    # trials a random order of random's sample needs to reach it (its expectation, as above). A run
    # that never got there counts as more than its budget, so the median is one while most did.
    random_best = float(np.min(random_us))
    xgb = [trials_to(c, random_best) for c in xgb_curves]
    median = statistics.median(math.inf if t is None else t for t in xgb)
    expected, hits = expected_random_trials(random_us, random_best)
    ratio = expected / median
    figures["to_random_best"] = {"latency_us": random_best, "xgb_trials": xgb,
                                 "xgb_median": None if math.isinf(median) else median, "random_hits": hits,
                                 "random_expected": expected, "ratio": None if math.isinf(median) else ratio}
    print(f"  to random's best ({random_best:.2f} µs): xgb {xgb} (median "
          + (f"> {args.trials}" if math.isinf(median) else f"{median:.0f}")
          + f"), random {expected:.1f} expected ({hits} of its {len(random_us)} there): "
          + (f"< {expected / args.trials:.1f}x" if math.isinf(median) else f"{ratio:.2f}x")
          + " fewer trials with the model")
    # The other way round: what the xgb runs reach at their budget, and what random search needs for it.
    xgb_final = statistics.median(float(c[-1]) for c in xgb_curves)
    expected, hits = expected_random_trials(random_us, xgb_final)
    figures["xgb_median_final_us"] = xgb_final
    figures["random_trials_for_xgb_median_final"] = {"expected": expected, "hits": hits}
    print(f"  xgb median best after {args.trials} trials: {xgb_final:.2f} µs; random search "
          + (f"needs {expected:.0f} trials expected ({hits} hits)" if hits else f"never got there in {len(random_us)}"))
    label = f"{workload} on {args.target}"
    plot = plot_curves([Curve(f"{r['search']} seed {r['seed']} ({r['wall_s']:.0f} s)", label, r["curve_us"])
                        for r in runs], args.out / "curves.png")
    print(f"tuning curves: {plot}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
