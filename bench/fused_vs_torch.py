"""Fused model kernels (conv2d + bias + ReLU, linear + GELU) tuned with the farm's hand template and
with the kernel's design space, against PyTorch eager and `torch.compile`, on one GPU.

    python bench/fused_vs_torch.py [--case conv --case dense] [--trials 256] [--seeds 0 1 2]
                                   [--target cuda] [--out DIR] [--json FILE]

Each case is a PyTorch module (random weights, seed 0) and its input. It is exported
(`torch.export`), imported into Relax, legalized and fused as Relax's pipeline does, and the task
MetaSchedule would extract for the fused operator is written as TVMScript (OUT/CASE.py): the kernel a
model hands the farm. Per seed, `farm tune OUT/CASE.py --templates all --trials N` runs as a user
runs it (a process of its own, timed whole): one task with the operator's hand template, whose
elementwise stages fold into its write-back (farm/core/fused.py), one with the design space, the
budget split between them. Then, in one process, each template's best kernel of each seed is rebuilt
as the farm measured it, fed the module's own weights, checked against the module's output, and timed
side by side with the module in PyTorch eager and compiled (`torch.compile`, default mode) by one
method (bench/kernels_vs_vendor.time_side_by_side: CUDA-graph replays, TF32 off). Prints one line per
case with the medians over seeds, and with --json every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel_common import farm_tune, machine, spread
from kernels_vs_vendor import time_side_by_side, tvm_call
from torch_baseline import vendor_precision

from db.store import open_store
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.tir import TirWorkload, tir_from_file


@dataclass(frozen=True)
class Case:
    """A module, its input's shape, and how its weights become the fused kernel's inputs."""

    make: Callable[[Any], Any]  # torch.nn -> module
    input_shape: tuple[int, ...]
    kernel_inputs: Callable[[Any, Any], list[Any]]  # (module, input) -> the kernel's inputs, in order


CASES = {
    # ResNet-50's 3x3 convolution of its first stage, bias and ReLU (as a layer without batch norm).
    "conv": Case(lambda nn: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()), (1, 64, 56, 56),
                 lambda m, x: [x, m[0].weight, m[0].bias.reshape(1, -1, 1, 1)]),
    # BERT-base's first feed-forward layer, with GELU.
    "dense": Case(lambda nn: nn.Sequential(nn.Linear(768, 3072), nn.GELU()), (128, 768),
                  lambda m, x: [x, m[0].weight.T.contiguous(), m[0].bias]),
}


def fused_kernel(module: Any, x: Any) -> Any:
    """The PrimFunc of the fused operator Relax makes of `module` (the task the farm recognises)."""
    import torch
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program
    from tvm.s_tir import meta_schedule as ms

    from farm.core.fused import match_operator
    from farm.core.tir import tir_workload

    mod = from_exported_program(torch.export.export(module, (x,)), keep_params_as_input=True)
    mod, _ = relax.frontend.detach_params(mod)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    mod = tvm.transform.Sequential(passes)(mod)
    for task in ms.relax_integration.extract_tasks(mod, tvm.target.Target("llvm")):
        func = task.dispatched[0]["main"]
        if match_operator(tir_workload(func, task.task_name)) is not None:
            return func.with_attr("global_symbol", task.task_name)
    raise SystemExit("fused_vs_torch: Relax made no fused kernel of a farm operator of this module")


def write_kernel(func: Any, path: Path) -> TirWorkload:
    name = str(func.attrs["global_symbol"])
    text = func.script().replace("# from tvm.script import tirx", "from tvm.script import tirx")
    path.write_text(text.replace("def main(", f"def {name}(", 1))
    return tir_from_file(str(path))


def best_kernels(db: Path, workload: TirWorkload, target: str) -> dict[str, tuple[Any, float]]:
    """{template: (its best kernel built as the farm measured it, latency µs as measured)}."""
    from workers.compiler import compile_module

    store = open_store(f"sqlite:///{db}")
    job = store.jobs(limit=1)[0]
    out = {}
    for row in store.tasks(job["id"]):
        best = store.best(row["id"], 1)
        if best:
            task = Task(workload, parse_target(target), row["template"])
            config = task.config_from_json(best[0]["config"])
            out[row["template"]] = (compile_module(task.schedule(config).mod, task.target),
                                    statistics.median(best[0]["latencies"]) * 1e6)
    return out


def retime(case: Case, module: Any, x: Any, kernels: dict[str, Any]) -> dict[str, dict[str, float]]:
    """PyTorch eager, torch.compile and each kernel: checked against eager's output, then timed."""
    import torch

    with torch.no_grad():
        expected = module(x)
        compiled = torch.compile(module)
        compiled(x)
        inputs = [t.detach().contiguous() for t in case.kernel_inputs(module, x)]
        fns: dict[str, Callable[[], Any]] = {"pytorch": lambda: module(x), "torch.compile": lambda: compiled(x)}
        errors = {}
        for label, lib in kernels.items():
            out = torch.full(expected.shape, float("nan"), device=x.device)
            call = tvm_call(lib, [*inputs, out])
            call()
            torch.cuda.synchronize()
            errors[label] = float((out.double() - expected.double()).norm() / expected.double().norm())
            fns[label] = call
        timing = time_side_by_side(fns)
    for label, error in errors.items():
        timing[label].update(rel_l2_error_vs_pytorch=error, correct=bool(error <= 1e-4))
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--trials", type=int, default=256, help="each job's trials, split between its two templates")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fused-vs-torch"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    vendor_precision(torch)
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"trials": args.trials, "target": args.target, "machine": machine(), "cases": {}}
    for name in args.case or sorted(CASES):
        case = CASES[name]
        torch.manual_seed(0)
        module = case.make(torch.nn).eval().cuda()
        x = torch.randn(case.input_shape, device="cuda")
        workload = write_kernel(fused_kernel(module.cpu(), x.cpu()), args.out / f"{name}.py")
        module, runs = module.cuda(), []
        for seed in args.seeds:
            wall, db = farm_tune(str(args.out / f"{name}.py"), [], args.target, args.trials, "xgb", seed, args.out,
                                 f"{name}-{seed}", ["--templates", "all", "--workers", "1"])
            built = best_kernels(db, workload, args.target)
            timing = retime(case, module, x, {label: lib for label, (lib, _) in built.items()})
            runs.append({"seed": seed, "farm_wall_s": wall, "timing": timing,
                         "measured_us": {label: us for label, (_, us) in built.items()}})
            print(f"{name} seed {seed}: farm tune {wall:.0f} s; " + "; ".join(
                f"{label} {t['median_us']:.2f} µs" + ("" if t.get("correct", True) else " WRONG")
                for label, t in timing.items()), flush=True)
        labels = sorted({label for run in runs for label in run["timing"]})
        summary = {label: [run["timing"][label]["median_us"] for run in runs if label in run["timing"]]
                   for label in labels}
        figures["cases"][name] = {"workload": str(workload), "runs": runs, "summary_us": summary}
        print(f"{name}: " + "; ".join(f"{label} {spread(values)} µs" for label, values in summary.items()))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
