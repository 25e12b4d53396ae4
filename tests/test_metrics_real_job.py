"""The dashboards against a real farm: a real Prometheus scrapes a `farm scheduler` service and its
two worker actors while they run a real llvm job; afterwards every query of every dashboard panel
(Grafana variables substituted) returns data for the time the job ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farm.client import Client
from tests.processes import stop
from tests.prom import dashboard_queries, free_port, has_finite_value, running_prometheus, wait_for

pytestmark = pytest.mark.slow
KERNEL = [("matmul", {"M": 64, "N": 64, "K": 64})]


def test_every_panel_query_returns_data_for_a_real_job(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/farm.db"
    targets_dir = tmp_path / "targets"
    targets_dir.mkdir()
    (tmp_path / "prometheus").mkdir()
    metrics_port = free_port()
    env = {**os.environ, "FARM_WORKER_METRICS_PORT": str(free_port()), "FARM_PROMETHEUS_TARGETS": str(targets_dir)}
    log = (tmp_path / "scheduler.log").open("wb")
    service = subprocess.Popen([sys.executable, "-m", "farm", "scheduler", "--db", db, "--metrics-port",
                                str(metrics_port), "--log-dir", str(tmp_path / "logs")],
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Client(db, in_process=False) as client:
            # A first job brings the two worker actors (and their /metrics) up.
            first = client.submit(KERNEL, "llvm", 4, workers=2, batch_size=2, search="random")
            assert first.wait(progress=False, timeout=300) == "done", (tmp_path / "scheduler.log").read_text()[-3000:]
            workers = [t for doc in (json.loads(p.read_text()) for p in targets_dir.glob("*.json"))
                       for group in doc for t in group["targets"]]
            assert len(workers) == 2
            targets = {"scheduler": [f"127.0.0.1:{metrics_port}"], "worker": workers}
            with running_prometheus(targets, tmp_path / "prometheus") as prometheus:
                start = time.time()
                job = client.submit(KERNEL, "llvm", 48, workers=2, batch_size=4, seed=1)
                assert job.wait(progress=False, timeout=600) == "done"
                end = time.time()
                time.sleep(3)  # the last scrapes of the job
                queries = dashboard_queries({"job": str(job.id)})
                assert len(queries) >= 20
                # Series of a running job are removed when it ends: instant panels are read as of
                # shortly before its end, range panels over the job's whole run.
                at = end - 3

                def empty() -> list[str]:
                    return [q.name for q in queries if not has_finite_value(
                        prometheus.query(q.expr, at=at) if q.instant else
                        prometheus.query_range(q.expr, start, end, 1))]

                try:
                    wait_for(lambda: not empty(), 30, "every panel query returning data")
                except TimeoutError:
                    pytest.fail(f"panel queries without data: {empty()}")
    finally:
        stop(service, timeout=60)
