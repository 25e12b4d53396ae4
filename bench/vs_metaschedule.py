"""The farm's model-guided search against stock MetaSchedule at equal trial budgets, same device.

    python bench/vs_metaschedule.py [--workload resnet-last-conv] [--target cuda] [--trials 128]
                                    [--seeds 0 1 2] [--out DIR] [--json FILE]
    python bench/vs_metaschedule.py --merge A.json B.json ... --json FILE [--device NAME]

Two tuning runs of the same kernel, one after the other, each a process of its own and timed
from its start to its exit (imports, servers and Ray included: what a user waits for):

- farm: `python -m farm tune WORKLOAD --search xgb --trials N --workers 1` on the embedded
  defaults (local Ray, RPC tracker and server, SQLite), exporting its best config: one worker, on
  the first GPU, the one MetaSchedule's runner uses;
- MetaSchedule: `ms.tune_tir` with its defaults (post-order-apply space, evolutionary search
  with its XGBoost model, LocalBuilder, LocalRunner with its default evaluator), max_trials_global
  = N, num_trials_per_iter = 64 (its default); its LocalBuilder has one process per core this
  process may use, as the farm's build slots (farm.core.host.usable_cores), where its default
  counts the machine's, and the farm's build timeout (60 s), where its default is 30 s.

Then both best kernels are rebuilt in this process (the farm's from its export with farm.build,
MetaSchedule's from its database with compile_tir), checked against the NumPy reference, and
timed with one time_evaluator setting, alternating, so the latencies compare like for like.
Prints one line per method and the ratios, writes a tuning-curve plot (best latency each tool
measured against trials) and, with --json, every figure.

A seed takes about 16 minutes of an H100 at 512 trials (MetaSchedule 13 of them), so the seeds of
one comparison may come from several device sessions: `--merge` joins the --json files of such
runs into one, with the medians over all their seeds, after checking that they compare the same
workload, target and trials on one GPU kind, each seed once. (`--device` names the GPU of runs
recorded before each run kept its own.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_common import add_workload_arguments, farm_curve, farm_tune, machine, resolve_workload, spread, timed

from farm.core.host import usable_cores
from farm.core.targets import parse_target
from farm.core.workloads import Workload
from farm.report import Curve, best_so_far, plot_curves
from workers.worker import BUILD_TIMEOUT_S

# Final timing of the two best kernels by TVM's time_evaluator: FINAL_ROUNDS repeats of FINAL_NUMBER
# back-to-back calls (at least FINAL_MIN_MS each), one repeat per kernel in turn. Kernels of 3 to 5 µs
# flip between two speeds for seconds at a time (a layer norm's repeats at 3.3 and 4.5 µs,
# docs/benchmarks/tir-2026-11-28d.md): alternating every repeat puts both kernels in both states alike.
FINAL_NUMBER, FINAL_ROUNDS, FINAL_MIN_MS = 20, 30, 100
# More failed candidates than this share of the trials and the comparison is flagged: on a 2-GPU host
# shared with another tuning job, 504 of MetaSchedule's 512 builds hit its LocalBuilder's 30 s
# timeout (docs/benchmarks/kernels-2026-11-26g.md).
FAILED_WARNING = 0.25


def run_metaschedule(workload: Workload, target: str, trials: int, work_dir: Path, seed: int) -> None:
    """Child process: stock ms.tune_tir into `work_dir`; writes work_dir/tune.json (its seconds)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    mod = tvm.IRModule({"main": workload.prim_func()})
    # Its default builder starts one process per core of the machine (psutil), whatever this
    # process may use; sized like the farm's build slots instead, by the cores it may run on (the
    # same number on a machine of its own). Its builds get the farm's build timeout, not its
    # default 30 s: its 64 builds of a round took about 45 s on 16 processes of an idle 16-core
    # host, about 10 s each (e2e-throughput-2026-11-26c); with four runs on one 64-core host, each pinned
    # to 16 cores, 405 of its 512 builds outlasted 30 s (kernels-2026-11-26h), so its search
    # measured a fifth of its trials.
    builder = ms.builder.LocalBuilder(max_workers=usable_cores(), timeout_sec=BUILD_TIMEOUT_S)
    start = time.perf_counter()
    ms.tune_tir(mod, parse_target(target).tvm(), str(work_dir), max_trials_global=trials, seed=seed, builder=builder)
    (work_dir / "tune.json").write_text(json.dumps({"tune_seconds": time.perf_counter() - start}))


def metaschedule_records(work_dir: Path) -> tuple[Any, np.ndarray, dict[str, int]]:
    """MetaSchedule's database, best-so-far mean latency (µs) after each measured candidate in the
    order they were committed, and counts of ok and failed candidates.

    The order comes from the records file itself (one JSON line per candidate, appended as
    measured): the database's get_all_tuning_records returns them sorted by latency."""
    from tvm.s_tir import meta_schedule as ms

    records = work_dir / "database_tuning_record.json"
    database = ms.database.JSONDatabase(str(work_dir / "database_workload.json"), str(records),
                                        allow_missing=False)
    latencies = []
    for line in records.read_text().splitlines():
        run_secs = json.loads(line)[1][1]  # [workload index, [trace, run_secs, target, args]]
        ok = bool(run_secs) and max(run_secs) < 1e9  # MetaSchedule records a failure as 1e10 s
        latencies.append(statistics.mean(run_secs) * 1e6 if ok else np.inf)
    lat = np.array(latencies)
    return database, best_so_far(lat), {"ok": int(np.isfinite(lat).sum()), "failed": int((~np.isfinite(lat)).sum())}


def final_timing(workload: Workload, target: str, modules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Check every module against the NumPy reference, then time them alternately; µs figures."""
    import tvm

    spec = parse_target(target)
    if spec.kind == "cuda":
        import tvm.support.nvcc  # registers the CUDA compile callback the runtime needs
    dev = tvm.cuda(0) if spec.kind == "cuda" else tvm.cpu(0)
    inputs = workload.random_inputs()
    expected = workload.reference(inputs)
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    out = tvm.runtime.tensor(np.zeros(workload.output_shape(), workload.dtype), dev)
    figures: dict[str, dict[str, Any]] = {}
    timers = {}
    for name, lib in modules.items():
        out.copyfrom(np.full(workload.output_shape(), np.nan, workload.dtype))  # a kernel that writes nothing fails
        lib["main"](*args, out)
        error = float(np.linalg.norm(out.numpy() - expected) / max(np.linalg.norm(expected), 1e-30))
        figures[name] = {"rel_l2_error": error, "correct": error <= workload.tolerance(), "runs_us": []}
        timers[name] = lib.mod.time_evaluator("main", dev, number=FINAL_NUMBER, repeat=1,
                                          min_repeat_ms=FINAL_MIN_MS)
    for _ in range(FINAL_ROUNDS):  # alternate, so drifting clocks or a busy neighbour hit both alike
        for name, timer in timers.items():
            figures[name]["runs_us"] += [r * 1e6 for r in timer(*args, out).results]
    for f in figures.values():
        f["median_us"] = statistics.median(f["runs_us"])
    return figures


def retime(workload: Workload, target: str, export: Path, ms_dir: Path) -> dict[str, dict[str, Any]]:
    """The farm's best kernel (from its export) and MetaSchedule's (from its database), rebuilt,
    checked and timed by `final_timing`."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from farm.apply import build

    database, _, _ = metaschedule_records(ms_dir)
    spec = parse_target(target)
    mod = tvm.IRModule({"main": workload.prim_func()})
    best = ms.tir_integration.compile_tir(database, mod, spec.tvm())
    if best is None:  # every candidate failed to build or run: there is no MetaSchedule kernel to time
        raise SystemExit(f"vs_metaschedule: MetaSchedule recorded no valid candidate in {ms_dir} "
                         "(its logs/ say why)")
    ms_lib = tvm.compile(best.mod, target=spec.tvm())
    return final_timing(workload, target, {"farm": build(workload, spec, export), "metaschedule": ms_lib})


def compare(workload: Workload, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """One seed: both tuning runs into OUT, both best kernels re-timed; every figure, printed too."""
    ms_dir, export = out / "metaschedule", out / "farm-best.json"
    ms_dir.mkdir(parents=True, exist_ok=True)
    for stale in [export, *ms_dir.glob("*.json")]:
        stale.unlink(missing_ok=True)
    print(f"{workload} on {args.target}, {args.trials} trials each, seed {seed}", flush=True)
    # One worker: the farm measures on the one GPU MetaSchedule's runner uses (the first).
    farm_s, db = farm_tune(args.workload, args.params, args.target, args.trials, "xgb", seed, out, "farm",
                           ["--workers", "1"])
    print(f"farm tune: {farm_s:.0f} s", flush=True)
    ms_s = timed([sys.executable, str(Path(__file__).resolve()), "--workload", args.workload, "--params",
                  *args.params, "--target", args.target, "--trials", str(args.trials), "--seed", str(seed),
                  "--run-metaschedule", str(ms_dir)], out / "metaschedule.log")
    print(f"ms.tune_tir: {ms_s:.0f} s", flush=True)

    farm_best, farm_status = farm_curve(db)
    device = json.loads(export.read_text())["records"][0]["device"]  # the GPU both sides ran on
    _, ms_best, ms_status = metaschedule_records(ms_dir)
    final = retime(workload, args.target, export, ms_dir)
    ms_tune_s = json.loads((ms_dir / "tune.json").read_text())["tune_seconds"]
    figures = {
        "seed": seed,
        "device": device,
        "farm": {"wall_s": farm_s, "trials": len(farm_best), "statuses": farm_status,
                 "best_measured_us": float(np.nanmin(farm_best)), "curve_us": farm_best.tolist(), **final["farm"]},
        "metaschedule": {"wall_s": ms_s, "tune_tir_s": ms_tune_s, "trials": len(ms_best), "statuses": ms_status,
                         "best_measured_us": float(np.nanmin(ms_best)), "curve_us": ms_best.tolist(),
                         **final["metaschedule"]},
    }
    for name in ("farm", "metaschedule"):
        f = figures[name]
        print(f"{name:>12}: {f['trials']} trials in {f['wall_s']:.0f} s, {f['statuses']}; best {f['median_us']:.2f} µs "
              f"re-timed ({f['best_measured_us']:.2f} µs as measured while tuning), correct: {f['correct']}")
    for name in ("farm", "metaschedule"):
        if (failed := figures[name]["trials"] - figures[name]["statuses"].get("ok", 0)) > FAILED_WARNING * args.trials:
            figures["warning"] = (f"{failed} of {name}'s {args.trials} candidates failed (a busy host times builds "
                                  f"out: run this alone); its search, and the ratios below, say little")
            print(f"WARNING: {figures['warning']}")
    farm, other = figures["farm"], figures["metaschedule"]
    figures["latency_ratio_ms_over_farm"] = other["median_us"] / farm["median_us"]
    figures["wall_ratio_ms_over_farm"] = other["wall_s"] / farm["wall_s"]
    print(f"MetaSchedule / farm: latency {figures['latency_ratio_ms_over_farm']:.2f}x, "
          f"wall time {figures['wall_ratio_ms_over_farm']:.2f}x (above 1: the farm is faster)")
    label = f"{workload} on {args.target}"
    plot = plot_curves([Curve(f"farm xgb ({farm_s:.0f} s)", label, farm_best),
                        Curve(f"MetaSchedule ({ms_s:.0f} s)", label, ms_best)], out / "curve.png")
    print(f"tuning curves: {plot}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--trials", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one comparison per seed, each in OUT/seed-N when there are several; medians printed")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-vs-ms"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--retime", action="store_true",
                        help="only check and time again the two best kernels of an earlier run in --out")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="join earlier --json files of this comparison (seeds run in several sessions) "
                             "into --json, with the medians over all their seeds")
    parser.add_argument("--device", help="with --merge: the GPU of runs that do not record it")
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)  # the child's seed
    parser.add_argument("--run-metaschedule", type=Path, help=argparse.SUPPRESS)  # the child's work dir
    args = parser.parse_args()
    if args.merge:
        if not args.json:
            parser.error("--merge needs --json, the file to write the joined figures to")
        merged = merge(args.merge, args.device)
        args.json.write_text(json.dumps(merged, indent=1))
        return
    workload = resolve_workload(args.workload, args.params)
    if args.run_metaschedule:
        run_metaschedule(workload, args.target, args.trials, args.run_metaschedule, args.seed)
        return
    if args.retime:  # the kernels of an earlier run of this script in OUT, checked and timed again
        for name, f in retime(workload, args.target, args.out / "farm-best.json", args.out / "metaschedule").items():
            print(f"{name:>12}: {f['median_us']:.2f} µs, relative L2 error {f['rel_l2_error']:.2e}, "
                  f"correct: {f['correct']}")
        return
    several = len(args.seeds) > 1
    runs: list[dict[str, Any]] = []
    figures: dict[str, Any] = {
        "workload": str(workload), "target": args.target, "trials": args.trials, "machine": machine(),
        "final_timing": {"number": FINAL_NUMBER, "rounds": FINAL_ROUNDS, "min_repeat_ms": FINAL_MIN_MS},
        "runs": runs,
    }
    for seed in args.seeds:
        runs.append(compare(workload, args, seed, args.out / f"seed-{seed}" if several else args.out))
        if args.json:  # after every seed: a run cut short (a device lease ending) keeps the seeds it finished
            args.json.write_text(json.dumps(figures, indent=1))
    if several:
        summarise(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def summarise(figures: dict[str, Any]) -> None:
    """Medians over `figures["runs"]` (one per seed) into figures["summary"], printed too."""
    runs = figures["runs"]
    summary = {key: [r[key] for r in runs] for key in ("wall_ratio_ms_over_farm", "latency_ratio_ms_over_farm")}
    for name in ("farm", "metaschedule"):
        summary[f"{name}_wall_s"] = [r[name]["wall_s"] for r in runs]
        summary[f"{name}_best_us"] = [r[name]["median_us"] for r in runs]
    figures["summary"] = summary
    print(f"median over {len(runs)} seeds: " + "; ".join(f"{key} {spread(values)}" for key, values in summary.items()))


def merge(files: list[Path], device: str | None) -> dict[str, Any]:
    """The --json figures of several runs of one comparison as one, their seeds' runs together and
    summarised; SystemExit with one line where they do not compare the same thing."""
    loaded = []
    for f in files:
        try:
            loaded.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"vs_metaschedule: cannot read {f}: {e}") from None
    first = loaded[0]
    for f, figures in zip(files, loaded, strict=True):
        for key in ("workload", "target", "trials"):
            if figures.get(key) != first.get(key):
                raise SystemExit(f"vs_metaschedule: {f} has {key} {figures.get(key)!r}, {files[0]} "
                                 f"{first.get(key)!r}: merge runs of one comparison only")
    runs = [dict(run) for figures in loaded for run in figures["runs"]]
    for run in runs:
        run.setdefault("device", device)
    if None in (devices := {run["device"] for run in runs}):
        raise SystemExit("vs_metaschedule: some runs do not record their GPU; say which it was with --device")
    if len(devices) > 1:
        raise SystemExit(f"vs_metaschedule: the runs are from different GPUs ({', '.join(sorted(devices))}): "
                         "their medians would mix them")
    if len(seeds := [run["seed"] for run in runs]) != len(set(seeds)):
        raise SystemExit(f"vs_metaschedule: a seed comes twice among {sorted(seeds)}")
    merged = {**first, "machine": "; ".join(sorted({figures["machine"] for figures in loaded})),
              "runs": sorted(runs, key=lambda run: run["seed"]), "merged_from": [str(f) for f in files]}
    for run in merged["runs"]:
        if "warning" in run:
            print(f"WARNING (seed {run['seed']}): {run['warning']}")
    summarise(merged)
    return merged

if __name__ == "__main__":
    main()
