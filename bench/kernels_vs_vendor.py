"""The farm's tuned kernels against PyTorch's (cuDNN / cuBLAS) on this GPU, medians over seeds.

    python bench/kernels_vs_vendor.py --case resnet-last-conv --case "matmul M=1024 N=1024 K=1024" \
        [--trials 512] [--seeds 3] [--target TARGET] [--out DIR] [--json FILE] [--retime]
        [--config LABEL=JSON ...]

For each case and seed, `farm tune CASE --target TARGET --trials N --seed S` (TARGET: cuda, i.e.
sm_90, unless given, e.g. '{"kind": "cuda", "arch": "sm_90a"}' for Hopper's wgmma) runs as a user runs it
(a process of its own on the embedded defaults, timed whole), exporting its best config. Then,
in one process, each seed's best kernel is rebuilt from its export (`farm.build`), checked
against PyTorch's output, and timed side by side with PyTorch by one method: `LAUNCHES` back-to-
back calls captured in a CUDA graph (the TVM kernels launched on PyTorch's stream through
`tvm_ffi.use_torch_stream`), the graph replayed `REPLAYS` times, in `ROUNDS` rounds that
alternate between the kernels; a kernel's figure is the median over all its replays of replay
time / launches, with the 10th-90th percentile spread. TF32 is off: the fp32 kernels compute
in fp32. Pooling cases also time a device-to-device copy of their input the same way (the
device's copy bandwidth, read + write) and give each kernel's share of it.

Prints one line per case (PyTorch, the farm's median over seeds and its range, the ratio) and,
with --json, every figure. --retime times the exports of an earlier run in --out again
(--allow-stale: built by the current version of their template);
--tvm-compile adds each kernel as TVM's default compile makes it (NVRTC, fast math) beside the
farm's build of it (nvcc -O3, as the farm measured it). --config times a config named by hand
(say, the structure a vendor kernel's profile shows) beside the seeds' kernels, checked and timed
the same way: whether the space holds a faster kernel than the search found.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_common import farm_curve, farm_tune
from torch_baseline import graph_times, torch_op, vendor_precision

from farm.core.errors import FarmError
from farm.core.space import Config
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import Workload, make_workload

ROUNDS = 3


def case_name(case: str) -> str:
    """A file-name-safe name for a case ("matmul M=1024 N=1024 K=1024" -> "matmul-M1024-N1024-K1024")."""
    return "-".join(word.replace("=", "") for word in case.split())


def parse_case(case: str) -> tuple[str, list[str], Workload]:
    """A case as `farm tune` takes it: a preset or workload name, then key=value parameters."""
    name, *params = case.split()
    if bad := [p for p in params if "=" not in p]:
        raise FarmError(f"{case!r}: parameters are key=value, got {bad[0]!r}")
    return name, params, make_workload(name, dict(p.split("=", 1) for p in params) or None)


def parse_config(wl: Workload, target: str, label: str, text: str) -> Config:
    """`text` (a JSON object of knob values) as a config of `wl`'s template for `target`."""
    if not label or not text:
        raise FarmError(f"{label}={text}: give LABEL=JSON")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise FarmError(f"{label}: not JSON ({e})") from None
    task = Task(wl, parse_target(target))
    config = task.space.from_json(values)
    if reason := task.check(config):
        raise FarmError(f"{label}: not a valid config of {task.template.name}: {reason}")
    return config


def tvm_call(lib: Any, args: list[Any]) -> Callable[[], None]:
    """A closure launching the TVM kernel on PyTorch's current stream (so a graph captures it)."""
    import tvm_ffi

    main = lib["main"]

    def call() -> None:
        with tvm_ffi.use_torch_stream():
            main(*args)
    return call


def time_side_by_side(fns: dict[str, Callable[[], Any]]) -> dict[str, dict[str, float]]:
    """Each closure timed by `graph_times`, rounds alternating; µs median and 10th/90th percentile."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):  # alternate, so drifting clocks or a busy neighbour hit all alike
        for name, fn in fns.items():
            runs[name] += graph_times(fn)
    out = {}
    for name, seconds in runs.items():
        us = np.array(seconds) * 1e6
        out[name] = {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
                     "p90_us": float(np.percentile(us, 90)), "replays": len(us)}
    return out


def tvm_default_build(wl: Workload, target: str, export: Path) -> Any:
    """The export's kernel as TVM compiles it by default (NVRTC, fast math), not as the farm
    measured it (`farm.build`'s nvcc): the comparison behind `workers.compiler.compile_module`."""

    from farm.apply import best_config
    from farm.core.targets import parse_target
    from farm.core.task import Task
    from farm.core.templates.base import compile_scheduled

    task = Task(wl, parse_target(target))
    config = best_config(task, export)
    assert config is not None, f"{export} holds no config for {wl}"
    return compile_scheduled(task.schedule(config).mod, task.target)


def retime_case(wl: Workload, target: str, exports: dict[str, Path], tvm_compile: bool = False,
                allow_stale: bool = False, configs: dict[str, Config] | None = None) -> dict[str, Any]:
    """PyTorch and each export's best kernel for `wl`: checked against PyTorch's output, timed.
    With `tvm_compile`, each kernel also as TVM's default compile makes it (label + "-tvm"); with
    `allow_stale`, exports of an older version of their template are built by the current one;
    `configs` (label -> config of the case's template) are built as the farm builds a candidate."""
    import torch

    from farm.apply import build
    from workers.compiler import compile_module

    expected = torch_op(wl)()
    inputs = [torch.from_numpy(x).to("cuda") for x in wl.random_inputs(0)]  # torch_op's inputs
    fns: dict[str, Callable[[], Any]] = {"pytorch": torch_op(wl)}
    errors: dict[str, float] = {}
    builds = {label: (lambda e=export: build(wl, target, e, allow_stale=allow_stale))
              for label, export in exports.items()}
    if tvm_compile:
        builds |= {f"{label}-tvm": (lambda e=export: tvm_default_build(wl, target, e))
                   for label, export in exports.items()}
    task = Task(wl, parse_target(target))
    builds |= {label: (lambda c=config: compile_module(task.schedule(c).mod, task.target))
               for label, config in (configs or {}).items()}
    for label, make in builds.items():
        out = torch.full(wl.output_shape(), float("nan"), dtype=getattr(torch, wl.dtype), device="cuda")
        call = tvm_call(make(), [*inputs, out])
        call()
        torch.cuda.synchronize()
        diff = (out.double() - expected.double()).norm() / expected.double().norm()
        errors[label] = float(diff)
        fns[label] = call
    if wl.name == "pool2d":
        source = inputs[0]
        copy = torch.empty_like(source)
        fns["copy"] = lambda: copy.copy_(source)
    timing = time_side_by_side(fns)
    for label, error in errors.items():
        timing[label].update(rel_l2_error_vs_pytorch=error, correct=bool(error <= wl.tolerance()))
    if "copy" in timing:
        moved = 2 * inputs[0].numel() * inputs[0].element_size()
        copy_bw = moved / (timing["copy"]["median_us"] * 1e-6)
        timing["copy"]["bandwidth_gbs"] = copy_bw / 1e9
        for label in ["pytorch", *exports]:
            bw = wl.bytes() / (timing[label]["median_us"] * 1e-6)
            timing[label].update(bandwidth_gbs=bw / 1e9, share_of_copy_bandwidth=bw / copy_bw)
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True,
                        help='a preset or "workload key=value ..." (repeat for more cases)')
    parser.add_argument("--trials", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--search", default="xgb")
    parser.add_argument("--target", default="cuda", help="farm tune's --target (default: cuda, i.e. sm_90)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-kernels"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--retime", action="store_true", help="only time the exports of an earlier run in --out")
    parser.add_argument("--tvm-compile", action="store_true",
                        help="also time each kernel as TVM's default compile makes it (NVRTC, fast math)")
    parser.add_argument("--allow-stale", action="store_true",
                        help="with --retime: build exports tuned against an older version of their template "
                             "with the current one (a fix that changed the generated code, not the space)")
    parser.add_argument("--config", action="append", default=[], metavar="LABEL=JSON",
                        help="a config of the case's template (JSON, as in an export), timed beside the seeds' "
                             "kernels under LABEL; one --case only")
    args = parser.parse_args()
    try:
        cases = [parse_case(case) for case in args.case]  # bad cases fail here, before any tuning
    except FarmError as e:
        parser.error(f"bad --case: {e}")
    if args.config and len(cases) != 1:
        parser.error("--config needs exactly one --case (a config belongs to one workload's space)")
    try:
        configs = {label: parse_config(cases[0][2], args.target, label, text)
                   for label, _, text in (c.partition("=") for c in args.config)}
    except FarmError as e:
        parser.error(f"bad --config: {e}")
    import torch

    vendor_precision(torch)
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cudnn": torch.backends.cudnn.version(), "trials": args.trials,
                               "search": args.search, "target": args.target, "command": " ".join(sys.argv), "cases": {}}
    # Every case tuned first, then every case timed: a timing problem loses no tuning (--retime).
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for case, (name, params, wl) in zip(args.case, cases, strict=True):
        runs[case] = {}
        for seed in range(args.seeds):
            label = f"{case_name(case)}-seed{seed}"
            runs[case][label] = {}
            if args.retime:
                continue
            print(f"{wl}: farm tune, {args.trials} trials, seed {seed}", flush=True)
            wall, db = farm_tune(name, params, args.target, args.trials, args.search, seed, args.out, label)
            curve, statuses = farm_curve(db)
            runs[case][label] = {"wall_s": wall, "statuses": statuses, "best_measured_us": float(np.nanmin(curve))}
            print(f"  {wall:.0f} s, best measured {runs[case][label]['best_measured_us']:.2f} µs, {statuses}",
                  flush=True)
    for case, (_, _, wl) in zip(args.case, cases, strict=True):
        seeds = runs[case]
        exports = {label: args.out / f"{label}-best.json" for label in seeds}
        timing = retime_case(wl, args.target, exports, args.tvm_compile, args.allow_stale, configs)
        farm_us = [timing[label]["median_us"] for label in seeds]
        row = {"workload": wl.to_json(), "pytorch": timing["pytorch"], "copy": timing.get("copy"),
               "seeds": {label: {**seeds[label], **timing[label]} for label in seeds},
               "configs": {label: {"config": config.to_json(), **timing[label]} for label, config in configs.items()},
               "tvm_compile": {label: timing[f"{label}-tvm"] for label in seeds if f"{label}-tvm" in timing},
               "farm_median_us": statistics.median(farm_us), "farm_min_us": min(farm_us), "farm_max_us": max(farm_us),
               "all_correct": all(timing[label]["correct"] for label in seeds)}
        row["speedup_vs_pytorch"] = timing["pytorch"]["median_us"] / row["farm_median_us"]
        figures["cases"][case] = row
        extra = ""
        if row["copy"]:
            shares = [timing[label]["share_of_copy_bandwidth"] for label in seeds]
            extra = (f"; copy {row['copy']['bandwidth_gbs']:.0f} GB/s, farm {statistics.median(shares):.0%} of it "
                     f"(PyTorch {timing['pytorch']['share_of_copy_bandwidth']:.0%})")
        print(f"{case}: PyTorch {timing['pytorch']['median_us']:.2f} µs; farm median {row['farm_median_us']:.2f} µs "
              f"over {len(farm_us)} seeds ({row['farm_min_us']:.2f}-{row['farm_max_us']:.2f}); "
              f"{row['speedup_vs_pytorch']:.2f}x PyTorch's speed; all correct: {row['all_correct']}{extra}", flush=True)
        for label in configs:
            t = timing[label]
            print(f"  config {label}: {t['median_us']:.2f} µs ({t['p10_us']:.2f}-{t['p90_us']:.2f}), "
                  f"{timing['pytorch']['median_us'] / t['median_us']:.2f}x PyTorch's speed; correct: {t['correct']}",
                  flush=True)
        if args.json:  # after every case, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(figures, indent=1))

if __name__ == "__main__":
    main()
