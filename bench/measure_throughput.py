"""Measurement throughput of one device: the farm's runner versus stock MetaSchedule's RPCRunner.

    python bench/measure_throughput.py --target cuda --preset resnet-last-conv --candidates 32

Both measure the same built candidates through the same tracker and the same RPC server
(the farm's, which is TVM's server plus a cubin cache) with the same EvaluatorConfig
(number=10, repeat=3, min_repeat_ms=50 unless given). Stock MetaSchedule opens a session per
candidate and lets the GPU node compile the CUDA source at load time; the farm keeps one
session open, ships the cubin compiled on the build node, and also checks every output
against the NumPy reference. Prints candidates per second for each and their ratio (the farm's one session open is timed
apart: a tuning run opens one per session timeout, 120 s); the farm is also timed with its
screening of slow kernels (timed once when over 10x the best so far), as tuning runs use it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from farm.core.measure import MeasureResult, Status
from farm.core.search import RandomSearch
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from workers.builder import ProcessPoolBuilder
from workers.compiler import BuildResult
from workers.rpc_processes import LocalTracker, ServerProcess, wait_for_keys
from workers.runner import EvaluatorConfig, RPCRunner


def stock_metaschedule(task: Task, builds: list[BuildResult], tracker: tuple[str, int], key: str,
                       ev: EvaluatorConfig) -> tuple[float, list[float | None]]:
    """Seconds to measure `builds` with ms.runner.RPCRunner, and each candidate's mean latency."""
    from tvm.s_tir import meta_schedule as ms

    runner = ms.runner.RPCRunner(
        rpc_config=ms.runner.RPCConfig(tracker_host=tracker[0], tracker_port=tracker[1], tracker_key=key,
                                       session_priority=1, session_timeout_sec=120),
        evaluator_config=ms.runner.EvaluatorConfig(number=ev.number, repeat=ev.repeat,
                                                   min_repeat_ms=ev.min_repeat_ms),
    )
    wl = task.workload
    args = [ms.arg_info.TensorInfo(wl.dtype, list(s)) for s in [*wl.input_shapes(), wl.output_shape()]]
    device = "cuda" if task.target.is_gpu else "cpu"
    inputs = [ms.runner.RunnerInput(b.library, device, args) for b in builds]
    start = time.perf_counter()
    results = [f.result() for f in runner.run(inputs)]
    seconds = time.perf_counter() - start
    latencies = [statistics.fmean(float(x) for x in r.run_secs) if r.run_secs else None for r in results]
    return seconds, latencies


def farm_runner(task: Task, builds: list[BuildResult], tracker: tuple[str, int], server: ServerProcess,
                ev: EvaluatorConfig, screen: float | None) -> tuple[list[MeasureResult], float, int]:
    """The farm's results, seconds and sessions opened; `screen` as RPCRunner's screen_factor."""
    runner = RPCRunner(tracker, server.key, task.target.kind, ev, timeout=60, on_hang=server.kill_sessions,
                       screen_factor=screen)
    # Opening the session (a spawned process on a GPU server) happens once per session_timeout
    # in a tuning run, not once per batch of candidates: time it apart.
    start = time.perf_counter()
    runner.session()
    print(f"farm runner (screen {screen}): session opened in {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    results, phases = [], []
    for build in builds:
        results.append(runner.measure_one(task, build))
        phases.append(dict(runner.phases))
    seconds = time.perf_counter() - start
    steps = {k for p in phases for k in p}
    print(f"farm runner (screen {screen}) median ms per step: " + ", ".join(
        f"{k} {statistics.median(p.get(k, 0.0) for p in phases) * 1e3:.1f}" for k in sorted(steps)))
    runner.close()  # the server serves one session at a time
    return results, seconds, runner.sessions_opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--preset", default="resnet-last-conv")
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--number", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--min-repeat-ms", type=int, default=50)
    parser.add_argument("--indices", type=Path,
                        help="JSON list of config indices to measure (e.g. a finished job's fastest), "
                        "instead of --candidates random ones")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    task = Task(make_workload(args.preset), parse_target(args.target))
    ev = EvaluatorConfig(args.number, args.repeat, args.min_repeat_ms)
    if args.indices:
        indices = [int(i) for i in json.loads(args.indices.read_text())]
    else:
        indices = RandomSearch(task, task.space.shards(1)[0], seed=1).propose(args.candidates)
    logs = Path(tempfile.mkdtemp(prefix="farm-bench-"))
    with ProcessPoolBuilder() as builder, LocalTracker(log=logs / "tracker.log") as tracker:
        start = time.perf_counter()
        builds = [b for b in builder.build(task, indices) if b.ok]
        build_seconds = time.perf_counter() - start
        print(f"built {len(builds)}/{len(indices)} candidates of {task} in {build_seconds:.1f} s "
              f"({builder.workers} processes)")
        server = ServerProcess(tracker.address, "bench-device", task.target.kind,
                               "0" if task.target.is_gpu else None, log=logs / "server.log")
        try:
            wait_for_keys(tracker.address, [server.key], 120, [server.proc])
            farm, farm_seconds, sessions = farm_runner(task, builds, tracker.address, server, ev, screen=None)
            screened, screened_seconds, _ = farm_runner(task, builds, tracker.address, server, ev, screen=10.0)
            stock_seconds, stock = stock_metaschedule(task, builds, tracker.address, server.key, ev)
        finally:
            server.stop()

    ok = [r for r in farm if r.status is Status.OK]
    pairs = [(statistics.fmean(r.latencies), s) for r, s in zip(farm, stock, strict=True) if r.ok and s]
    agreement = statistics.median(abs(a - b) / b for a, b in pairs) if pairs else float("nan")
    figures: dict[str, Any] = {
        "task": str(task), "device": ok[0].device if ok else "", "candidates": len(builds),
        "evaluator": {"number": ev.number, "repeat": ev.repeat, "min_repeat_ms": ev.min_repeat_ms},
        "build_seconds": build_seconds,
        "farm_seconds": farm_seconds, "farm_per_candidate": farm_seconds / max(1, len(builds)),
        "farm_ok": len(ok), "farm_sessions": sessions,
        "farm_screened_seconds": screened_seconds,
        "farm_screened_timed_once": sum(len(r.latencies) == 1 for r in screened),
        "stock_seconds": stock_seconds, "stock_per_candidate": stock_seconds / max(1, len(builds)),
        "stock_ok": sum(s is not None for s in stock),
        "speedup": stock_seconds / farm_seconds if farm_seconds else float("nan"),
        "speedup_screened": stock_seconds / screened_seconds if screened_seconds else float("nan"),
        "median_latency_disagreement": agreement,
        "latencies_us": [r.latency * 1e6 if r.latency else None for r in farm],
    }
    print(f"device: {figures['device']}")
    print(f"farm runner:  {farm_seconds:7.1f} s  {figures['farm_per_candidate']:.3f} s/candidate  "
          f"({len(ok)} ok, {sessions} session(s), outputs checked)")
    print(f"stock RPCRunner: {stock_seconds:7.1f} s  {figures['stock_per_candidate']:.3f} s/candidate  "
          f"({figures['stock_ok']} ok)")
    print(f"farm runner, slow kernels timed once: {screened_seconds:7.1f} s "
          f"({figures['farm_screened_timed_once']} of {len(builds)} over 10x the best so far)")
    print(f"speedup: {figures['speedup']:.1f}x candidates per second ({figures['speedup_screened']:.1f}x with "
          f"screening); median latency disagreement {agreement * 100:.1f}%")
    kernel = sum(x for x in figures["latencies_us"] if x) / 1e6
    print(f"kernel time per candidate (median latency, one run): {kernel / max(1, len(builds)) * 1e3:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
