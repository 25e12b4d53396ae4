"""What the farm's metrics cost per trial on the hot path, against what a trial takes.

    python bench/metrics_cost.py [--calls 200000] [--repeats 5] [--trial-ms 379]

Times the helpers of farm.core.metrics that run once or a few times per candidate (the worker's
`observe_trial` with every step, `add_build_backlog` twice, the scheduler's `set_worker_queue` and
`set_task_progress`), `--calls` times each, `--repeats` times, while the registry is served on
a loopback port and scraped once a second (as Prometheus would). Printed: each helper's median
microseconds per call (min–max over repeats), the sum per trial, and that sum as a share of
`--trial-ms` (default: 379 ms, one trial of 500 on one H200, 2.64 trials/s,
docs/benchmarks/e2e-throughput-2026-11-23.md).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable

from farm.core import metrics


def per_call_us(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trial-ms", type=float, default=379.0)
    args = parser.parse_args()
    port = metrics.serve(0)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    # (helper, calls of it per trial)
    helpers: dict[str, tuple[Callable[[], None], int]] = {
        "observe_trial": (lambda: metrics.observe_trial("cuda-worker-0", "ok", "cuda", 2.4, 0.004, 0.3, 0.002), 1),
        "add_build_backlog": (lambda: metrics.add_build_backlog("cuda-worker-0", -1), 2),
        "set_worker_queue": (lambda: metrics.set_worker_queue("cuda-worker-0", 4, 28), 1),
        "set_task_progress": (lambda: metrics.set_task_progress(1, 1, 250, 500), 1),
    }
    per_trial = 0.0
    for name, (call, per) in helpers.items():
        runs = [per_call_us(call, args.calls) for _ in range(args.repeats)]
        per_trial += statistics.median(runs) * per
        print(f"{name}: {statistics.median(runs):.2f} µs per call (min {min(runs):.2f}, max {max(runs):.2f}), "
              f"{per} per trial")
    stop.set()
    print(f"per trial: {per_trial:.1f} µs = {per_trial / (args.trial_ms * 1e3):.5%} of a {args.trial_ms:.0f} ms trial")


if __name__ == "__main__":
    main()
