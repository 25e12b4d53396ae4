"""PyTorch / cuDNN latency of the farm's workloads on this machine's GPU (the vendor baseline).

    python bench/torch_baseline.py resnet-last-conv [seed-depthwise ...] [--json OUT]

Each kernel is captured in a CUDA graph of `--launches` back-to-back calls and the graph is
replayed; the figure is the median over replays of (replay time / launches), so launch
overhead does not count (small kernels measure 8-10 µs in an eager loop on an H100 while
their GPU time is 2-5 µs). TF32 is off: the farm's float32 kernels compute in float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from farm.core.workloads import PRESETS, Workload, make_workload


def torch_op(wl: Workload) -> Callable[[], Any]:
    """A closure computing the workload with torch on cuda, and its inputs."""
    import torch
    import torch.nn.functional as F

    p = wl.p
    dt = getattr(torch, wl.dtype)
    xs = [torch.from_numpy(x).to("cuda", dt) for x in wl.random_inputs(0)]
    if wl.name == "conv2d_nchw":
        return lambda: F.conv2d(xs[0], xs[1], stride=p["stride"], padding=p["pad"], dilation=p["dilation"])
    if wl.name == "depthwise_conv2d_nchw":
        w = xs[1].reshape(p["C"] * p["multiplier"], 1, p["KH"], p["KW"])
        return lambda: F.conv2d(xs[0], w, stride=p["stride"], padding=p["pad"], groups=p["C"])
    if wl.name == "group_conv2d_nchw":
        return lambda: F.conv2d(xs[0], xs[1], stride=p["stride"], padding=p["pad"], groups=p["groups"])
    if wl.name == "pool2d":
        k, s, pad = (p["KH"], p["KW"]), p["stride"], p["pad"]
        if p["kind"] == "max":
            return lambda: F.max_pool2d(xs[0], k, s, pad)
        return lambda: F.avg_pool2d(xs[0], k, s, pad, count_include_pad=True)
    if wl.name in ("matmul", "batch_matmul"):
        return lambda: xs[0] @ xs[1]  # torch.bmm for a batch
    raise ValueError(wl.name)


def graph_times(fn: Callable[[], Any], launches: int = 20, replays: int = 50) -> list[float]:
    """Seconds per call of `fn`, one figure per replay of a CUDA graph of `launches` calls."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm up: cuDNN picks its algorithm, handles are created
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    return times


def vendor_precision(torch: Any) -> None:
    """PyTorch computes as the farm's kernels do: fp32 in fp32 (no TF32), fp16 products summed in
    fp32 (no reduced-precision reductions in cuBLAS), with cuDNN's autotuner on."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.benchmark = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    import torch

    vendor_precision(torch)
    rows = []
    for name in args.presets:
        wl = make_workload(name)
        seconds = statistics.median(graph_times(torch_op(wl)))
        rows.append({"preset": name, "workload": wl.to_json(), "latency_us": seconds * 1e6,
                     "gflops": wl.flops() / seconds / 1e9, "device": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()})
        print(f"{name:18s} {seconds * 1e6:9.2f} µs  {rows[-1]['gflops']:8.1f} GFLOPS  ({rows[-1]['device']})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
