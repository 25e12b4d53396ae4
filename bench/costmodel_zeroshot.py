"""Zero-shot prediction: the family model's configs for shapes it was never trained on, measured,
against tuning those shapes.

    python bench/costmodel_zeroshot.py [--train-trials 48] [--tune-trials 64] [--top 5] [--target llvm]

Per family (matmul and conv2d; llvm on this machine's CPU, or cuda on its first GPU): the
training shapes are tuned one after another in one SQLite store (xgb, `--train-trials` each; as
on the farm, each starts from the family model the previous ones left). Then for every held-out
shape, never measured: `farm.predict.predict` picks `--top` configs from the family model alone
and they are measured (zero-shot: best of them); and the shape is tuned from scratch in a store
of its own (xgb, `--tune-trials`, no transfer): its best is the "tuned" latency. Ratio =
zero-shot / tuned (goal: <= 1.3). For scale, the best of `--top` random configs is shown too.
Measured as bench/costmodel_search.py measures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from costmodel_common import MemoDevice, fresh_store, machine, tune

from farm.core.search import RandomSearch
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import Workload, make_workload
from farm.predict import predict


def conv(ci: int, co: int, hw: int) -> Workload:
    return make_workload("conv2d_nchw", dict(N=1, CI=ci, CO=co, H=hw, W=hw, KH=3, KW=3, pad=1))


def matmul(m: int, n: int, k: int) -> Workload:
    return make_workload("matmul", dict(M=m, N=n, K=k))


FAMILIES = {
    "matmul": ([matmul(128, 128, 128), matmul(256, 128, 64), matmul(64, 256, 256), matmul(512, 64, 128)],
               [matmul(256, 256, 256), matmul(128, 512, 128)]),
    "conv2d": ([conv(32, 32, 28), conv(64, 64, 14), conv(128, 128, 7), conv(64, 128, 14)],
               [conv(128, 128, 14), conv(256, 256, 7)]),
}


def best_us(results: list) -> float:
    return min((r.latency for r in results if r.latency is not None), default=float("inf")) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--train-trials", type=int, default=48)
    parser.add_argument("--tune-trials", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-bench-costmodel"))
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    figures: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "shapes": []}
    target = parse_target(args.target)
    with MemoDevice(args.out / "logs", args.out / "measured.json", args.target) as device:
        for family in args.families:
            train_shapes, held_out = FAMILIES[family]
            store = fresh_store(args.out, f"zeroshot-{family}")
            start = time.perf_counter()
            for wl in train_shapes:
                tune(device, store, wl, "xgb", 0, args.train_trials, args.batch)
            print(f"{family}: trained on {len(train_shapes)} shapes x {args.train_trials} trials "
                  f"in {time.perf_counter() - start:.0f} s", flush=True)
            for wl in held_out:
                task = Task(wl, target)
                start = time.perf_counter()
                predicted = predict(wl, target, store, top=args.top)
                predict_seconds = time.perf_counter() - start
                measured = device.measure(task, [p.config_index for p in predicted])
                zero_shot, top1 = best_us(measured), best_us(measured[:1])
                random = best_us(device.measure(task, RandomSearch(task, task.space.shards(1)[0], 7).propose(args.top)))
                tuned = best_us(tune(device, fresh_store(args.out, f"zeroshot-tune-{family}"), wl, "xgb", 0,
                                     args.tune_trials, args.batch))
                row = {"family": family, "workload": str(wl), "predict_seconds": predict_seconds,
                       "zero_shot_us": zero_shot, "top1_us": top1, "tuned_us": tuned, "random_top_us": random,
                       "ratio": zero_shot / tuned, "top1_ratio": top1 / tuned}
                figures["shapes"].append(row)
                print(f"  {wl}: zero-shot best of {args.top} {zero_shot:.1f} µs, top-1 {top1:.1f} µs "
                      f"(predict {predict_seconds:.2f} s); tuned ({args.tune_trials} trials) {tuned:.1f} µs; "
                      f"ratio {zero_shot / tuned:.2f} (top-1 {top1 / tuned:.2f}); best of {args.top} random "
                      f"{random:.1f} µs", flush=True)
    for key in ("ratio", "top1_ratio"):
        ratios = [r[key] for r in figures["shapes"]]
        print(f"{'best of top' if key == 'ratio' else 'top-1'} / tuned: median {np.median(ratios):.2f}, "
              f"worst {max(ratios):.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
