"""What a job's first, unguided candidates cost to build: the xgb search's first proposals (a
shard's first QUICK_FIRST kept to quick-building configs, farm.core.search.QUICK_BUILD) against
uniform random ones (what the xgb search proposed before it, and what `--search random` still does).

    python bench/first_builds.py [--workload resnet-last-conv] [--params k=v ...] [--target cuda]
                                 [--shards 2] [--per-shard 16] [--slots N] [--seeds 3] [--json FILE]

For each seed and search, the first `--per-shard` proposals of each of `--shards` shards (one per
worker of a `--shards`-GPU job: a worker's first batch) are built at once in a warm
`workers.builder.ProcessPoolBuilder` of `--slots` processes (default: one per core), as a worker's
build slots build them. Printed per search: build seconds per candidate (mean, p95, max), the time
from submitting the batch to its first built candidate and to its last, medians over seeds with
min-max. Printed first: how long the builder's slots took to be warm (their processes started,
TVM imported), from the builder's start in this fresh process, as a worker's builder starts. No
GPU is needed: a cuda build compiles with nvcc and stops before the device.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_common import add_workload_arguments

from farm.core.search import RandomSearch, XGBSearch
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from workers.builder import ProcessPoolBuilder

SLOTS_WARM_LIMIT_S = 300
SEARCHES = {"random (uniform)": RandomSearch, "xgb, unguided (quick builds)": XGBSearch}


def first_batch(builder: ProcessPoolBuilder, task: Task, indices: list[int]) -> dict[str, Any]:
    """Build `indices` at once: their build seconds, and when the first and the last were done."""
    start = time.monotonic()
    futures = builder.start(task, indices)
    done = [time.monotonic() - start for _ in cf.as_completed(futures)]
    results = [f.result() for f in futures]
    seconds = [r.build_seconds for r in results]
    statuses = collections.Counter(r.status.value if r.status is not None else "ok" for r in results)
    return {"build_mean_s": float(np.mean(seconds)), "build_p95_s": float(np.percentile(seconds, 95)),
            "build_max_s": float(np.max(seconds)), "first_built_s": done[0], "all_built_s": done[-1],
            "statuses": dict(statuses)}


class _SlotsWarm(logging.Handler):
    """When each build slot said it was warm (its "build slot N warm in S s" record)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.at: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("build slot") and " warm in " in record.getMessage():
            self.at.append(time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--shards", type=int, default=2, help="workers of the job (one shard each)")
    parser.add_argument("--per-shard", type=int, default=16, help="a worker's first batch")
    parser.add_argument("--slots", type=int, default=None, help="build processes (default: one per core)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    task = Task(make_workload(args.workload, dict(p.split("=", 1) for p in args.params) or None),
                parse_target(args.target))
    shards = task.space.shards(args.shards)
    figures: dict = {"workload": str(task.workload), "target": args.target, "shards": args.shards,
                     "per_shard": args.per_shard, "runs": {name: [] for name in SEARCHES}}
    slots_warm = _SlotsWarm()
    builder_log = logging.getLogger("farm.builder")
    builder_log.addHandler(slots_warm)
    builder_log.setLevel(logging.INFO)
    started = time.monotonic()
    with ProcessPoolBuilder(args.slots) as builder:
        builder.warm(task.target.kind)
        while len(slots_warm.at) < builder.workers and time.monotonic() - started < SLOTS_WARM_LIMIT_S:
            time.sleep(0.01)  # a slot that cannot start says so in a warning instead
        warm = {"warm": len(slots_warm.at), "first_s": min(slots_warm.at, default=started) - started,
                "last_s": max(slots_warm.at, default=started) - started}
        figures["slots_warm"] = {"slots": builder.workers, **warm}
        print(f"{warm['warm']} of {builder.workers} build slots warm after {warm['last_s']:.2f} s (the first "
              f"after {warm['first_s']:.2f} s)", flush=True)
        builder.build(task, RandomSearch(task, shards[0], seed=10_000).propose(builder.workers))  # every slot warm
        print(f"{task} on {args.target}: first {args.per_shard} proposals of {args.shards} shard(s), "
              f"{builder.workers} build slots", flush=True)
        for seed in range(args.seeds):
            for name, search in SEARCHES.items():
                indices = [i for shard in shards for i in search(task, shard, seed).propose(args.per_shard)]
                run = first_batch(builder, task, indices)
                figures["runs"][name].append(run)
                print(f"  seed {seed}, {name}: build mean {run['build_mean_s']:.2f} s, p95 {run['build_p95_s']:.2f} s, "
                      f"max {run['build_max_s']:.2f} s; first built after {run['first_built_s']:.2f} s, all after "
                      f"{run['all_built_s']:.2f} s; {run['statuses']}", flush=True)
    figures["medians"] = {}
    for name, runs in figures["runs"].items():
        row = {}
        for key in ("build_mean_s", "build_p95_s", "build_max_s", "first_built_s", "all_built_s"):
            values = [r[key] for r in runs]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        figures["medians"][name] = row
        print(f"{name}, median over {args.seeds} seeds (min-max): " + ", ".join(
            f"{key[:-2].replace('_', ' ')} {v['median']:.2f} s ({v['min']:.2f}-{v['max']:.2f})"
            for key, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
