"""Prometheus files and the farm's metrics, checked by Prometheus's own `promtool`: both configs
load with their rule files, the alert rules pass their unit tests, and the farm's exposition
passes `promtool check metrics` after every helper of farm/core/metrics.py has run."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY, generate_latest

from farm.core import metrics
from tests.prom import ROOT, promtool, scrape

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"


@pytest.mark.parametrize("config", ["prometheus.yml", "local.yml"])
def test_config_loads_with_its_rules(config: str) -> None:
    # A rule_files glob that matches nothing passes `check config` silently: count what it read.
    result = promtool("check", "config", str(PROMETHEUS_DIR / config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout, result.stdout
    assert "Checking " + str(PROMETHEUS_DIR / "rules" / "farm-alerts.yml") in result.stdout, result.stdout
    rules = re.search(r"SUCCESS: (\d+) rules found", result.stdout)
    assert rules and int(rules.group(1)) >= 6, result.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", str(PROMETHEUS_DIR / "tests" / "farm-alerts-test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def _exercise_every_helper() -> set[str]:
    """Call each public helper of farm.core.metrics once (a failing write too); their names."""
    def failed_write() -> None:
        with pytest.raises(ConnectionError), metrics.db_write():
            raise ConnectionError("database gone")

    def good_write() -> None:
        with metrics.db_write():
            pass

    calls: dict[str, Callable[[], object]] = {
        "observe_trial": lambda: (metrics.observe_trial("llvm-worker-0", "ok", "llvm", 0.4, 0.004, 0.05, 0.01),
                                  metrics.observe_trial("llvm-worker-0", "build_error", "cuda", 2.0)),
        "set_worker_up": lambda: metrics.set_worker_up("llvm-worker-0", "farm-llvm-host-llvm-worker-0", True),
        "start_worker": lambda: metrics.start_worker("llvm-worker-1", "farm-llvm-host-llvm-worker-1", "llvm"),
        "rpc_session_restart": lambda: metrics.rpc_session_restart("llvm-worker-0", "timeout"),
        "add_build_backlog": lambda: metrics.add_build_backlog("llvm-worker-0", 4),
        "set_worker_queue": lambda: metrics.set_worker_queue("llvm-worker-0", 16, 16),
        "set_jobs": lambda: metrics.set_jobs({"running": 1, "queued": 2}),
        "set_task_best": lambda: metrics.set_task_best(42, 7, "resnet-last-conv", 0.0021, 110.2),
        "set_task_progress": lambda: metrics.set_task_progress(42, 7, 128, 300),
        "set_model_latency": lambda: metrics.set_model_latency(42, 0.0031),
        "observe_round": lambda: metrics.observe_round("llvm", 12.5),
        "observe_retrain": lambda: metrics.observe_retrain(42, 7, 0.31, 0.74),
        "clear_job": lambda: metrics.clear_job(41),
        "heartbeat": metrics.heartbeat,
        "db_write": lambda: (good_write(), failed_write()),
    }
    for call in calls.values():
        call()
    return set(calls)


def _helpers() -> set[str]:
    """The public functions of farm.core.metrics that record something (serving and ports aside)."""
    return {name for name, value in vars(metrics).items()
            if inspect.isfunction(value) and value.__module__ == metrics.__name__ and not name.startswith("_")
            } - {"serve", "scheduler_port", "worker_port"}


def test_the_exposition_passes_promtool_check_metrics() -> None:
    assert _exercise_every_helper() == _helpers(), "a helper that this test does not call"
    text = generate_latest(REGISTRY)
    for name in ("farm_trials_total", "farm_build_seconds_bucket", "farm_db_write_failures_total",
                 "farm_task_best_flops", "farm_scheduler_heartbeat_timestamp_seconds"):
        assert name.encode() in text
    result = promtool("check", "metrics", stdin=text.decode())
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr)


def test_names_units_and_labels_follow_the_conventions() -> None:
    _exercise_every_helper()  # labelled metrics have samples only once used
    families = [f for f in REGISTRY.collect() if f.name.startswith("farm_")]
    assert len(families) >= 20
    for family in families:
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        # Prometheus's own target labels: a metric label of the same name would be renamed exported_*.
        labels = {key for sample in family.samples for key in sample.labels}
        assert not {"job", "instance"} & labels, family.name


def test_a_finished_job_leaves_no_series() -> None:
    metrics.set_task_best(5, 1, "matmul-256", 0.001, 33.0)
    metrics.set_task_progress(5, 1, 10, 64)
    metrics.observe_retrain(5, 1, 0.1, 0.5)
    metrics.set_task_progress(6, 2, 1, 64)
    assert b'job_id="5"' in generate_latest(REGISTRY)
    metrics.clear_job(5, after=0)
    text = generate_latest(REGISTRY)
    assert b'job_id="5"' not in text and b'job_id="6"' in text
    metrics.clear_job(6, after=0)


def test_a_finished_jobs_series_outlive_it_briefly_unless_it_runs_again() -> None:
    """Kept for the scrapes after the job's end (its last figures reach Prometheus), then removed;
    a job claimed again meanwhile keeps them."""
    metrics.set_model_latency(8, 0.002)
    metrics.set_task_progress(9, 3, 4, 64)
    metrics.clear_job(8, after=0.3)
    metrics.clear_job(9, after=0.3)
    metrics.set_task_progress(9, 3, 5, 64)  # job 9 given back and running again
    text = generate_latest(REGISTRY)
    assert b'job_id="8"' in text and b'job_id="9"' in text
    time.sleep(0.8)
    text = generate_latest(REGISTRY)
    assert b'job_id="8"' not in text and b'job_id="9"' in text
    metrics.clear_job(9, after=0)


def test_bad_label_values_are_refused() -> None:
    with pytest.raises(ValueError, match="reason"):
        metrics.rpc_session_restart("llvm-worker-0", "because")
    with pytest.raises(ValueError, match="paused"):
        metrics.set_jobs({"paused": 1})


def test_serve_binds_a_free_port_and_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    port = metrics.serve(0)
    assert "# TYPE farm_trials_total counter" in scrape(f"127.0.0.1:{port}")
    monkeypatch.setenv("FARM_WORKER_METRICS_PORT", "9200")
    monkeypatch.delenv("FARM_SCHEDULER_METRICS_PORT", raising=False)
    assert (metrics.worker_port(2), metrics.scheduler_port()) == (9202, 9100)

