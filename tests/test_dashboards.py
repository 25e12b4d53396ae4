"""The Grafana dashboards: they parse with grafana-foundation-sdk (Grafana 11.6's schema) without
losing a key, every panel reads the provisioned datasource, every metric they query is one the
farm defines (farm/core/metrics.py), and every panel query returns data from a real Prometheus
scraping the farm's metrics."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client import Counter, Gauge, Histogram

from farm.core import metrics
from tests.prom import (
    DASHBOARDS,
    ROOT,
    FarmMetrics,
    Prometheus,
    dashboard_queries,
    has_finite_value,
    load_dashboards,
    panels,
    running_prometheus,
    synthetic_farm,
    wait_for,
)

PROVISIONED = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))


def parse_dashboard(doc: dict[str, Any]) -> Dashboard:
    """The dashboard as grafana-foundation-sdk's model; ValueError if anything of `doc` is lost.

    The SDK's decoder raises on a structurally broken panel (no type, a datasource that is not a
    reference); it silently drops keys its schema does not know (a misspelled `gridpos`) and
    turns values of the wrong shape into defaults: encoding the model again and finding every
    key and value of `doc` in it catches those.
    """
    register_default_plugins()
    model = Dashboard.from_json(doc)
    lost = _lost(doc, json.loads(json.dumps(model, cls=JSONEncoder)), "")
    if lost:
        raise ValueError(f"not in Grafana 11.6's dashboard schema: {'; '.join(lost)}")
    return model


def _lost(original: Any, decoded: Any, path: str) -> list[str]:
    """Paths of `original` missing from, or different in, `decoded` (which may hold more: defaults)."""
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [f"{path or '/'} is not an object"]
        return [lost for key, value in original.items()
                for lost in ([f"{path}/{key}"] if key not in decoded else _lost(value, decoded[key], f"{path}/{key}"))]
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(decoded) != len(original):
            return [f"{path} is not the same list"]
        return [lost for i, (a, b) in enumerate(zip(original, decoded, strict=True))
                for lost in _lost(a, b, f"{path}[{i}]")]
    return [] if original == decoded else [f"{path}: {original!r} read as {decoded!r}"]


# --- PromQL metric names ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# A name, whole, not a function call, not the tail of a number or duration (1e9, 5m).
_NAME = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*$")


def metric_names(promql: str) -> set[str]:
    """The metric names a PromQL expression selects (label names, functions, keywords left out)."""
    for pattern in (_STRING, _MATCHERS, _RANGE, _GROUPING):
        promql = pattern.sub(" ", promql)
    return {name for name in _NAME.findall(promql) if name.lower() not in _KEYWORDS}


def defined_names() -> set[str]:
    """Every sample name farm.core.metrics exposes (counters' _total, histograms' _bucket/_sum/_count)."""
    suffixes = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_sum", "_count")}
    return {f"{family.name}{suffix}"
            for value in vars(metrics).values() if isinstance(value, (Counter, Gauge, Histogram))
            for family in value.describe() for suffix in suffixes[type(value)]}


def unknown_metrics(promql: str) -> set[str]:
    """Names in `promql` that the farm does not define; Ray's own (`ray_...`) are scraped too."""
    return {name for name in metric_names(promql) - defined_names() if not name.startswith("ray_")}


def _variable_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = _LABEL_VALUES.match(query)
            yield match.group(1) if match else query


# --- the dashboards' files ---------------------------------------------------------------------

def test_there_are_the_three_dashboards() -> None:
    assert {p.stem for p in DASHBOARD_FILES} == {"farm-overview", "farm-job", "farm-workers"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_dashboard_parses_without_loss(path: Path) -> None:
    doc = json.loads(path.read_text())
    model = parse_dashboard(doc)
    assert model.uid == path.stem and model.title
    assert model.panels, "a dashboard without panels"


def _broken(mutate: str) -> dict[str, Any]:
    """A copy of the overview dashboard with its first panel broken in one way."""
    doc = copy.deepcopy(load_dashboards()["farm-overview"])
    panel = doc["panels"][0]
    if mutate == "no type":
        del panel["type"]
    elif mutate == "datasource by name":  # Grafana < 8 style: a bare name, no reference
        panel["datasource"] = "Prometheus"
    elif mutate == "misspelled key":
        panel["gridpos"] = panel.pop("gridPos")
    elif mutate == "targets not a list":
        panel["targets"] = panel["targets"][0]["expr"]
    return doc


@pytest.mark.parametrize("mutate", ["no type", "datasource by name", "misspelled key", "targets not a list"])
def test_a_malformed_panel_is_rejected(mutate: str) -> None:
    with pytest.raises((ValueError, KeyError, AttributeError, TypeError)):
        parse_dashboard(_broken(mutate))


def test_every_panel_reads_the_provisioned_datasource() -> None:
    (provisioned,) = yaml.safe_load(PROVISIONED.read_text())["datasources"]
    expected = {"type": provisioned["type"], "uid": provisioned["uid"]}
    assert expected == {"type": "prometheus", "uid": "farm-prometheus"}
    for stem, dashboard in load_dashboards().items():
        for variable in dashboard["templating"]["list"]:
            assert variable.get("datasource") == expected, f"{stem}: variable {variable['name']}"
        for panel in panels(dashboard):
            assert panel.get("datasource") == expected, f"{stem}: panel {panel['title']!r}"
            for target in panel["targets"]:
                assert target.get("datasource") == expected, f"{stem}: {panel['title']!r} {target['refId']}"


def test_metric_names_are_parsed_from_promql() -> None:
    expr = ('histogram_quantile(0.9, sum by (le) (rate(farm_build_seconds_bucket{target="llvm"}[1m]))) '
            '/ on (worker) group_left (device) max by (worker, device) (farm_worker_up) * 1e9 '
            '+ ray_node_cpu_utilization offset 5m - time() and bool farm_jobs{state=~"run.*"}')
    assert metric_names(expr) == {"farm_build_seconds_bucket", "farm_worker_up", "ray_node_cpu_utilization",
                                  "farm_jobs"}
    assert unknown_metrics(expr) == set()


def test_a_misspelled_metric_is_caught() -> None:
    assert unknown_metrics("sum(rate(farm_trial_total[1m]))") == {"farm_trial_total"}
    doc = load_dashboards()["farm-overview"]
    doc["panels"][0]["targets"][0]["expr"] = doc["panels"][0]["targets"][0]["expr"].replace(
        "farm_trials_total", "farm_trials_totla")
    assert {n for p in panels(doc) for t in p["targets"] for n in unknown_metrics(t["expr"])} == {"farm_trials_totla"}


def test_every_queried_metric_is_defined_by_the_farm() -> None:
    unknown = {}
    for stem, dashboard in load_dashboards().items():
        for query in _variable_queries(dashboard):
            unknown.update({f"{stem} variable: {name}": query for name in unknown_metrics(query)})
        for panel in panels(dashboard):
            for target in panel["targets"]:
                unknown.update({f"{stem} / {panel['title']}: {name}": target["expr"]
                                for name in unknown_metrics(target["expr"])})
    assert not unknown


# --- the dashboards against a real Prometheus --------------------------------------------------

@pytest.fixture(scope="module")
def farm() -> Iterator[FarmMetrics]:
    """A farm serving its metrics while something drives them: for now synthetic values; a real
    job's fixture yields the same FarmMetrics (its processes' addresses, its job id)."""
    with synthetic_farm() as farm_metrics:
        yield farm_metrics


@pytest.fixture(scope="module")
def prometheus(farm: FarmMetrics, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    with running_prometheus(farm.targets, tmp_path_factory.mktemp("prometheus")) as server:
        yield server


@pytest.mark.slow
def test_every_panel_query_returns_data(farm: FarmMetrics, prometheus: Prometheus) -> None:
    queries = dashboard_queries({"job": str(farm.job_id)})
    assert len(queries) >= 20

    def empty() -> list[str]:
        end = float(prometheus.query("time()")[0]["value"][1])
        return [q.name for q in queries if not has_finite_value(
            prometheus.query(q.expr) if q.instant else prometheus.query_range(q.expr, end - 60, end, 1))]

    # Rates need two scrapes of a window, and a histogram's quantile a bucket that moved.
    try:
        wait_for(lambda: not empty(), 60, "every panel query returning data")
    except TimeoutError:
        pytest.fail(f"panel queries without data: {empty()}")
