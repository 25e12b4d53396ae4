"""Draw each Grafana dashboard's panels as one PNG, with matplotlib, from Prometheus range queries.

No Grafana server runs here, so docs/observability.md shows the dashboards this way: every
panel's queries (deploy/grafana/dashboards/*.json, variables substituted as Grafana would) are
run with `query_range` against a real Prometheus and drawn, heatmaps as heatmaps, tables left out.

    .venv/bin/python scripts/render_dashboards.py --run-job      # a real job here (docs/observability/)
    .venv/bin/python scripts/render_dashboards.py --prometheus http://127.0.0.1:9090 --job 12 --since 3600
    .venv/bin/python scripts/render_dashboards.py                # a synthetic farm (tests/prom.py), 120 s

`--run-job` starts a real farm on this machine (tests/prom.py `real_farm`: a `farm scheduler` and
two llvm worker actors, SQLite in a temporary folder) and a Prometheus scraping its three
processes every second, runs one job of `--trials` trials of a 64x64x64 matmul on both workers,
and draws the job's whole run. `--prometheus` reads that Prometheus's last `--since` seconds of
job `--job`. With neither it starts the synthetic farm and a Prometheus scraping it, and draws
`--since` seconds after a minute of warm-up (the rate window).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.prom import (  # noqa: E402
    REAL_KERNEL,
    Prometheus,
    load_dashboards,
    panels,
    real_farm,
    running_prometheus,
    substitute,
    synthetic_farm,
)

# Grafana unit -> (factor, axis label); seconds are scaled by `scale`.
_UNITS = {"percentunit": (100.0, "%"), "flops": (1e-9, "GFLOP/s"), "short": (1.0, "")}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# The rate window: a range query's first minute would show rates still filling their window.
WARM_UP_SECONDS = 60.0


def scale(unit: str, peak: float) -> tuple[float, str]:
    """Factor and axis label for values of Grafana `unit` whose largest magnitude is `peak`."""
    if unit == "s":
        return (1e3, "ms") if peak < 1 else (1.0, "s") if peak < 600 else (1 / 60, "min")
    return _UNITS.get(unit, (1.0, unit))


def legend(template: str, labels: Mapping[str, str], expr: str) -> str:
    """Grafana's legend: `{{label}}` replaced; `__auto` or empty: the series' labels."""
    if template in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in labels.items() if k not in ("job", "instance")) or expr[:40]
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def draw_heatmap(ax: Any, series: list[dict[str, Any]]) -> None:
    """Cumulative `le` buckets per time step, drawn as the count in each bucket (Grafana's heatmap format)."""
    buckets = sorted(series, key=lambda s: float(s["metric"]["le"]))
    if not buckets:
        return
    times = [float(t) for t, _ in buckets[0]["values"]]
    cumulative = [[float(v) for _, v in s["values"]][:len(times)] for s in buckets]
    counts = [[c - (cumulative[i - 1][j] if i else 0.0) for j, c in enumerate(row)] for i, row in enumerate(cumulative)]
    ax.imshow(counts, aspect="auto", origin="lower", cmap="Oranges",
              extent=(0, times[-1] - times[0], -0.5, len(buckets) - 0.5))
    labels = [s["metric"]["le"] for s in buckets]
    ax.set_yticks(range(len(labels))[::2], labels[::2])
    ax.set_ylabel("le (s)")


def _right_axis_units(panel: dict[str, Any]) -> dict[str, str]:
    """refId -> unit of the queries a panel override puts on the right axis."""
    right = {}
    for override in panel["fieldConfig"].get("overrides", []):
        props = {p["id"]: p["value"] for p in override["properties"]}
        if override["matcher"]["id"] == "byFrameRefID" and props.get("custom.axisPlacement") == "right":
            right[override["matcher"]["options"]] = props.get("unit", "short")
    return right


def draw_panel(ax: Any, prometheus: Prometheus, panel: dict[str, Any], variables: Mapping[str, str],
               start: float, end: float, step: float) -> None:
    ax.set_title(panel["title"], fontsize=10)
    ax.set_xlabel("seconds")
    right = _right_axis_units(panel)
    # side -> (unit, [(legend, [(t, value), ...]), ...]): each axis is scaled once, for all its lines.
    sides: dict[str, tuple[str, list[tuple[str, list[tuple[float, float]]]]]] = {}
    for target in panel["targets"]:
        series = prometheus.query_range(substitute(target["expr"], variables), start, end, step)
        if panel["type"] == "heatmap":
            draw_heatmap(ax, series)
            continue
        side = "right" if target["refId"] in right else "left"
        unit = right.get(target["refId"]) or panel["fieldConfig"]["defaults"].get("unit", "short")
        lines = sides.setdefault(side, (unit, []))[1]
        lines += [(legend(target.get("legendFormat", ""), s["metric"], target["expr"]),
                   [(float(t) - start, float(v)) for t, v in s["values"] if math.isfinite(float(v))])
                  for s in series]
    handles = []
    for side, (unit, lines) in sides.items():
        side_ax = ax.twinx() if side == "right" else ax
        factor, label = scale(unit, max((abs(v) for _, points in lines for _, v in points), default=0.0))
        for name, points in lines:
            if points:
                handles += side_ax.plot([t for t, _ in points], [v * factor for _, v in points], linewidth=1,
                                        linestyle="--" if side == "right" else "-", label=name)
        side_ax.set_ylabel(label)
        side_ax.tick_params(labelsize=8)
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="best")


def render(prometheus: Prometheus, variables: Mapping[str, str], start: float, end: float, out: Path,
           note: str) -> list[Path]:
    """One PNG per dashboard in `out`, every panel but tables; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    step = max(1.0, (end - start) / 240)
    written = []
    for stem, dashboard in load_dashboards().items():
        drawn = [p for p in panels(dashboard) if p["type"] != "table"]
        rows = math.ceil(len(drawn) / 2)
        fig, axes = plt.subplots(rows, 2, figsize=(13, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, drawn, strict=False):
            draw_panel(ax, prometheus, panel, variables, start, end, step)
        for ax in list(axes.flat)[len(drawn):]:
            ax.axis("off")
        fig.suptitle(f"{dashboard['title']} — {note}", fontsize=12)
        fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def render_real_job(trials: int, out: Path) -> list[Path]:
    """Run a real job of `trials` trials on a real farm scraped by a real Prometheus (see the
    module docstring), showing its progress on stderr; draw its run into `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "farm").mkdir()
        (workdir / "prometheus").mkdir()
        with real_farm(workdir / "farm") as farm, \
                running_prometheus(farm.targets, workdir / "prometheus") as prometheus:
            start = time.time()
            job = farm.submit(trials)
            if job.wait(progress=True) != "done":
                raise RuntimeError(f"job {job.id} did not finish: {job.status()['status']}")
            end = time.time()
            time.sleep(3)  # the job's last scrapes
            (name, params), = REAL_KERNEL
            kernel = f"{name} " + "x".join(str(v) for v in params.values())
            note = (f"real job: {trials} trials of {kernel} on {farm.workers} llvm workers, "
                    f"{datetime.now(UTC):%Y-%m-%d}, {os.cpu_count()}-core CPU")
            return render(prometheus, {"job": str(job.id)}, start, end, out, note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run-job", action="store_true", help="run a real job on a real farm here and draw it")
    source.add_argument("--prometheus", help="URL of a Prometheus with a real farm's data (default: synthetic)")
    parser.add_argument("--trials", type=int, default=1500, help="with --run-job: the job's trials")
    parser.add_argument("--job", help="with --prometheus: the job id for the Job dashboard's $job")
    parser.add_argument("--since", type=float, default=120.0, help="seconds of data to draw")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "observability")
    args = parser.parse_args()
    if args.run_job:
        paths = render_real_job(args.trials, args.out)
    elif args.prometheus:
        if args.job is None:
            parser.error("--prometheus needs --job")
        end = time.time()
        paths = render(Prometheus(args.prometheus.rstrip("/")), {"job": args.job}, end - args.since, end, args.out,
                       f"job {args.job}")
    else:
        with tempfile.TemporaryDirectory() as tmp, synthetic_farm() as farm, \
                running_prometheus(farm.targets, Path(tmp)) as prometheus:
            start = time.time() + WARM_UP_SECONDS
            time.sleep(WARM_UP_SECONDS + args.since)
            paths = render(prometheus, {"job": str(farm.job_id)}, start, time.time(), args.out,
                           "synthetic data (tests/prom.py SyntheticFarm), not a real job")
    for path in paths:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
