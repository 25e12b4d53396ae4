"""Trials needed to come within 95% of the best latency found, model-guided (xgb) versus random.

    python bench/costmodel_search.py [--budget 64] [--batch 8] [--seeds 3] [--random 256] [--target llvm]

For each workload (llvm on this machine's CPU, or cuda on its first GPU): `--seeds` xgb tuning
jobs of `--budget` trials, each in its own SQLite store (no model learnt in one run helps
another), retrained at every round close through scheduler.retrain; and one uniform random
sample of `--random` configs.
Random search is sampling without replacement, so that sample in a random order *is* a random
search run: its trials-to-threshold is reported as the expectation over orders, (R + 1) / (k + 1)
for k hits among R, which needs no luck of one order. Everything is measured through the farm's
builder and RPC runner (bench/costmodel_common.py), each config once; the results are kept in
OUT/measured.json, which bench/costmodel_features.py reads.

Threshold: latency <= best / 0.95 (and, less sensitive to one lucky config, best / 0.90), best
being the fastest config any method found; a median is given only when every xgb run reached it.
Also the best latency after the budget: xgb per run, random as the median over orders of the
sample. Prints a few lines per workload and writes JSON (--json) with every curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from costmodel_common import MemoDevice, best_so_far, fresh_store, machine, trials_to, tune

from farm.core.search import RandomSearch
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload

WORKLOADS = {
    "resnet-last-conv": ("resnet-last-conv", {}),
    "seed-depthwise": ("seed-depthwise", {}),
    "matmul": ("matmul", {"M": 256, "N": 256, "K": 256}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--random", type=int, default=256, help="size of the random sample")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-bench-costmodel"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    figures = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    with MemoDevice(args.out / "logs", args.out / "measured.json", args.target) as device:
        for name in args.workloads:
            start = time.perf_counter()
            wl = make_workload(*WORKLOADS[name])
            task = Task(wl, parse_target(args.target))
            sample = RandomSearch(task, task.space.shards(1)[0], seed=1000).propose(args.random)
            random_lat = np.array([r.latency if r.latency is not None else np.inf
                                   for r in device.measure(task, sample)])
            curves = []
            for seed in range(args.seeds):
                store = fresh_store(args.out, f"{name}-xgb-{seed}")
                curves.append(best_so_far(tune(device, store, wl, "xgb", seed, args.budget, args.batch)))
            best = min(random_lat.min(), *(c[-1] for c in curves))
            row = {"workload": str(wl), "space": task.space.size, "best_us": best * 1e6,
                   "xgb_best_us": [c[-1] * 1e6 for c in curves], "random_sample_best_us": random_lat.min() * 1e6,
                   "curves_us": [list(c * 1e6) for c in curves]}
            # Random search's best after the budget: the best of `budget` configs of the sample, over orders.
            orders = np.random.default_rng(0).random((2000, len(random_lat))).argsort(axis=1)[:, : args.budget]
            random_at_budget = float(np.median(random_lat[orders].min(axis=1)))
            row["random_best_at_budget_us"] = random_at_budget * 1e6
            line = [f"{name}: space {task.space.size:,}, best {best * 1e6:.1f} µs; best after {args.budget} trials: "
                    f"xgb {', '.join(f'{c[-1] * 1e6:.1f}' for c in curves)} µs (median "
                    f"{np.median([c[-1] for c in curves]) * 1e6:.1f}), random median {random_at_budget * 1e6:.1f} µs"]
            for fraction in (0.95, 0.90):
                threshold = best / fraction
                xgb = [trials_to(c, threshold) for c in curves]
                reached = [t for t in xgb if t is not None]
                xgb_median = statistics.median(xgb) if len(reached) == len(xgb) else None
                hits = int((random_lat <= threshold).sum())
                random_expected = (len(random_lat) + 1) / (hits + 1)
                ratio = random_expected / xgb_median if xgb_median and hits else None
                row[f"within_{fraction}"] = {"xgb_trials": xgb, "xgb_median": xgb_median, "random_hits": hits,
                                             "random_expected": random_expected, "ratio": ratio}
                random_text = f"{random_expected:.0f}" if hits else f"> {len(random_lat)}"
                line.append(f"  to {fraction:.0%} of best: xgb {xgb} (median {xgb_median}), random {random_text} "
                            f"expected ({hits} of {len(random_lat)} random configs), "
                            f"ratio {'n/a' if ratio is None else f'{ratio:.1f}x'}")
            row["seconds"] = time.perf_counter() - start
            figures["workloads"][name] = row
            figures["configs_measured"] = device.measured
            print("\n".join(line) + f"\n  ({row['seconds']:.0f} s)", flush=True)
            if args.json:  # after every workload, so a run cut short keeps what it finished
                args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
