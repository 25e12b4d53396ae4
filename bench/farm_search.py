"""Model-guided search against random search through the whole farm: trials to come within 95% of
the best latency, and the best latency at each budget.

    python bench/farm_search.py [--workload resnet-last-conv] [--params k=v ...] [--target cuda]
                                [--search xgb [xgb:screen=16 ...]] [--seeds 3] [--trials 128]
                                [--random-trials 384] [--random-seeds 3] [--first-seed 0]
                                [--history STORE] [--out DIR] [--json FILE]
    python bench/farm_search.py --merge JSON JSON [JSON ...] [--pool] [--out DIR] [--json FILE]

Every run is a `python -m farm tune` process on the embedded defaults (local Ray, RPC tracker and
server, SQLite), each in a new store so that no run learns from another: for each model-guided
search spec of `--search` (default xgb; with options, `xgb:screen=16`: farm.core.search), `--seeds`
runs of `--trials` each (seeds 0, 1, ...; stores OUT/xgb-0.db, OUT/xgb-screen16-0.db, ...), and
`--random-seeds` runs with `--search random` of `--random-trials` each (seeds 1000, 1001, ...), the
one baseline every spec is measured against, taking turns with them (seed 0 of each spec, random
1000, seed 1, ...): several specs in one invocation compare settings
on one device, in one session. With `--history STORE` (a SQLite store of an earlier job of the
same family on other shapes, such as another run's OUT/xgb-0.db) each guided run's store starts as
a copy of it instead: the run starts from that family's cost model and trials, as a job on a farm
that has tuned before does (farm.core.costmodel: one model per family, all shapes). The store must
hold a model of the family and no trial of the shape tuned here, or the script stops before any
run.
(bench/costmodel_search.py compares the two searches on memoised measurements of a local device
instead; this script measures what a user of `farm tune` gets, pipelining and all.)

A random search run is a uniform sample of valid configs without replacement, so besides its own
curve, its trials to a threshold are given as the expectation over orders, (R + 1) / (k + 1) for
k hits among its R trials (a lower bound, "> R", when k = 0), the random runs' samples pooled.
Per spec: thresholds best / 0.95 and best / 0.90, best being the fastest latency any run
measured; the guided runs' budget against the trials random search needed for their median best;
and issue 15's measure: per random run, the trials the guided runs need (their median) to reach
that run's best against the expected trials to it in that run's own sample, and the median of
those ratios over the random runs (one random run's best is one seed's luck: a fixed seed found
the same fast kernel early on every H200 it ran on, docs/benchmarks/kernels-2026-11-27b.md).
Each guided run's trials say what proposed them (random draws before the first model, then the
model's plan or its screened exploration: farm.core.search.ORIGINS); per spec it prints which of
them set each new best and reached each random run's best, and how far behind its trials the
model that proposed them was (`model_lag`); per run, the share of the job's wall time its device
had a candidate on it and spent in timed runs (farm.report.utilisation).
Writes the curves' plot to OUT/curves.png and, with --json, every figure (per spec under
"searches", every run's trials with their origins under "runs").

A case's guided and random runs can be made on two GPUs at once: `--random-seeds 0` on one and
`--seeds 0` on the other (each writes its runs, without figures), then `--merge` of the two JSONs
works the figures out as one invocation would have (a lease's device minutes hold twice the runs).
With `--first-seed N` the runs are seeds N, N+1, ... and 1000 + N, ...: a case's runs spread over
more GPUs than two, each taking its own seeds, merge as those of one invocation would. `--merge
--pool` joins JSONs of different sessions, whose seeds repeat: an estimate from more runs, on
different machines. Random runs count once per seed there, as a seed draws the same configs.

Issue 15 asks for the median over 3 seeds, and one session's three runs a side swing the verdict
by a factor of two. Where a spec has more than 3 runs on either side, the script also works the
measure out for every choice of 3 guided and 3 random runs. It gives the share of choices at 3x or
more, and their median and spread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from itertools import combinations, pairwise
from pathlib import Path

import numpy as np
from costmodel_common import add_workload_arguments, farm_curve, farm_tune, trials_to

from db.store import open_store
from farm.core.errors import FarmError
from farm.core.jobspec import JobRequest, family_key
from farm.core.search import parse_search
from farm.core.workloads import Workload, make_workload
from farm.report import Curve, plot_curves, utilisation


def expected_random_trials(latency_us: np.ndarray, threshold: float) -> tuple[float, int]:
    """(expected trials of a random order of the sample to reach `threshold`, hits in the sample)."""
    hits = int((latency_us <= threshold).sum())
    return (len(latency_us) + 1) / (hits + 1), hits


def run_label(run: dict) -> str:
    """A run's name in what is printed: its seed, and with --pool the JSON it came from."""
    return f"seed {run['seed']}" + (f" of JSON {run['session']}" if run.get("session") else "")


def run_name(spec: str) -> str:
    """A search spec as a file name's stem: `xgb` stays `xgb` (OUT/xgb-0.db, the store another
    run's --history is given), `xgb:screen=16,epsilon=0.25` becomes `xgb-screen16-epsilon0.25`."""
    return spec.replace(":", "-").replace(",", "-").replace("=", "")


def check_history(history: Path, workload: Workload, target: str) -> str:
    """What `history` holds for the task tuned here, in words; FarmError unless it holds a model of
    the task's family and no trial of its shape (the runs would then not be learning from other
    shapes but from this one)."""
    if not history.is_file():
        raise FarmError(f"--history {history}: no such store (give an earlier run's OUT/xgb-0.db)")
    (task,) = JobRequest.build([workload], target, 1).tasks
    family = family_key(task)
    store = open_store(f"sqlite:///{history}")
    if store.latest_model(family) is None:
        raise FarmError(f"--history {history}: no cost model of {family} there; tune another shape of "
                        f"{task.workload.name} for {task.target.kind} with --search xgb into it first")
    trials = store.trials_for_family(family)
    if (trials["workload_key"] == task.workload.key).any():
        raise FarmError(f"--history {history}: it holds trials of {task.workload} itself; give a store of "
                        "other shapes only")
    return f"{len(trials)} trials of {trials['workload_key'].nunique()} other shape(s) of {family}"


def model_lag(model_trials: list[list[int | None]]) -> dict[str, float] | None:
    """How far behind its trials the model that proposed them was: over every trial of the runs
    handed out after a model could exist, its position (1-based) minus the trials the newest model
    it could have been proposed by had learnt from (`run["model_trials"]`); at least that old, since
    a retraining takes a moment to arrive. Median, p10 and p90; None if no trial had a model. Only the
    rounds' models are recorded: with XGBSearch's `refresh`, whose models between rounds are not,
    this is an upper bound."""
    lags = [t - m for run in model_trials for t, m in enumerate(run, start=1) if m is not None]
    if not lags:
        return None
    p10, p50, p90 = np.percentile(lags, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90), "trials": len(lags)}


def hits_by_origin(latencies: list[np.ndarray], origins: list[list[str | None]], threshold: float,
                   trials: int) -> dict[str, list[tuple[int, int]]]:
    """Per origin of the trials (farm.core.search.ORIGINS, "unknown" where the store does not say),
    per quarter of the budget of `trials`: (trials at or under `threshold` µs, trials) over the runs."""
    edges = np.linspace(0, trials, 5).round().astype(int)
    out: dict[str, list[tuple[int, int]]] = {}
    for latency, run in zip(latencies, origins, strict=True):
        for quarter, (start, end) in enumerate(pairwise(edges)):
            for value, origin in zip(latency[start:end], run[start:end], strict=True):
                row = out.setdefault(origin or "unknown", [(0, 0)] * 4)
                hits, seen = row[quarter]
                row[quarter] = (hits + int(value <= threshold), seen + 1)
    return out


# Runs a side of issue 15's measure: "median over 3 seeds".
SIDE = 3


def resampled(to_best: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Issue 15's measure for every choice of `SIDE` guided runs and `SIDE` random runs: `to_best[g, j]`
    the trials guided run g needed to reach random run j's best (inf if it never did), `expected[j]`
    random's expected trials to it. Per choice, as `guided_figures` works it out: per random run,
    expected over the guided runs' median (0 where that median is inf), then the lower middle over
    the random runs. Enumerated, not sampled: the same runs give the same figures."""
    guided_sets = np.array(list(combinations(range(to_best.shape[0]), SIDE)))
    random_sets = np.array(list(combinations(range(to_best.shape[1]), SIDE)))
    ratios = expected / np.median(to_best[guided_sets], axis=1)  # (guided choices, random runs); x / inf = 0
    return np.sort(ratios[:, random_sets], axis=2)[:, :, (SIDE - 1) // 2].ravel()


def guided_figures(spec: str, curves: list[np.ndarray], latencies: list[np.ndarray], origins: list[list[str | None]],
                   model_trials: list[list[int | None]], random_samples: dict[str, np.ndarray], best: float,
                   trials: int) -> dict:
    """The figures of one guided search's runs (their best-so-far curves and each trial's latency,
    µs, inf before a first result or where failed, what proposed each trial: farm.core.search.ORIGINS,
    None where the store does not say, and the trials its newest possible model had learnt from:
    `model_lag`) against the random runs' samples by `run_label` (µs per trial, inf where failed), `best`
    the fastest latency of any run; printed, one line each, and returned for the JSON."""
    lag = model_lag(model_trials)
    if lag is not None:
        print(f"  {spec} model lag: a trial came {lag['median']:.0f} trials (p10 {lag['p10']:.0f}, p90 "
              f"{lag['p90']:.0f}) after the last trial the newest model it could have been proposed by "
              f"had learnt from ({lag['trials']} trials; the rounds' models only)")
    # The random runs are independent uniform samples: pooled, they estimate random search's
    # trials to a latency better than one run does.
    pooled = np.concatenate(list(random_samples.values()))
    figures: dict = {"thresholds": {}, "model_lag": lag}
    for fraction in (0.95, 0.90):
        threshold = best / fraction
        guided = [trials_to(c, threshold) for c in curves]
        guided_median = statistics.median(guided) if all(t is not None for t in guided) else None
        expected, hits = expected_random_trials(pooled, threshold)
        ratio = expected / guided_median if guided_median and hits else None
        figures["thresholds"][str(fraction)] = {"guided_trials": guided, "guided_median": guided_median,
                                                "random_hits": hits, "random_expected": expected, "ratio": ratio}
        random_text = f"{expected:.0f} expected ({hits} hits in {len(pooled)})" if hits else f"> {len(pooled)} (no hit)"
        bound = f"{ratio:.1f}x" if ratio else (f"> {len(pooled) / guided_median:.1f}x" if guided_median else "n/a")
        print(f"  {spec} to {fraction:.0%} of best ({threshold:.2f} µs): {guided} (median {guided_median}), "
              f"random {random_text}: {bound} fewer trials with the model")
    # Issue 15's measure, once per random run: the trials the guided runs need to reach that run's
    # best, against the trials a random order of that run's sample needs to reach it (its
    # expectation, as above); then the median over the random runs, so that no one random run's
    # luck sets the bar. A guided run that never got there counts as more than its budget, so the
    # median is one while most did; a random run whose guided median is such a bound counts as a
    # ratio of 0, and of an even number of random runs the lower middle ratio is the median.
    comparisons = []
    for name, sample in random_samples.items():
        random_best = float(np.min(sample))
        guided = [trials_to(c, random_best) for c in curves]
        median = statistics.median(math.inf if t is None else t for t in guided)
        expected, hits = expected_random_trials(sample, random_best)
        ratio = None if math.isinf(median) else expected / median
        # What proposed the trial each guided run got there with: the model's plan or its exploration.
        reached_by = [None if t is None else run[t - 1] for t, run in zip(guided, origins, strict=True)]
        comparisons.append({"random_run": name, "latency_us": random_best, "guided_trials": guided,
                            "reached_by": reached_by, "guided_median": None if math.isinf(median) else median,
                            "random_hits": hits, "random_expected": expected, "ratio": ratio})
        print(f"  {spec} to random {name}'s best ({random_best:.2f} µs): {guided} (median "
              + (f"> {trials}" if ratio is None else f"{median:.0f}")
              + f"; by {', '.join(o or '-' for o in reached_by)}), random {expected:.1f} expected ({hits} of its "
              + f"{len(sample)} there): " + (f"< {expected / trials:.1f}x" if ratio is None else f"{ratio:.2f}x")
              + " fewer trials with the model")
    # Which part of the search moved the runs' bests: per origin, the trials that set a new best.
    improvements = Counter(run[t] or "unknown" for curve, run in zip(curves, origins, strict=True)
                           for t in np.nonzero(curve < np.concatenate([[np.inf], curve[:-1]]))[0])
    figures["improvements_by_origin"] = dict(improvements)
    print(f"  {spec} new bests by origin: " + ", ".join(f"{o} {n}" for o, n in sorted(improvements.items())))
    # How often each part of the search proposed a fast config, over the budget: the plan's yield
    # grows with the model while exploration's stays low (docs/benchmarks/kernels-2026-11-27h.md),
    # which is what a share of exploration that changes over a run would weigh.
    near = 1.05 * statistics.median(c["latency_us"] for c in comparisons)
    yields = hits_by_origin(latencies, origins, near, trials)
    figures["hits_by_origin"] = {"threshold_us": near, "quarters_of": trials, "hits_trials": yields}
    print(f"  {spec} trials within 5% of the median random best ({near:.2f} µs), hits/trials per quarter of "
          f"{trials} trials: " + "; ".join(f"{o} " + " ".join(f"{h}/{n}" for h, n in row)
                                            for o, row in sorted(yields.items())))
    median_ratio = statistics.median_low(c["ratio"] or 0.0 for c in comparisons)
    figures["to_random_best"] = comparisons
    figures["to_random_best_median_ratio"] = median_ratio or None
    print(f"  {spec} to random's best, median over {len(comparisons)} random run(s): "
          + (f"{median_ratio:.2f}x" if median_ratio else "n/a (the median random run's best was not reached "
             f"by most of its runs in {trials} trials)") + " fewer trials with the model")
    # How far one lease's verdict (3 seeds a side, as issue 15 asks) can be trusted: the measure over
    # every choice of 3 of these guided runs and 3 of these random runs.
    to_best = np.array([[math.inf if t is None else t for t in c["guided_trials"]] for c in comparisons]).T
    if min(to_best.shape) >= SIDE and max(to_best.shape) > SIDE:
        spread = resampled(to_best, np.array([c["random_expected"] for c in comparisons]))
        p10, p50, p90 = np.percentile(spread, [10, 50, 90])
        share = float(np.mean(spread >= 3))
        figures["resampled"] = {"runs_a_side": SIDE, "choices": len(spread), "share_at_least_3x": share,
                                "median": float(p50), "p10": float(p10), "p90": float(p90)}
        print(f"  {spec} the same measure for every choice of {SIDE} of these {to_best.shape[0]} runs and {SIDE} "
              f"of the {to_best.shape[1]} random runs ({len(spread)} choices): 3x or more in {share:.0%}, "
              f"median {p50:.2f}x (p10 {p10:.2f}x, p90 {p90:.2f}x)")
    # The other way round: what the guided runs reach at their budget, and what random search needs for it.
    final = statistics.median(float(c[-1]) for c in curves)
    expected, hits = expected_random_trials(pooled, final)
    figures["median_final_us"] = final
    figures["random_trials_for_median_final"] = {"expected": expected, "hits": hits}
    print(f"  {spec} median best after {trials} trials: {final:.2f} µs; random search "
          + (f"needs {expected:.0f} trials expected ({hits} hits in {len(pooled)})" if hits
             else f"never got there in {len(pooled)}"))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--search", nargs="+", default=["xgb"], metavar="SPEC",
                        help="model-guided search specs to run, each --seeds times (farm tune --search: xgb, "
                        "xgb:screen=16, ...), against the same random runs")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each --search spec (seeds 0, 1, ...); 0: "
                        "random runs only, for a later --merge (one GPU's share of a case)")
    parser.add_argument("--trials", type=int, default=128, help="trials of each guided run")
    parser.add_argument("--random-trials", type=int, default=384)
    parser.add_argument("--random-seeds", type=int, default=3, help="random runs (seeds 1000, 1001, ...); 0: guided "
                        "runs only, for a later --merge")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed of the guided runs (then N+1, ...) "
                        "and, plus 1000, of the random runs: a case's runs spread over several GPUs, each taking its "
                        "own seeds, for a later --merge")
    parser.add_argument("--history", type=Path, help="a store of other shapes of the family each guided run starts "
                        "from (a copy of it); default: a new store")
    parser.add_argument("--out", type=Path, default=Path("/tmp/farm-search"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--reread", action="store_true", help="run nothing: work the figures out from the stores "
                        "already in --out (OUT/xgb-0.db, OUT/random-1000.db, ...), each as far as its job got (a "
                        "GPU session cut off); runs without a store are left out")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="run nothing: the figures of the runs "
                        "of these JSONs of one case together (a case's guided and random runs made on two GPUs at "
                        "once, each with --seeds 0 or --random-seeds 0); --workload, --search and --trials are "
                        "taken from them")
    parser.add_argument("--pool", action="store_true", help="with --merge: the JSONs are of different sessions "
                        "(leases) of one case, so seeds repeat across them and each guided run counts as its own "
                        "(a random run of a seed already pooled draws the same configs: left out); their runs were "
                        "on different machines, so the figures are an estimate, not one session's measure")
    args = parser.parse_args()
    if args.pool and not args.merge:
        raise SystemExit("farm_search: --pool only goes with --merge (JSONs of several sessions to pool)")
    if args.seeds < 0 or args.random_seeds < 0:
        raise SystemExit("farm_search: --seeds and --random-seeds are counts of runs, 0 or more")
    if args.first_seed < 0 or args.first_seed + args.seeds > 1000:
        # Guided runs begin as random search with their own seed: one of 1000 or more would share its
        # first configs with the random run of that seed.
        raise SystemExit(f"farm_search: --first-seed {args.first_seed} with --seeds {args.seeds}: the guided seeds "
                         "must lie in 0 to 999 (1000 and up are the random runs')")
    if args.merge:
        try:
            case = merged(args.merge, args.pool)
        except FarmError as e:
            raise SystemExit(f"farm_search: {e}") from None
        args.out.mkdir(parents=True, exist_ok=True)
        report(*case, args.out, args.json)
        return
    workload = make_workload(args.workload, dict(p.split("=", 1) for p in args.params) or None)
    try:
        for spec in args.search:
            if not parse_search(spec)[0].guided:
                raise FarmError(f"--search {spec}: not a model-guided search; the random runs are --random-seeds")
        if len(set(args.search)) != len(args.search):
            raise FarmError(f"--search {' '.join(args.search)}: a spec given twice")
        history = check_history(args.history, workload, args.target) if args.history else None
    except FarmError as e:
        raise SystemExit(f"farm_search: {e}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{workload} on {args.target}: {args.seeds} runs of {args.trials} trials of {', '.join(args.search)}"
          + (f", each starting from {history}" if history else "") + f", random search {args.random_trials}",
          flush=True)
    runs = []

    def run(search: str, seed: int, trials: int, name: str, history: Path | None = None) -> None:
        """One `farm tune` run recorded in `runs`. With --reread, the run's store as it is in OUT (left
        out if there is none), and no wall seconds."""
        seconds: float | None = None
        if args.reread:
            db = args.out / f"{name}.db"
            if not db.is_file():
                print(f"  {search} seed {seed}: no store {db}; left out", flush=True)
                return
        else:
            seconds, db = farm_tune(args.workload, args.params, args.target, trials, search, seed, args.out, name,
                                    history=history)
        curve, statuses = farm_curve(db)
        store = open_store(f"sqlite:///{db}")
        job = store.jobs(limit=1)[0]
        job_id = job["id"]
        trials = store.trials(job_id=job_id)
        # A trial handed out in round r could be proposed by the model retrained when round r - 1
        # closed, at best: the trials that model learnt from (None before the first close).
        closed = {row["round"]: row["trials"] for row in store.rounds(store.tasks(job_id)[0]["id"])}
        latency = trials["latency"].to_numpy(dtype=float) * 1e6
        # The device's share of the job's wall time with a candidate on it, and inside timed runs:
        # whether the devices waited for builds. Only of a job that ended (--reread: one cut off has
        # no end to measure its wall time to).
        use = utilisation(store, job_id) if job["finished_at"] is not None else None
        job_wall = use.wall_seconds if use else None
        measuring = sum(use.measuring_seconds.values()) / job_wall if use and job_wall else None
        busy = sum(use.busy_seconds.values()) / job_wall if use and job_wall else None
        runs.append({"search": search, "seed": seed, "wall_s": seconds, "job_wall_s": job_wall,
                     "measuring_share": measuring, "busy_share": busy, "statuses": statuses, "curve_us": curve,
                     # Every trial's config and latency, so that the figures can be worked out again
                     # from the JSON alone (a GPU session brings back no store over 8 MB:
                     # bench/gpu_collect.sh), and bench/search_screening.py can study the model on them.
                     "config_index": [int(i) for i in trials["config_index"]],
                     "latency_us": [None if np.isnan(v) else float(v) for v in latency],
                     "origin": [o if isinstance(o, str) else None for o in trials["origin"]],
                     "model_trials": [closed.get(int(r) - 1) for r in trials["round"]]})
        print(f"  {search} seed {seed}: best {np.nanmin(curve):.2f} µs in {len(trials)} trials"
              + ("" if seconds is None else f", {seconds:.0f} s")
              + (f" (the job {job_wall:.0f} s, a candidate on the device {measuring or 0:.0%} of it, in timed runs "
                 f"{busy or 0:.0%})" if use else " (its job did not end)"), flush=True)

    # Guided and random runs take turns (seed 0 of every spec, random 1000, seed 1, random 1001, ...):
    # a session cut off has random runs to measure the guided ones against (one that ran every guided
    # run first lost them all with its machine, docs/benchmarks/kernels-2026-11-27e.md). Seeds 1000,
    # 1001, ...: guided runs start as random search with their own seed until a model exists, and
    # would share their first configs with a random run of the same seed.
    for turn in range(max(args.seeds, args.random_seeds)):
        seed = args.first_seed + turn
        for spec in args.search if turn < args.seeds else []:
            run(spec, seed, args.trials, f"{run_name(spec)}-{seed}", args.history)
        if turn < args.random_seeds:
            run("random", 1000 + seed, args.random_trials, f"random-{1000 + seed}")
    report(str(workload), args.target, history, args.search, args.trials, runs, args.out, args.json)


def report(workload: str, target: str, history: str | None, specs: list[str], trials: int, runs: list[dict],
           out: Path, json_path: Path | None) -> None:
    """Print and write (`json_path`) the figures of `runs` (`run`'s records, or those of JSONs
    --merge reads): each guided spec of `specs` against the random runs, in the order they ran, and
    the curves' plot (OUT/curves.png). Runs of one side only (--seeds 0 or --random-seeds 0, one
    GPU's share of a case) are written without figures, for a later --merge."""
    if not runs:
        raise SystemExit(f"farm_search: no run to report (--reread: no store in {out})")
    # Each trial's latency as the figures take it: inf where it failed (None in the record).
    trial_us = {id(r): np.array([np.inf if v is None else v for v in r["latency_us"]]) for r in runs}
    samples = {run_label(r): trial_us[id(r)] for r in runs if r["search"] == "random"}
    guided = [spec for spec in specs if any(r["search"] == spec for r in runs)]
    # Each run's best-so-far curve as JSON and the plot take it (None before a first result) and
    # as the figures take it (inf there): a run's record has NaN there, a JSON's None.
    listed = {id(r): [None if v is None or np.isnan(v) else float(v) for v in r["curve_us"]] for r in runs}
    curves = {key: np.array([np.inf if v is None else v for v in curve]) for key, curve in listed.items()}
    best = min(float(np.min(c)) for c in curves.values())
    print(f"best of all runs: {best:.2f} µs")
    figures: dict = {"workload": workload, "target": target, "history": history, "best_us": best, "searches": {}}
    if samples and guided:
        figures["searches"] = {
            spec: guided_figures(spec, [curves[id(r)] for r in runs if r["search"] == spec],
                                 [trial_us[id(r)] for r in runs if r["search"] == spec],
                                 [r["origin"] for r in runs if r["search"] == spec],
                                 [r["model_trials"] for r in runs if r["search"] == spec], samples, best, trials)
            for spec in guided}
    else:
        print("only " + ("random" if samples else "guided") + " runs here: nothing to compare; merge this JSON with "
              "one of the other side's runs of the same case (--merge A.json B.json)")
    figures["runs"] = [{**r, "curve_us": listed[id(r)]} for r in runs]
    label = f"{workload} on {target}"
    walls = [r["wall_s"] or r["job_wall_s"] for r in runs]  # --reread: the job's, none for one cut off
    plot = plot_curves([Curve(f"{r['search']} {run_label(r)} ({f'{wall:.0f} s' if wall else 'cut off'})", label,
                              listed[id(r)], r["search"])
                        for r, wall in zip(runs, walls, strict=True)], out / "curves.png")
    print(f"tuning curves: {plot}")
    if json_path:
        json_path.write_text(json.dumps(figures, indent=1))


def merged(paths: list[Path], pool: bool = False) -> tuple[str, str, str | None, list[str], int, list[dict]]:
    """(workload, target, history, guided specs, guided trials, runs) of farm_search JSONs of one case,
    their runs in the order given; FarmError if they are of different cases or settings. With `pool`
    the JSONs are of different sessions, where seeds repeat: each run is marked with its JSON's
    position (1, 2, ...) as `session`. A guided run counts as its own: runs of one seed share their
    unguided first trials, then part as their measurements differ. A random run of a seed already
    pooled is left out, and said so: the random search draws a seed's configs alike in every
    session, only measured in another order, so it would count one sample twice."""
    loaded = []
    for path in paths:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise FarmError(f"--merge {path}: not a farm_search JSON ({e})") from None
    cases = {(d.get("workload"), d.get("target"), d.get("history")) for d in loaded}
    if len(cases) != 1 or any("runs" not in d for d in loaded):
        raise FarmError("--merge: give JSONs of one workload, target and history, each with its runs; got "
                        + "; ".join(f"{p}: {d.get('workload')} on {d.get('target')}" for p, d in zip(paths, loaded,
                                                                                                  strict=True)))
    runs = [{**r, "session": k} if pool else r for k, d in enumerate(loaded, start=1) for r in d["runs"]]
    seen = [(r.get("session"), r["search"], r["seed"]) for r in runs]
    if len(set(seen)) != len(seen):
        raise FarmError("--merge: a run is in two of the JSONs (the same search and seed); give each run once, "
                        "or add --pool if the JSONs are of different sessions")
    if pool:
        first: dict[int, dict] = {}
        for r in (r for r in runs if r["search"] == "random"):
            if first.setdefault(r["seed"], r) is not r:
                print(f"random seed {r['seed']} of JSON {r['session']}: the configs of seed {r['seed']} of JSON "
                      f"{first[r['seed']]['session']} again, left out of the pool")
        runs = [r for r in runs if r["search"] != "random" or first[r["seed"]] is r]
    specs = list(dict.fromkeys(r["search"] for r in runs if r["search"] != "random"))
    trials = max((len(r["curve_us"]) for r in runs if r["search"] != "random"), default=0)
    workload, target, history = cases.pop()
    return workload, target, history, specs, trials, runs

if __name__ == "__main__":
    main()
