"""The metrics of a real farm: a real Prometheus scrapes a `farm scheduler` service and its two
worker actors while they run a real llvm job. Meanwhile each process's own exposition (its `farm_`
families: Ray's and Python's are not the farm's to lint) passes `promtool check metrics`;
afterwards every query of every dashboard panel (Grafana variables substituted) returns data
for the time the job ran, and scripts/render_dashboards.py draws the three dashboards from it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.prom import (
    ROOT,
    dashboard_queries,
    farm_families,
    has_finite_value,
    promtool,
    real_farm,
    running_prometheus,
    scrape,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_a_real_jobs_metrics_pass_promtool_and_fill_every_panel(tmp_path: Path) -> None:
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "farm").mkdir()
    with real_farm(tmp_path / "farm") as farm, running_prometheus(farm.targets, tmp_path / "prometheus") as prometheus:
        assert len(farm.targets["worker"]) == 2
        start = time.time()
        job = farm.submit(48)
        # The scheduler serves a running job's series only while it runs: read each process's
        # exposition once the scheduler shows the job's progress.
        scheduler = farm.targets["scheduler"][0]
        wait_for(lambda: "farm_task_trials_done{" in scrape(scheduler), 300, "the running job's series", 0.1)
        expositions = {address: farm_families(scrape(address))
                       for addresses in farm.targets.values() for address in addresses}
        assert job.wait(progress=False, timeout=600) == "done"
        time.sleep(3)  # scrapes after the job's end, while its series linger (metrics.JOB_SERIES_LINGER_SECONDS)
        end = time.time()
        for address, text in expositions.items():
            result = promtool("check", "metrics", stdin=text)
            assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
                f"{address}: {result.stdout}{result.stderr}")
        assert "farm_task_trials_done{" in expositions[scheduler]
        assert all("farm_trials_total{" in expositions[w] and "farm_worker_up{" in expositions[w]
                   for w in farm.targets["worker"])

        queries = dashboard_queries({"job": str(job.id)})
        assert len(queries) >= 20
        # A job's series are removed a while after it ends: instant panels are read as of the last
        # evaluation at which Prometheus still had the job's progress (a fixed time before the end
        # missed every scrape of a job that ran in a few seconds), range panels over its run and
        # the scrapes after it (a short model job's estimated latency is set at its last slice).
        progress = f'farm_task_trials_done{{job_id="{job.id}"}}'

        def last_seen() -> float | None:
            times = [float(t) for series in prometheus.query_range(progress, start, end, 0.5)
                     for t, _ in series["values"]]
            return max(times) if times else None

        at = wait_for(last_seen, 30, "the job's progress in Prometheus")

        def empty() -> list[str]:
            return [q.name for q in queries if not has_finite_value(
                prometheus.query(q.expr, at=at) if q.instant else
                prometheus.query_range(q.expr, start, end, 1))]

        try:
            wait_for(lambda: not empty(), 30, "every panel query returning data")
        except TimeoutError:
            pytest.fail(f"panel queries without data: {empty()}")

        render = subprocess.run([sys.executable, str(ROOT / "scripts" / "render_dashboards.py"), "--prometheus",
                                 prometheus.url, "--job", str(job.id), "--since", f"{time.time() - start:.0f}",
                                 "--out", str(tmp_path / "png")], capture_output=True, text=True, timeout=300)
        assert render.returncode == 0, render.stderr
        pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
        assert pngs == ["farm-job.png", "farm-overview.png", "farm-workers.png"]
        assert all((tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG" for name in pngs)
