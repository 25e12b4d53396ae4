"""Seeing the model learn and the devices work: tuning curves and timelines (`farm report`), the
rounds and the devices' busy share of a job (`farm status`).

A tuning curve is the best latency found so far against the number of trials, one line per
task of each job, so jobs that tuned the same workload with different searches (random, xgb)
can be compared on one plot. The round summary lists, per task and round, the trials so far,
the best latency, and the Spearman rank correlation of the cost model that guided the round
with what the round measured (recorded by scheduler.retrain).

A job's timeline (from each trial's MeasureResult.timeline) has one lane per worker (when it
measured, and, darker, when it was inside timed kernel runs) and one per build slot (when it
compiled). A device's busy share is its time inside timed kernel runs (TVM's time_evaluator
calls, the screening probe included) over the job's wall time, from the moment a scheduler
claimed it to its end: start-up, compilation the device waits for, uploads, checks and the
scheduler's rounds all count against it.

A job's pace (`farm status`, `farm top`): its throughput, trials per second over the job so far
(the trials stored since a scheduler claimed it, over the seconds since then); its recent rate,
the trials stored in the last RECENT_SECONDS over those seconds; and its ETA, the trials left
of its budget over the recent rate, so that the ETA follows what the farm does now rather than
a start-up that was slower than the rest.
"""

from __future__ import annotations

import textwrap
import time
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from db.store import ResultStore
from farm.core.errors import FarmError
from farm.core.files import replacing, writable_file
from farm.core.workloads import workload_label
from farm.progress import format_seconds


@dataclass
class Curve:
    """Best latency so far (µs; NaN before the first correct trial) after each trial of one task.
    `group` names the setting the curve is one run of (a search spec), for plots of many runs."""

    label: str
    workload: str
    best_us: np.ndarray
    group: str = ""

    @property
    def trials(self) -> np.ndarray:
        return np.arange(1, len(self.best_us) + 1)


def best_so_far(latency: np.ndarray) -> np.ndarray:
    """The best latency after each trial of `latency` (failed trials NaN or inf); NaN until the
    first correct trial."""
    best = np.minimum.accumulate(np.where(np.isnan(latency), np.inf, latency))
    return np.where(np.isinf(best), np.nan, best)


def _job(store: ResultStore, job_id: int) -> dict[str, Any]:
    job = store.job(job_id)
    if job is None:
        raise FarmError(f"no job {job_id} in the database; `farm jobs` lists the jobs")
    return job


def _workload(task: dict[str, Any]) -> str:
    doc = task["workload"]
    if doc["name"] != "tir":
        doc = {**doc, "params": {k: v for k, v in doc["params"].items() if k != "dtype"}}
    return f"{workload_label(doc)} on {task['target_kind']}"


def tuning_curves(store: ResultStore, job_ids: list[int]) -> list[Curve]:
    """One curve per task of each job, trials in the order they were stored.

    `store` is a db.store.ResultStore; FarmError for a job that does not exist.
    """
    curves = []
    for job_id in job_ids:
        job = _job(store, job_id)
        trials = store.trials(job_id=job_id)
        for task in job["tasks"]:
            latency = trials.loc[trials["task_id"] == task["id"], "latency"].to_numpy(dtype=np.float64)
            best = best_so_far(latency * 1e6)
            label = f"job {job_id} ({job['search']})"
            if len(job["tasks"]) > 1:
                label += f" task {task['id']}"
            curves.append(Curve(label, _workload(task), best))
    return curves


def model_curve(store: ResultStore, job_id: int) -> Curve:
    """A model job's estimated latency (µs: Σ calls x best latency so far of each kernel,
    farm.core.allocation.model_latency) after each of its trials, in the order they were stored;
    NaN until every kernel has a correct trial. FarmError for a job that does not exist."""
    from farm.core.allocation import model_kernels

    job = _job(store, job_id)
    kernel_of = {t["id"]: t["workload_key"] for t in job["tasks"]}
    weight = {k: w for k, w in ((t["workload_key"], int(t.get("weight", 1))) for t in job["tasks"])}
    best: dict[str, float] = {}
    trials = store.trials(job_id=job_id)
    out = np.full(len(trials), np.nan)
    for i, (task_id, latency) in enumerate(zip(trials["task_id"], trials["latency"], strict=True)):
        key = kernel_of[task_id]
        if np.isfinite(latency) and latency < best.get(key, np.inf):
            best[key] = latency
        if len(best) == len(weight):
            out[i] = sum(weight[k] * b for k, b in best.items()) * 1e6
    name = (job["spec"].get("model") or {}).get("name", "model")
    return Curve(f"job {job_id} ({job['search']}, {len(model_kernels(job['tasks']))} kernels)",
                 f"model {name}: estimated latency (Σ calls x best)", out)


def plot_tuning_curves(store: ResultStore, job_ids: list[int], output: str | Path) -> Path:
    """Write the jobs' tuning curves to the PNG `output`, one panel per workload (a model job's
    estimated model latency first, in a panel of its own); returns its path.

    FarmError for an unknown job, a folder that does not exist, or nothing measured yet.
    """
    models = [model_curve(store, j) for j in job_ids if _job(store, j)["spec"].get("model")]
    curves = [c for c in [*models, *tuning_curves(store, job_ids)] if len(c.best_us)]
    if not curves:
        raise FarmError(f"job(s) {', '.join(map(str, job_ids))} have no measured trials yet: nothing to plot")
    return plot_curves(curves, output)


# More lines than this in one panel and their legend hides the curves: a panel whose curves all
# name a group then draws one median line per group instead, with its p10-p90 band.
MAX_LINES = 8


def plot_curves(curves: list[Curve], output: str | Path) -> Path:
    """Write `curves` (best latency against trials) to the PNG `output`, one panel per workload
    (drawn by draw_panel); returns its path. FarmError if `output` cannot be written (checked first;
    the file is written whole or not at all)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    path = writable_file(output)
    workloads = list(dict.fromkeys(c.workload for c in curves))
    fig, axes = plt.subplots(len(workloads), 1, figsize=(7, 3.2 * len(workloads)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads, strict=True):
        draw_panel(ax, [c for c in curves if c.workload == workload])
        ax.set_title(textwrap.fill(workload, 80), fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    return path


def draw_panel(ax: Any, panel: list[Curve]) -> None:
    """Draw `panel` on the matplotlib Axes `ax`: one step line per curve, or, where there are more
    than MAX_LINES curves and all have a group, one per group: the median over its curves at each
    trial that all of them reached, in a band from their 10th to 90th percentile."""
    if len(panel) > MAX_LINES and all(c.group for c in panel):
        for group in dict.fromkeys(c.group for c in panel):
            runs = [c.best_us for c in panel if c.group == group]
            best = np.vstack([b[: min(map(len, runs))] for b in runs])
            trials = np.arange(1, best.shape[1] + 1)
            with warnings.catch_warnings():  # trials before any run's first correct one: NaN, as wanted
                warnings.simplefilter("ignore", RuntimeWarning)
                median, low, high = np.nanmedian(best, axis=0), *np.nanpercentile(best, [10, 90], axis=0)
            line, = ax.step(trials, median, where="post", label=f"{group}: median of {len(runs)} runs, p10-p90")
            ax.fill_between(trials, low, high, step="post", alpha=0.2, color=line.get_color())
    else:
        for c in panel:
            ax.step(c.trials, c.best_us, where="post", label=c.label)
    ax.set_xlabel("trials")
    ax.set_ylabel("best latency (µs, log scale)")
    ax.set_yscale("log")  # the first trials are often 10-100x slower than the best
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def job_rounds(store: ResultStore, job_id: int) -> list[dict[str, Any]]:
    """Per task of the job: its id, workload, and its rounds (rows of store.rounds)."""
    job = _job(store, job_id)
    return [{"task_id": t["id"], "workload": _workload(t), "rounds": store.rounds(t["id"])} for t in job["tasks"]]


def rounds_summary(store: ResultStore, job_id: int) -> str:
    """The job's rounds as text: per task, one line per round (trials, best µs, rank corr, model),
    then what proposed its trials (`origins_summary`)."""
    lines = []
    for task in job_rounds(store, job_id):
        lines.append(f"task {task['task_id']}: {task['workload']}")
        if not task["rounds"]:
            lines.append("  no round closed yet")
            continue
        lines.append(f"  {'round':>5} {'trials':>7} {'best µs':>10} {'rank corr':>9} {'model':>6}")
        for r in task["rounds"]:
            best = "-" if r["best_latency"] is None else f"{r['best_latency'] * 1e6:.2f}"
            corr = "-" if r["rank_corr"] is None else f"{r['rank_corr']:.2f}"
            model = "-" if r["model_id"] is None else str(r["model_id"])
            lines.append(f"  {r['round']:>5} {r['trials']:>7} {best:>10} {corr:>9} {model:>6}")
        origins = origins_summary(store.trials(task_id=task["task_id"]))
        if origins:
            lines.append(f"  {origins}")
    return "\n".join(lines)


def origins_summary(trials: pd.DataFrame) -> str:
    """What proposed a task's trials (store.trials' frame, in the order measured), in one line:
    per origin (farm.core.search.ORIGINS) its trials and their best, then which origin found the
    best and at which trial. Empty when no trial says (stored before origins were kept)."""
    known = trials[trials["origin"].notna()]
    if known.empty:
        return ""
    parts = []
    for origin, group in known.groupby("origin", sort=False):
        best = group["latency"].min()
        parts.append(f"{origin} {len(group)}" + ("" if pd.isna(best) else f" (best {best * 1e6:.2f} µs)"))
    ok = trials["latency"].notna()
    found = ""
    if ok.any():
        at = int(np.argmin(trials["latency"].where(ok, np.inf).to_numpy()))
        origin = trials["origin"].iloc[at]
        found = f"; the best by {'an unknown origin' if pd.isna(origin) else origin}, at trial {at + 1}"
    return "trials by origin: " + ", ".join(parts) + found


@dataclass
class Utilisation:
    """Where a job's wall time went: `wall_seconds` from its claim to its end (or now),
    `busy_seconds` inside timed kernel runs per worker, `measuring_seconds` per worker with a
    candidate on its device (upload, load, check and timed runs: the rest of the wall time the
    device waited for work), `first_trial_seconds` from its claim to its first stored trial,
    every built candidate's build seconds, and every measured candidate's `overhead_seconds`
    (its time on the device outside its timed runs)."""

    wall_seconds: float
    busy_seconds: dict[str, float]
    first_trial_seconds: float | None
    build_seconds: list[float]
    measuring_seconds: dict[str, float]
    overhead_seconds: list[float]

    @property
    def busy_share(self) -> dict[str, float]:
        return {w: b / self.wall_seconds for w, b in self.busy_seconds.items()} if self.wall_seconds > 0 else {}

    def summary(self) -> str:
        """One line: busy share per worker, first trial, build seconds."""
        busy = ", ".join(f"{w} {share:.0%}" for w, share in sorted(self.busy_share.items())) or "none yet"
        first = "-" if self.first_trial_seconds is None else f"{self.first_trial_seconds:.1f} s"
        builds = np.array(self.build_seconds)
        build = f"{builds.mean():.2f} s mean, {np.percentile(builds, 95):.2f} s p95" if len(builds) else "-"
        return f"devices busy (in timed runs) {busy} of {self.wall_seconds:.0f} s; first trial after {first}; " \
               f"builds {build}"


def _claimed_span(job: dict[str, Any], now: float) -> tuple[float | None, float]:
    """Unix times of the job's claim (None before one) and of its end, or `now` while it has none."""
    start = job["started_at"].timestamp() if job["started_at"] else None
    end = job["finished_at"].timestamp() if job["finished_at"] else now
    return start, end


def utilisation(store: ResultStore, job_id: int) -> Utilisation:
    """The job's Utilisation (see the module docstring). FarmError for an unknown job."""
    job = _job(store, job_id)
    trials = store.trials(job_id=job_id)
    start, end = _claimed_span(job, time.time())
    busy: dict[str, float] = {}
    measuring: dict[str, float] = {}
    builds, overheads = [], []
    for worker, timeline in zip(trials["worker"], trials["timeline"], strict=True):
        timeline = timeline or {}
        timed = sum(b - a for a, b in timeline.get("timed", []))
        busy[worker] = busy.get(worker, 0.0) + timed
        if "build" in timeline:
            builds.append(timeline["build"][1] - timeline["build"][0])
        if "measure" in timeline:
            span = timeline["measure"][1] - timeline["measure"][0]
            measuring[worker] = measuring.get(worker, 0.0) + span
            if timed:
                overheads.append(span - timed)
    first = None
    if start is not None and len(trials):
        first = trials["created_at"].min().timestamp() - start
    return Utilisation(end - start if start is not None else 0.0, busy, first, builds, measuring, overheads)


RECENT_SECONDS = 60.0


@dataclass
class Pace:
    """How fast a job measures (see the module docstring). Of its `trials` (of `budget`),
    `since_claim` were stored in the `wall_seconds` from its claim to its end (or now), and
    `recent` in the last `recent_seconds` of those (RECENT_SECONDS, fewer for a younger claim).
    A job not claimed, or queued again, has no pace yet: every figure 0."""

    state: str
    trials: int
    budget: int
    wall_seconds: float
    since_claim: int
    recent: int
    recent_seconds: float

    @property
    def throughput(self) -> float | None:
        """Trials per second over the job so far; None before a claim."""
        return self.since_claim / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def recent_rate(self) -> float | None:
        """Trials per second over the last `recent_seconds`; None before a claim."""
        return self.recent / self.recent_seconds if self.recent_seconds > 0 else None

    @property
    def eta_seconds(self) -> float | None:
        """Seconds to the budget: the trials left over `recent_rate` while the job runs, 0 once it
        is done; None when it cannot be said (queued, failed, cancelled, or no trial stored in the
        recent window)."""
        if self.state == "done":
            return 0.0
        if self.state != "running" or not self.recent_rate:
            return None
        return max(self.budget - self.trials, 0) / self.recent_rate

    def eta(self) -> str:
        """The ETA for people: a duration while the job runs; `-` when it cannot be said, or the
        job is not running."""
        eta = self.eta_seconds
        return "-" if eta is None or self.state != "running" else format_seconds(eta)

    def summary(self) -> str:
        """One line: throughput over the job so far, the recent rate and, while it runs, the ETA."""
        if self.throughput is None or self.recent_rate is None:
            return "not started: no throughput or ETA yet"
        line = (f"throughput {self.throughput:.2f} trials/s over {format_seconds(self.wall_seconds)}; "
                f"{self.recent_rate:.2f} trials/s in its {'last' if self.state == 'running' else 'final'} "
                f"{format_seconds(self.recent_seconds)}")
        if self.state == "running":
            line += f"; ETA {self.eta()} ({max(self.budget - self.trials, 0)} trials left at that rate)"
        return line


def pace(store: ResultStore, job: dict[str, Any], now: float | None = None) -> Pace:
    """The Pace of `job` (a ResultStore.job document) at Unix time `now` (default: now)."""
    start, end = _claimed_span(job, time.time() if now is None else now)
    if start is None or job["status"] == "queued":
        return Pace(job["status"], job["trials"], job["trials_budget"], 0.0, 0, 0, 0.0)
    window = min(RECENT_SECONDS, end - start)

    def stored_since(t: float) -> int:
        return sum(row["trials"] for row in store.trial_activity(datetime.fromtimestamp(t, UTC), [job["id"]]))

    return Pace(job["status"], job["trials"], job["trials_budget"], end - start, stored_since(start),
                stored_since(end - window), window)


@dataclass
class WorkerActivity:
    """What one worker measured for some jobs: for `jobs`, `recent` trials per status in the last
    RECENT_SECONDS, and `last_at`, the Unix time its newest trial was stored."""

    name: str
    jobs: list[int]
    recent: dict[str, int]
    last_at: float


def worker_activity(store: ResultStore, jobs: list[dict[str, Any]], now: float | None = None) -> list[WorkerActivity]:
    """Per worker name, by name, its activity (WorkerActivity) on the claimed ones of `jobs`
    (ResultStore.job documents) since their claims, at Unix time `now` (default: now)."""
    now = time.time() if now is None else now
    claimed = [j for j in jobs if j["started_at"] is not None]
    if not claimed:
        return []
    ids = [j["id"] for j in claimed]
    found: dict[str, WorkerActivity] = {}

    def of(name: str) -> WorkerActivity:
        return found.setdefault(name, WorkerActivity(name, [], {}, 0.0))

    for row in store.trial_activity(min(j["started_at"] for j in claimed), ids):
        worker = of(row["worker"])
        if row["job_id"] not in worker.jobs:
            worker.jobs.append(row["job_id"])
        worker.last_at = max(worker.last_at, row["last_at"].timestamp())
    for row in store.trial_activity(datetime.fromtimestamp(now - RECENT_SECONDS, UTC), ids):
        recent = of(row["worker"]).recent
        recent[row["status"]] = recent.get(row["status"], 0) + row["trials"]
    return sorted(found.values(), key=lambda w: w.name)


def plot_timeline(store: ResultStore, job_id: int, output: str | Path) -> Path:
    """Draw the job's timeline (see the module docstring) to the PNG `output`; returns its path.
    FarmError for an unknown job, an output that cannot be written, or a job with no timed trial yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = writable_file(output)
    job = _job(store, job_id)
    trials = store.trials(job_id=job_id)
    timelines = [(w, t) for w, t in zip(trials["worker"], trials["timeline"], strict=True) if t]
    if not timelines or job["started_at"] is None:
        raise FarmError(f"job {job_id} has no trial with a timeline yet: nothing to draw")
    start = job["started_at"].timestamp()
    workers = sorted({w for w, _ in timelines})
    slots = sorted({t["slot"] for _, t in timelines if "slot" in t})
    lanes = [f"device {w}" for w in workers] + [f"build {s}" for s in slots]
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.32 * len(lanes)))
    for worker, t in timelines:
        lane = lanes.index(f"device {worker}")
        if "measure" in t:
            a, b = t["measure"]
            ax.broken_barh([(a - start, b - a)], (lane - 0.4, 0.8), color="#b8cce4")
        ax.broken_barh([(a - start, b - a) for a, b in t.get("timed", [])], (lane - 0.4, 0.8), color="#1f4e79")
        if "build" in t and "slot" in t:
            a, b = t["build"]
            ax.broken_barh([(a - start, b - a)], (lanes.index(f"build {t['slot']}") - 0.4, 0.8), color="#e6a23c")
    use = utilisation(store, job_id)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, use.wall_seconds)
    ax.set_xlabel("seconds since the job was claimed (light: measuring, dark: timed kernel runs, orange: compiling)")
    ax.set_title(textwrap.fill(f"job {job_id}: {use.summary()}", 130), fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    return path


def _save(fig: Any, path: Path) -> None:
    """Write the figure to `path` whole (farm.core.files.replacing), in the format its suffix names."""
    import matplotlib.pyplot as plt

    try:
        with replacing(path, suffix=path.suffix) as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
