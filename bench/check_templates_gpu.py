"""Every cuda template, run on this machine's GPU: a random sample of each space against NumPy.

    python bench/check_templates_gpu.py [--trials-per-case 32] [--target TARGET] [--case CASE ...] [--out DIR]

The test suite compiles and verifies the cuda templates where no GPU is; this runs them. One
job on the embedded client (random search, the product's own path: every candidate built, run
and its output compared with the NumPy reference) over every preset and the shapes the presets miss
(tests/test_templates.py's CUDA_CASES). Random search samples every class of config (split-K
or not, each way of fetching tiles, each unrolling). Prints each case's trial statuses and
exits 1 if any candidate computed a wrong result (the template is wrong there), 0 otherwise;
other failures (build errors, invalid configs, runtime errors) are listed once per distinct error.
The target decides some templates: '{"kind": "cuda", "arch": "sm_90a"}' runs the float16
matmuls whose sizes are multiples of 64 on Hopper's wgmma (cuda.wgmma) instead of WMMA. --case
(a preset or "workload key=value ...", repeatable) checks only those cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kernels_vs_vendor import parse_case

from db.store import open_store
from farm.client import Client
from farm.core.errors import FarmError
from farm.core.workloads import PRESETS, workload_from_json

# The shapes tests/test_templates.py compiles beyond the presets: a matmul of the size,
# stride and multiplier for depthwise, sizes that no thread count divides for pooling; float16
# matmul, conv2d and grouped conv on tensor cores (the conv2d's with padding, stride 2, a 1x1 kernel) and, with
# sizes that are not multiples of 16, on CUDA cores; float16 depthwise and average pooling (fp32
# accumulators, cast in the epilogue); a batch matmul of BERT-base's attention scores, and one of odd sizes.
EXTRA_CASES = [
    ("matmul", dict(M=1024, N=1024, K=1024)),
    ("matmul", dict(M=256, N=128, K=64, dtype="float16")),
    ("matmul", dict(M=512, N=256, K=512, dtype="float16")),  # 8 reduction tiles: wgmma's pipelines on sm_90a
    ("conv2d_nchw", dict(N=2, CI=16, H=8, W=8, CO=32, KH=3, KW=3, pad=1, dtype="float16")),
    ("conv2d_nchw", dict(N=4, CI=32, H=16, W=16, CO=16, KH=3, KW=3, stride=2, pad=1, dtype="float16")),
    ("conv2d_nchw", dict(N=2, CI=32, H=12, W=12, CO=32, KH=1, KW=1, dtype="float16")),
    ("group_conv2d_nchw", dict(N=2, CI=64, H=8, W=8, CO=64, KH=3, KW=3, groups=2, pad=1, dtype="float16")),
    ("matmul", dict(M=33, N=17, K=20, dtype="float16")),
    ("depthwise_conv2d_nchw", dict(N=2, C=8, H=15, W=17, KH=3, KW=3, stride=2, pad=1, dtype="float16")),
    ("pool2d", dict(N=2, C=3, H=15, W=17, KH=3, KW=3, stride=2, pad=1, kind="avg", dtype="float16")),
    ("depthwise_conv2d_nchw", dict(N=2, C=8, H=15, W=17, KH=3, KW=3, stride=2, pad=1, multiplier=2)),
    ("pool2d", dict(N=2, C=3, H=15, W=17, KH=3, KW=3, stride=2, pad=1, kind="avg")),
    ("batch_matmul", dict(B=12, M=128, N=128, K=64)),
    ("batch_matmul", dict(B=3, M=33, N=17, K=20)),
]


def shared_values(configs: list[dict[str, Any]]) -> str:
    """The knob values every one of `configs` has, as "knob=value, ...": what a group of failures
    has in common, the first suspect for their cause ("" for one config or none shared)."""
    if len(configs) < 2:
        return ""
    common = {k: v for k, v in configs[0].items() if all(c.get(k) == v for c in configs[1:])}
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(common.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials-per-case", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-check-templates"))
    parser.add_argument("--target", default="cuda", help="llvm checks this script itself where no GPU is")
    parser.add_argument("--case", action="append", help='only this case: a preset or "workload key=value ..."')
    args = parser.parse_args()
    try:  # bad cases fail here, before any job
        only = [parse_case(case)[2] for case in args.case or []]
    except FarmError as e:
        parser.error(f"bad --case: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.out / "check.db"
    db.unlink(missing_ok=True)
    cases = [(wl.name, wl.p) for wl in only] or [*PRESETS, *EXTRA_CASES]
    start = time.perf_counter()
    with Client(f"sqlite:///{db}", in_process=True) as client:
        job = client.submit(cases, args.target, args.trials_per_case * len(cases), search="random")
        status = job.wait()
    seconds = time.perf_counter() - start
    store = open_store(f"sqlite:///{db}")
    trials = store.trials(job_id=job.id)
    wrong = 0
    for task in store.tasks(job.id):
        mine = trials[trials["task_id"] == task["id"]]
        counts = Counter(mine["status"])
        wrong += counts["wrong_result"]
        fastest = mine["latency"].min() * 1e6 if counts["ok"] else float("nan")
        print(f"{workload_from_json(task['workload'])}: {dict(counts)}, fastest {fastest:.2f} µs")
        wrongs = mine[mine["status"] == "wrong_result"]
        for _, row in wrongs.iterrows():
            print(f"  wrong result: {row['config']} {row['error']}")
        if common := shared_values(list(wrongs["config"])):
            print(f"  every wrong result has {common}")
        # Other failures are data, but a template that often fails to build or run wastes trials:
        # each distinct error once, with its count, one config that hit it and what all of them share.
        failed = mine[~mine["status"].isin(["ok", "wrong_result"])]
        for (outcome, error), rows in failed.groupby(["status", failed["error"].fillna("").str[:160]]):
            common = shared_values(list(rows["config"]))
            print(f"  {outcome} x{len(rows)}: {error} (e.g. {rows.iloc[0]['config']}"
                  + (f"; all have {common})" if common else ")"))
    print(f"job {status}: {len(trials)} candidates in {seconds:.0f} s; {wrong} wrong result(s)")
    sys.exit(1 if wrong or status != "done" else 0)


if __name__ == "__main__":
    main()
