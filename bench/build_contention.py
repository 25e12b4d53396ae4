"""Whether the farm's own builds disturb its measurements: a `farm tune` job's latencies, measured
while the node's build slots compile the next candidates, against the same configs measured again
one at a time with nothing else building.

    python bench/build_contention.py [--workload matmul] [--params M=256 N=256 K=256] [--target llvm]
                                     [--trials 48] [--seed 0] [--out DIR] [--json FILE]

The job is `python -m farm tune --search random` on the embedded defaults (its build slots, one per
core, and its measurements pipelined as in any job). Then the configs it measured correctly are
measured again through the farm's own device (workers.device.LocalDevice: its Builder and RPC
runner, the target's evaluator settings), one config per call, so each is built first and timed
with no build running. Prints the ratio of the job's latency to the quiet one per config: its
median, 10th and 90th percentiles, and how many are off by more than a tenth either way; with
--json, every pair. On llvm the kernels run on the cores the builds use; on cuda only the kernel
launches do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from costmodel_common import add_workload_arguments, farm_tune

from db.store import open_store
from farm.core.jobspec import JobRequest
from farm.core.workloads import make_workload
from workers.device import LocalDevice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser, target="llvm")
    # matmul 256^3 (sized for a CPU) when nothing is named; another workload keeps its own defaults.
    parser.set_defaults(workload="matmul", params=None)
    parser.add_argument("--trials", type=int, default=48, help="trials of the job")
    parser.add_argument("--seed", type=int, default=0, help="seed of its random search")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-build-contention"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.params is None:
        args.params = ["M=256", "N=256", "K=256"] if args.workload == "matmul" else []
    workload = make_workload(args.workload, dict(p.split("=", 1) for p in args.params) or None)
    (task,) = JobRequest.build([workload], args.target, 1).tasks
    args.out.mkdir(parents=True, exist_ok=True)
    seconds, db = farm_tune(args.workload, args.params, args.target, args.trials, "random", args.seed, args.out, "job")
    store = open_store(f"sqlite:///{db}")
    trials = store.trials(job_id=store.jobs(limit=1)[0]["id"])
    ok = trials[trials["status"] == "ok"]
    print(f"{workload} on {args.target}: {len(trials)} trials in {seconds:.0f} s, {len(ok)} ok; measuring those "
          "again one at a time", flush=True)
    pairs = []
    device = LocalDevice(args.target, "quiet", gpu="0", log_dir=args.out / "logs-quiet")
    device.start()
    try:
        for index, latency in zip(ok["config_index"], ok["latency"], strict=True):
            (result,) = device.build_and_measure(task, [int(index)])
            if result.latency is not None:
                pairs.append((int(index), float(latency) * 1e6, result.latency * 1e6))
    finally:
        device.close()
    ratio = np.array([job / quiet for _, job, quiet in pairs])
    p10, median, p90 = np.percentile(ratio, [10, 50, 90])
    slower, faster = int((ratio > 1.10).sum()), int((ratio < 1 / 1.10).sum())
    print(f"job / quiet latency over {len(pairs)} configs: median {median:.3f} (p10 {p10:.3f}, p90 {p90:.3f}); "
          f"{slower} more than a tenth slower in the job, {faster} more than a tenth faster")
    best_job = min(pairs, key=lambda p: p[1])
    best_quiet = min(pairs, key=lambda p: p[2])
    print(f"the job's best: config {best_job[0]} at {best_job[1]:.2f} µs ({best_job[2]:.2f} quiet); the quiet "
          f"best: config {best_quiet[0]} at {best_quiet[2]:.2f} µs ({best_quiet[1]:.2f} in the job)")
    if args.json:
        args.json.write_text(json.dumps({
            "workload": str(workload), "target": args.target, "trials": args.trials, "seed": args.seed,
            "job_seconds": seconds, "median_ratio": median, "p10_ratio": p10, "p90_ratio": p90,
            "slower_by_a_tenth": slower, "faster_by_a_tenth": faster,
            "pairs": [{"config_index": i, "job_us": j, "quiet_us": q} for i, j, q in pairs]}, indent=1))


if __name__ == "__main__":
    main()
