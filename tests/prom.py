"""A real Prometheus for tests and for scripts/render_dashboards.py, the dashboards' queries, and
a synthetic farm to feed them.

- `running_prometheus(targets, workdir)`: starts the `prometheus` binary (Debian's package,
  scripts/setup.sh installs it) on a free loopback port with a generated config scraping
  `targets` every second, waits until every target is up, yields a `Prometheus` client
  (`query`, `query_range`), and ends the process on exit.
- `dashboard_queries(variables)`: every query of every panel of the farm's dashboards, with
  Grafana's variables substituted as Grafana would (`$job`, `$__rate_interval`, ...).
- `synthetic_farm()`: serves this process's farm metrics (farm.core.metrics) while a thread
  drives every helper with plausible values of a 2-worker llvm job; yields a `FarmMetrics`
  (scrape targets and job id), the shape a real job's fixture yields too.
- `real_farm(workdir)`: a real `farm scheduler` process and its two llvm worker actors, up and
  serving their metrics; yields a `RealFarm` (a client, the scrape targets) to run jobs on.
- `scrape(address)`, `farm_families(text)`, `promtool(...)`: a process's exposition, the farm's
  own metric families of it, Prometheus's checker.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.core.host import free_port
from tests.processes import stop

if TYPE_CHECKING:
    from farm.client import Client, Job

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
# What Grafana substitutes for its built-in interval variables, at the farm's 15 s scrape
# interval (the provisioned datasource's timeInterval): the rate window is 4 scrapes.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass
class Prometheus:
    """HTTP API client of a running Prometheus at `url`."""

    url: str

    def _api(self, path: str, params: Mapping[str, str | float]) -> Any:
        data = urllib.parse.urlencode(params).encode()
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", data=data, timeout=30) as response:
            doc = json.load(response)
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} {dict(params)}: {doc}")
        return doc["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: the result vector (or a scalar as a one-sample list), at `at` or now."""
        data = self._api("query", {"query": promql, **({"time": at} if at is not None else {})})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query: one {"metric", "values": [[t, "v"], ...]} per series."""
        data = self._api("query_range", {"query": promql, "start": start, "end": end, "step": step})
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets, with their `health` ("up", "down", "unknown")."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=10) as response:
            return list(json.load(response)["data"]["activeTargets"])


def wait_for(condition: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll `condition()` until it returns something truthy, and return it; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def prometheus_config(targets: Mapping[str, Sequence[str]], scrape_seconds: float = 1.0) -> dict[str, Any]:
    """A Prometheus config scraping each job's `host:port` targets every `scrape_seconds`."""
    interval = f"{int(scrape_seconds * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                           for job, addresses in targets.items()],
    }


@contextmanager
def running_prometheus(targets: Mapping[str, Sequence[str]], workdir: Path, scrape_seconds: float = 1.0,
                       timeout: float = 60.0) -> Iterator[Prometheus]:
    """A Prometheus scraping `targets` (scrape job name -> ["host:port", ...]), every target up.

    Its config, data and log go to `workdir`. The process is ended on exit, also when the
    block raises; a Prometheus that fails to start raises RuntimeError with its log's tail.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("no prometheus binary: run scripts/setup.sh (apt-get install prometheus)")
    config = workdir / "prometheus.yml"
    # JSON is YAML: no YAML library needed.
    config.write_text(json.dumps(prometheus_config(targets, scrape_seconds), indent=2))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    prometheus = Prometheus(f"http://127.0.0.1:{port}")
    try:
        def up() -> bool:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prometheus exited with status {proc.returncode}:\n{tail}")
            try:
                active = prometheus.targets()
            except OSError:  # not listening yet
                return False
            return len(active) == sum(len(a) for a in targets.values()) and all(
                t["health"] == "up" for t in active)

        wait_for(up, timeout, f"every target of {dict(targets)} up")
        yield prometheus
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class PanelQuery:
    """One query of one dashboard panel, variables substituted."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool
    kind: str  # the panel's type: timeseries, heatmap, stat, ...

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """`expr` with `$name` and `${name}` replaced, Grafana's built-ins included; KeyError for an
    unknown variable (a query Grafana could not run either)."""
    values = {**GRAFANA_BUILTINS, **variables}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for the variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard document, those inside collapsed rows too (rows themselves not)."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def load_dashboards(folder: Path = DASHBOARDS) -> dict[str, dict[str, Any]]:
    """The dashboard documents of `folder`, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def dashboard_queries(variables: Mapping[str, str], folder: Path = DASHBOARDS) -> list[PanelQuery]:
    """Every panel query of every dashboard in `folder`, with `variables` (e.g. {"job": "1"})
    and Grafana's interval variables substituted."""
    return [PanelQuery(stem, panel["title"], target["refId"], substitute(target["expr"], variables),
                       bool(target.get("instant")), panel["type"])
            for stem, dashboard in load_dashboards(folder).items()
            for panel in panels(dashboard) for target in panel.get("targets", [])]


def has_finite_value(series: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a query result (instant or range) holds at least one finite sample."""
    for s in series:
        samples = s["values"] if "values" in s else [s["value"]]
        if any(math.isfinite(float(v)) for _, v in samples):
            return True
    return False


# --- a synthetic farm ----------------------------------------------------------------------

SYNTHETIC_JOB_ID = 1
_STATUSES = (("ok", 0.80), ("invalid", 0.05), ("build_error", 0.05), ("runtime_error", 0.04),
             ("timeout", 0.03), ("wrong_result", 0.03))
_WORKLOADS = {1: ("resnet-last-conv", 2 * 512 * 7 * 7 * 512 * 9), 2: ("matmul-256", 2 * 256 ** 3)}


class SyntheticFarm:
    """Drives every farm.core.metrics helper, as a scheduler with two llvm workers running job 1
    (two tasks of 2,000 trials) would, `trials_per_second` trials a second, until `stop`.

    Both workers' series come from this one process (a real farm has one per worker actor).
    """

    def __init__(self, trials_per_second: float = 20.0, seed: int = 0) -> None:
        self.period = 1.0 / trials_per_second
        self.rng = random.Random(seed)
        self.workers = ("llvm-worker-0", "llvm-worker-1")
        self.done = dict.fromkeys(_WORKLOADS, 0)
        self.best = dict.fromkeys(_WORKLOADS, 0.05)
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="synthetic-farm")

    def start(self) -> SyntheticFarm:
        from farm.core import metrics

        metrics.set_jobs({"queued": 1, "running": 1, "done": 3, "failed": 1})
        for i, worker in enumerate(self.workers):
            metrics.set_worker_up(worker, f"farm-llvm-node0-{worker}", True)
            metrics.rpc_session_restart(worker, metrics.RESTART_REASONS[i])
        for task_id in _WORKLOADS:
            metrics.set_task_progress(SYNTHETIC_JOB_ID, task_id, 0, 2000)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(self.period):
            self.step(step)
            step += 1

    def step(self, step: int) -> None:
        """One trial, and what goes with it every so often (a batch, a round, a write)."""
        from farm.core import metrics

        rng = self.rng
        worker = self.workers[step % 2]
        task_id = 1 + (step // 40) % 2
        if step % 32 < 2:  # each worker receives a batch of 16 every 16 of its trials
            metrics.add_build_backlog(worker, 16)
        metrics.add_build_backlog(worker, -1)
        status = rng.choices([s for s, _ in _STATUSES], [w for _, w in _STATUSES])[0]
        reached_device = status not in ("invalid", "build_error")
        # Per worker 10 trials/s: timed runs of ~20 ms keep each device about 20% busy.
        metrics.observe_trial(worker, status, "llvm", rng.lognormvariate(-0.7, 0.5),
                              upload_s=rng.lognormvariate(-5, 0.3) if reached_device else None,
                              run_s=rng.lognormvariate(-4, 0.5) if reached_device else None,
                              check_s=rng.lognormvariate(-4.5, 0.4) if reached_device else None)
        self.done[task_id] += 1
        metrics.set_task_progress(SYNTHETIC_JOB_ID, task_id, self.done[task_id], 2000)
        # Improvements get rarer as a search goes on.
        if status == "ok" and rng.random() < min(0.3, 3 / self.done[task_id]):
            self.best[task_id] *= rng.uniform(0.9, 0.99)
            name, flop = _WORKLOADS[task_id]
            metrics.set_task_best(SYNTHETIC_JOB_ID, task_id, name, self.best[task_id],
                                  flop / self.best[task_id] / 1e9)
            # The job as a model's: its two kernels called 3 and 1 times per inference.
            metrics.set_model_latency(SYNTHETIC_JOB_ID, 3 * self.best[1] + self.best[2])
        metrics.set_worker_queue(worker, 16 - (step // 2) % 16, 16)
        if step % 8 == 0:
            with metrics.db_write():
                time.sleep(0.002)
        if step % 16 == 15:
            self.rounds += 1
            learned = 0.3 + 0.5 * (1 - math.exp(-self.rounds / 20))
            metrics.observe_round("llvm", 16 * self.period + rng.uniform(0.1, 0.5))
            metrics.observe_retrain(SYNTHETIC_JOB_ID, task_id, rng.uniform(0.05, 0.4),
                                    min(1.0, learned + rng.uniform(-0.1, 0.1)))
            metrics.heartbeat()
        if step % 200 == 199:
            metrics.rpc_session_restart(worker, "expired")


@dataclass(frozen=True)
class FarmMetrics:
    """Where a running farm serves its metrics (scrape job -> ["host:port", ...]) and the id of
    the job it runs (the Job dashboard's `$job`)."""

    targets: dict[str, list[str]]
    job_id: int


@contextmanager
def synthetic_farm(trials_per_second: float = 20.0) -> Iterator[FarmMetrics]:
    """Serve this process's farm metrics on a free loopback port while a SyntheticFarm runs."""
    from farm.core import metrics

    port = metrics.serve(0)
    farm = SyntheticFarm(trials_per_second).start()
    try:
        yield FarmMetrics({"farm": [f"127.0.0.1:{port}"]}, SYNTHETIC_JOB_ID)
    finally:
        farm.stop()


# --- a real farm ---------------------------------------------------------------------------

REAL_KERNEL = [("matmul", {"M": 64, "N": 64, "K": 64})]
# The real farm's model (`RealFarm.submit`): two kernels, a matmul with its ReLU and a row sum.
REAL_MODEL = """
@I.ir_module
class Model:
    @R.function
    def main(x: R.Tensor((64, 64), "float32")) -> R.Tensor((64,), "float32"):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, x))
            z = R.sum(y, axis=[1])
            R.output(z)
        return z
"""


def real_model() -> Any:
    """REAL_MODEL as a Relax IRModule (farm.core.model.load_model takes one)."""
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script.parser import parse

    return parse(REAL_MODEL, extra_vars={"I": I, "R": R})


@dataclass
class RealFarm:
    """A running `farm scheduler` with its llvm worker actors up (see `real_farm`): a client of
    its database, the scrape targets of its processes ({"scheduler": [address], "worker": [one
    per actor]}), and its log."""

    client: Client
    targets: dict[str, list[str]]
    workers: int
    log: Path

    def submit(self, trials: int, seed: int = 1, batch_size: int = 4) -> Job:
        """Queue a model's job of `trials` trials (REAL_MODEL: the per-task series of each of its
        kernels and the model's latency) on every worker actor."""
        return self.client.submit_model(real_model(), target="llvm", trials=trials, workers=self.workers,
                                        batch_size=batch_size, seed=seed)


@contextmanager
def real_farm(workdir: Path, workers: int = 2) -> Iterator[RealFarm]:
    """A real farm on this machine: `farm scheduler` in a process (and session) of its own, its
    SQLite database, log and RPC logs in `workdir`, serving its metrics on a free port, and
    `workers` llvm worker actors, brought up by a first job of 4 trials, serving theirs (their
    addresses read from the file_sd folder the scheduler writes, FARM_PROMETHEUS_TARGETS).

    On exit the scheduler is stopped as with Ctrl-C, which closes its actors and tracker.
    RuntimeError with the log's tail when the first job does not end `done` within 5 minutes.
    """
    from farm.client import Client

    db = f"sqlite:///{workdir}/farm.db"
    targets_dir = workdir / "targets"
    targets_dir.mkdir()
    metrics_port = free_port()
    env = {**os.environ, "FARM_WORKER_METRICS_PORT": str(free_port()), "FARM_PROMETHEUS_TARGETS": str(targets_dir)}
    log = workdir / "scheduler.log"
    with log.open("wb") as out:
        service = subprocess.Popen([sys.executable, "-m", "farm", "scheduler", "--db", db, "--metrics-port",
                                    str(metrics_port), "--log-dir", str(workdir / "logs")],
                                   env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Client(db, in_process=False) as client:
            first = client.submit(REAL_KERNEL, "llvm", 4, workers=workers, batch_size=2, search="random")
            if first.wait(progress=False, timeout=300) != "done":
                raise RuntimeError(f"the farm's first job did not finish:\n{log.read_text()[-3000:]}")
            addresses = [t for path in targets_dir.glob("*.json") for group in json.loads(path.read_text())
                         for t in group["targets"]]
            yield RealFarm(client, {"scheduler": [f"127.0.0.1:{metrics_port}"], "worker": addresses}, workers, log)
    finally:
        stop(service, timeout=60)


def scrape(address: str) -> str:
    """The exposition a process serves at http://`address`/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return str(response.read().decode())


def farm_families(exposition: str) -> str:
    """The farm's own metric families (`farm_*`) of a text exposition, their HELP and TYPE lines
    with them: what a process serves beside them (Python's, Ray's) is not the farm's to lint."""
    def name(line: str) -> str:
        words = line.split()
        if line.startswith("#"):  # "# HELP name ...", "# TYPE name type"
            return words[2] if len(words) > 2 else ""
        return re.split(r"[{\s]", line, maxsplit=1)[0]

    return "".join(f"{line}\n" for line in exposition.splitlines() if name(line).startswith("farm_"))


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `promtool` (Debian's prometheus package; scripts/test.sh installs it) with `args`."""
    binary = shutil.which("promtool")
    # Not a skip: a skipped check would hide a missing install.
    assert binary is not None, "no promtool: run scripts/test.sh, or apt-get install prometheus"
    return subprocess.run([binary, *args], input=stdin, capture_output=True, text=True, timeout=60)
