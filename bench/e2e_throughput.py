"""End to end: how much of a whole tuning job's wall time its GPUs spend measuring, and how it scales.

    python bench/e2e_throughput.py [--workload resnet-last-conv] [--target cuda] [--trials 500]
                                   [--gpus 1 2] [--seeds 0 1 2] [--warm-submit] [--out DIR] [--json FILE]
    python bench/e2e_throughput.py --merge A.json B.json ... [--json FILE]

For each GPU count and seed, `python -m farm tune WORKLOAD --trials N --workers G` runs as a
process of its own on the embedded defaults (local Ray, tracker, RPC servers, SQLite), timed
from its start to its exit. From the job's trials (their timelines, farm.report.utilisation):

- wall time of the process, and trials per second over it;
- time to the first stored trial, from the process start;
- busy share per GPU: seconds inside timed kernel runs (TVM time_evaluator calls) over the
  job's wall time (claim to end) and over the process's;
- build seconds per candidate (mean, p95);
- the share of the job each GPU held a candidate (upload, load, check, timed runs; the rest it
  waited for work), and each candidate's time on the device outside its timed runs (median, p95);
- when each device's first RPC session opened, from the process start (its worker actor's log:
  the first candidates wait for it as well as for their builds);
- how long Ray took to start (the job's `farm tune -v` log), and how long the process ran on
  after the job was recorded done (its best printed and exported, Ray stopped, its exit);
- how many configs the tuning loop's end game measured beyond the budget, where a device would
  otherwise have waited at a task's end (the same log);
- how many trials the search proposed without a model (its first round, and those that kept the
  devices fed while the first model trained: scheduler.tuner's bridge), and the position of the
  first trial proposed with one;
- the job's phases per device (`phases`): claim to its first measurement, its wait for the first
  model (its last unguided measurement to its first guided one), its last measurement to the job's
  end, and its busy share in between (from its first guided measurement to its last): the fixed
  costs that do not shrink with more GPUs, apart from the steady state that does;
- a timeline PNG per run (farm report --timeline).

Printed: one line per run, then medians over seeds (with min and max) per GPU count, and the
scaling of trials per second against one GPU. --merge prints the same summary over the JSON files
of runs made side by side (each GPU count or seed a run of its own, e.g. bench/gpu_parallel.sh's).
With --warm-submit, also a running farm: a `farm scheduler` service, a first job to bring its
workers up, then the time from `farm submit` of a second job to its first stored trial (workers,
servers, sessions and build processes warm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from costmodel_common import add_workload_arguments, farm_tune, machine, spread

from db.store import open_store
from farm.report import plot_timeline, utilisation


def run_once(args: argparse.Namespace, gpus: int, seed: int) -> dict[str, Any]:
    """One `farm tune` process; its figures (see the module docstring)."""
    name = f"g{gpus}-s{seed}"
    started = time.time()
    wall, db = farm_tune(args.workload, args.params, args.target, args.trials, "xgb", seed, args.out, name,
                         ["--workers", str(gpus), "--verbose"])
    log = (args.out / f"{name}.log").read_text(errors="replace")  # farm tune -v's
    store = open_store(f"sqlite:///{db}")
    (job,) = store.jobs()
    use = utilisation(store, job["id"])
    trials = store.trials(job_id=job["id"])
    first = trials["created_at"].min().timestamp() - started
    plot_timeline(store, job["id"], args.out / f"timeline-{name}.png")
    busy = use.busy_seconds
    overhead = sorted(use.overhead_seconds) or [float("nan")]
    claimed = store.job(job["id"])["started_at"].timestamp()
    ended = claimed + use.wall_seconds
    return {"gpus": gpus, "seed": seed, "started_at": started, "claimed_after_s": claimed - started,
            "wall_s": wall, "trials": len(trials), "trials_per_s": len(trials) / wall,
            "first_trial_s": first, "job_wall_s": use.wall_seconds,
            "busy_share_job": use.busy_share, "busy_share_process": {w: b / wall for w, b in busy.items()},
            "build_mean_s": statistics.mean(use.build_seconds) if use.build_seconds else None,
            "build_p95_s": sorted(use.build_seconds)[int(0.95 * (len(use.build_seconds) - 1))]
            if use.build_seconds else None,
            "measuring_share_job": {w: m / use.wall_seconds for w, m in use.measuring_seconds.items()},
            "overhead_median_ms": 1e3 * statistics.median(overhead),
            "overhead_p95_ms": 1e3 * overhead[int(0.95 * (len(overhead) - 1))],
            "first_session_s": first_sessions(args.out / f"logs-{name}", started),
            "ray_ready_s": ray_ready(log),
            "end_game_configs": end_game_configs(log),
            # After the job was recorded done: its best printed and exported, Ray stopped, the process gone.
            "exit_after_job_s": wall - (claimed - started) - use.wall_seconds,
            "best_us": float(trials["latency"].min() * 1e6), "statuses": trials["status"].value_counts().to_dict(),
            # Trials the search proposed without a model (farm.core.search's "random" origin), and the
            # position of the first it proposed with one, in the order trials were stored.
            "unguided_trials": int((trials["origin"] == "random").sum()),
            "first_guided": int(guided.argmax()) + 1 if (guided := (trials["origin"] != "random").to_numpy()).any()
            else None,
            "phases": phases(trials, claimed, ended)}


def phases(trials: Any, claimed: float, ended: float) -> dict[str, dict[str, float | None]]:
    """Per device (worker): seconds from the claim to its first measurement (`start`), from its last
    unguided measurement to its first guided one (`first_model_wait`, 0 where they overlap, None
    without both), from its last measurement to the job's end (`tail`), and its share of time in
    timed runs from its first guided measurement to its last (`steady_busy`)."""
    out: dict[str, dict[str, float | None]] = {}
    for worker, group in trials.groupby("worker"):
        measured = [(t, origin) for t, origin in zip(group["timeline"], group["origin"], strict=True)
                    if t and "measure" in t]
        if not measured:
            continue
        timelines = [t for t, _ in measured]
        guided = [t for t, origin in measured if origin != "random"]
        unguided = [t for t, origin in measured if origin == "random"]
        first_guided = min((t["measure"][0] for t in guided), default=None)
        last = max(t["measure"][1] for t in timelines)
        steady = None
        if first_guided is not None and last > first_guided:
            timed = sum(b - a for t in timelines if t["measure"][0] >= first_guided for a, b in t.get("timed", []))
            steady = timed / (last - first_guided)
        out[str(worker)] = {
            "start": min(t["measure"][0] for t in timelines) - claimed,
            "first_model_wait": max(0.0, first_guided - max(t["measure"][1] for t in unguided))
            if first_guided is not None and unguided else None,
            "tail": ended - last, "steady_busy": steady}
    return out


# `farm tune -v`'s line for Ray's start (scheduler.service), and the worker actor's for its first
# session (workers.runner), with logging's local time.
_RAY_READY = re.compile(r"farm\.scheduler Ray ready in ([0-9.]+) s")
_FIRST_SESSION = re.compile(r"^(\S+ \S+) farm\.runner session 1 on \S+ open")
# The tuning loop's line for each end-game stand-in (scheduler.tuner).
_STAND_IN = re.compile(r"farm\.scheduler task \S+ \S+ idle at the budget's end, measuring (\d+) new configs")


def ray_ready(log: str) -> float | None:
    """Seconds Ray took to start (or join), from the job's `farm tune -v` log; None without the line."""
    match = _RAY_READY.search(log)
    return float(match[1]) if match else None


def end_game_configs(log: str) -> int:
    """Configs the end game's stand-ins measured beyond the budget (scheduler.tuner), from the
    job's `farm tune -v` log: what a device measured rather than wait at a task's end."""
    return sum(int(match[1]) for match in _STAND_IN.finditer(log))


def first_sessions(log_dir: Path, started: float) -> dict[str, float]:
    """Per worker: seconds from `started` (epoch) to its first session's opening, from the actors'
    logs in `log_dir` (`farm tune --log-dir`); a worker whose log has no such line is left out."""
    opened = {}
    for log in sorted(log_dir.glob("*-actor.log")):
        for line in log.read_text(errors="replace").splitlines():
            if match := _FIRST_SESSION.match(line):
                stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                opened[log.name.removesuffix("-actor.log")] = stamp - started
                break
    return opened


def warm_submit(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds from `farm submit` to the job's first stored trial on a running, warm farm: a
    `farm scheduler` service, a first job that brings its workers up, then `args.warm_jobs` jobs
    submitted one after another (seeds 1, 2, ...), each once the one before has ended."""
    db = args.out / "service.db"
    db.unlink(missing_ok=True)
    url = f"sqlite:///{db}"
    farm = [sys.executable, "-m", "farm"]
    job = [args.workload, *args.params, "--target", args.target, "--db", url, "--trials", "32"]
    log = (args.out / "scheduler.log").open("wb")
    service = subprocess.Popen([*farm, "scheduler", "--db", url, "--log-dir", str(args.out / "logs-service")],
                               stdout=log, stderr=subprocess.STDOUT)
    store = open_store(url)

    def submit(seed: int) -> tuple[int, float, float]:
        """The job's id, when `farm submit` started (epoch seconds), and how long its process ran."""
        submitted = time.time()
        job_id = int(subprocess.run([*farm, "submit", *job, "--seed", str(seed)], capture_output=True, text=True,
                                    check=True).stdout.split()[0])
        process = time.time() - submitted
        while store.job_status(job_id) not in ("done", "failed", "cancelled"):
            time.sleep(0.05)
        return job_id, submitted, process

    try:
        submit(0)  # brings the workers, servers, sessions and build processes up
        seconds, processes = [], []
        for seed in range(1, args.warm_jobs + 1):
            job_id, submitted, process = submit(seed)
            first = store.trials(job_id=job_id)["created_at"].min().timestamp() - submitted
            print(f"warm farm submit {seed}: first trial {first:.2f} s after `farm submit` started "
                  f"(its process: {process:.2f} s)", flush=True)
            seconds.append(first)
            processes.append(process)
        return {"submit_to_first_trial_s": seconds, "submit_process_s": processes}
    finally:
        service.terminate()
        service.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                        help="the seeds run at each GPU count (none: only --warm-submit)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: the summary of the runs in these --json files of earlier runs "
                             "(one GPU count or seed each, run side by side on one machine)")
    parser.add_argument("--warm-submit", action="store_true")
    parser.add_argument("--warm-jobs", type=int, default=3, help="jobs timed on the warm farm (--warm-submit)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-e2e"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        figures = {**parts[0], "runs": [run for part in parts for run in part["runs"]],
                   "merged": [str(path) for path in args.merge]}
        figures["summary"] = summarise(figures["runs"])
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1, default=str))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {"machine": machine(), "workload": args.workload, "params": args.params, "target": args.target,
               "trials": args.trials, "runs": []}
    print(f"machine: {figures['machine']}; {args.workload} {' '.join(args.params)} on {args.target}, "
          f"{args.trials} trials per run", flush=True)
    for seed in args.seeds:
        for gpus in args.gpus:
            run = run_once(args, gpus, seed)
            figures["runs"].append(run)
            busy = ", ".join(f"{w} {s:.0%}" for w, s in sorted(run["busy_share_job"].items()))
            measuring = ", ".join(f"{w} {s:.0%}" for w, s in sorted(run["measuring_share_job"].items()))
            print(f"{gpus} GPU(s) seed {seed}: {run['wall_s']:.1f} s, {run['trials_per_s']:.2f} trials/s, first trial "
                  f"{run['first_trial_s']:.1f} s, busy {busy} (of the job's {run['job_wall_s']:.0f} s), builds "
                  f"{run['build_mean_s']:.2f} s mean / {run['build_p95_s']:.2f} s p95, best {run['best_us']:.2f} µs; "
                  f"device holding a candidate {measuring}; per candidate outside timed runs "
                  f"{run['overhead_median_ms']:.0f} ms median / {run['overhead_p95_ms']:.0f} ms p95; Ray ready in "
                  f"{run['ray_ready_s']} s; job claimed {run['claimed_after_s']:.1f} s after start; process gone "
                  f"{run['exit_after_job_s']:.2f} s after the job ended; end-game stand-ins measured "
                  f"{run['end_game_configs']} configs; unguided trials {run['unguided_trials']}, first guided "
                  f"trial no. {run['first_guided']}; first session open after "
                  + ", ".join(f"{w} {t:.1f} s" for w, t in sorted(run["first_session_s"].items())), flush=True)
            print(f"  phases: {phase_line(run['phases'])}", flush=True)
            if args.json:  # after every run: a session cut short keeps what it finished
                args.json.write_text(json.dumps(figures, indent=1, default=str))
    figures["summary"] = summarise(figures["runs"])
    if args.warm_submit:
        figures["warm_submit"] = warm_submit(args)
        print(f"farm submit to a warm farm -> first trial, median over {args.warm_jobs} jobs: "
              f"{spread(figures['warm_submit']['submit_to_first_trial_s'])} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))


def phase_line(per_device: dict[str, dict[str, float | None]]) -> str:
    """`phases` in one line: the medians over the devices, and the steady busy share's range."""
    def median(key: str) -> str:
        values = [p[key] for p in per_device.values() if p[key] is not None]
        return f"{statistics.median(values):.1f} s" if values else "-"

    steady = [p["steady_busy"] for p in per_device.values() if p["steady_busy"] is not None]
    busy = f"{min(steady):.0%} to {max(steady):.0%}" if steady else "-"
    return (f"claim to first measurement {median('start')}, first-model wait {median('first_model_wait')}, "
            f"last measurement to the end {median('tail')} (medians over devices); busy after the first guided "
            f"trial {busy}")


def summarise(runs: list[dict[str, Any]]) -> dict[Any, Any]:
    """Print and return, per GPU count, the medians over its runs (seeds), and the scaling of trials
    per second over one GPU's."""
    summary: dict[Any, Any] = {}
    for gpus in sorted({r["gpus"] for r in runs}):
        of = [r for r in runs if r["gpus"] == gpus]
        least_busy = [min(r["busy_share_job"].values()) for r in of]
        summary[gpus] = {key: [r[key] for r in of] for key in ("seed", "wall_s", "trials_per_s", "first_trial_s",
                                                                "best_us", "unguided_trials")}
        summary[gpus]["min_busy_share"] = least_busy
        print(f"{gpus} GPU(s), median over {len(of)} seeds: wall {spread(summary[gpus]['wall_s'])} s, "
              f"trials/s {spread(summary[gpus]['trials_per_s'])}, first trial {spread(summary[gpus]['first_trial_s'])} "
              f"s, least busy GPU {spread(least_busy)}, best {spread(summary[gpus]['best_us'])} µs, unguided trials "
              f"{spread(summary[gpus]['unguided_trials'])}")
    if 1 in summary:
        for gpus in [g for g in summary if g != 1]:
            ratio = statistics.median(summary[gpus]["trials_per_s"]) / statistics.median(summary[1]["trials_per_s"])
            summary[f"scaling_{gpus}"] = ratio
            print(f"scaling, {gpus} GPUs over 1: {ratio:.2f}x trials/s (medians)")
    return summary


if __name__ == "__main__":
    main()
