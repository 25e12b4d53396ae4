"""The one-machine cluster through the command line: `farm cluster up`, `farm submit`, `farm export`,
`farm cluster down`, then no process of the cluster is left. Real PostgreSQL (a private one that
`up` initialises), Ray nodes, tracker, scheduler and RPC servers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.slow

# What a cluster runs; a process of these kinds that the test started must be gone after `down`.
CLUSTER_PROCESSES = ("ray", "raylet", "gcs_server", "postgres", "prometheus", "tvm.exec.rpc_tracker",
                     "workers.rpc_server", "tvm.exec.rpc_server", "farm scheduler", "ray::")


def farm(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"farm {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


@pytest.fixture
def folder(unavailable: Callable[[str], Any]) -> Iterator[Path]:
    """A cluster folder that PostgreSQL's own user can reach when the tests run as root (pytest's
    tmp_path is private to root), stopped and removed afterwards whatever happened."""
    if shutil.which("initdb") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        unavailable("PostgreSQL's initdb is not installed (scripts/setup.sh --with-postgres installs it)")
    path = Path(tempfile.mkdtemp(prefix="farm-cluster-"))
    path.chmod(0o755)
    try:
        yield path / "cluster"
    finally:
        from deploy.cluster import LocalCluster

        cluster = LocalCluster(path / "cluster")
        cluster.down()
        ray_link = path / "cluster" / "ray"
        if ray_link.is_symlink():
            shutil.rmtree(ray_link.resolve(), ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)


def leftovers(folder: Path, since: float, ray_temp: str | None = None) -> list[str]:
    """Cluster processes started since `since` that belong to the cluster in `folder` (its marker
    in their environment, or its folders on their command line), as readable lines."""
    found = []
    for proc in psutil.process_iter(["pid", "create_time", "cmdline", "name"]):
        try:
            if proc.info["create_time"] < since - 1 or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(proc.info["cmdline"] or [proc.info["name"]])
            if not any(kind in line for kind in CLUSTER_PROCESSES):
                continue
            ours = (proc.environ().get("FARM_CLUSTER") == str(folder) or str(folder) in line
                    or (ray_temp is not None and ray_temp in line))
            if ours:
                found.append(f"{proc.pid}: {line[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_cluster_up_submit_export_down_leaves_nothing(folder: Path) -> None:
    started = time.time()
    up = farm("cluster", "up", "--folder", str(folder), "--workers", "2")
    assert "cluster up" in up.stdout
    state = json.loads(farm("cluster", "status", "--folder", str(folder), "--json").stdout)
    assert state["running"] and all(s["running"] for s in state["services"])
    names = {s["name"] for s in state["services"]}
    assert {"postgres", "ray-head", "ray-worker-0", "ray-worker-1", "tracker", "scheduler"} <= names
    assert (folder / "ray-auth-token").stat().st_mode & 0o077 == 0, "Ray's token must be private"
    db = state["db"]

    job = farm("submit", "matmul", "M=64", "N=64", "K=64", "--target", "llvm", "--trials", "24",
               "--workers", "2", "--search", "random", "--db", db).stdout.strip()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        doc = json.loads(farm("status", job, "--db", db, "--json").stdout)
        if doc["status"] in ("done", "failed", "cancelled"):
            break
        time.sleep(2)
    assert doc["status"] == "done", doc.get("error") or doc["status"]
    trials = [json.loads(line) for line in farm("trials", job, "--db", db, "--json").stdout.splitlines()]
    assert len(trials) == 24
    assert len({t["config_index"] for t in trials}) == 24
    assert len({t["worker"] for t in trials}) == 2, "both Ray worker nodes measured"
    best = folder.parent / "best.json"
    farm("export", job, "-o", str(best), "--db", db)
    assert json.loads(best.read_text())["records"][0]["workload"]["name"] == "matmul"

    down = farm("cluster", "down", "--folder", str(folder))
    assert "scheduler" in down.stdout and "ray-head" in down.stdout
    assert leftovers(folder, started, state["ray_temp"]) == []
    assert not json.loads(farm("cluster", "status", "--folder", str(folder), "--json").stdout)["running"]


@pytest.mark.parametrize("args, message", [
    (["--workers", "-1"], "--workers must be at least 0"),
    (["--gpus-per-worker", "0"], "--gpus-per-worker at least 1"),
    (["--db", "postgresql://farm@127.0.0.1:1/nothing"], "cannot connect"),
    (["--host", "no-such-host.invalid"], "does not resolve"),
    (["--host", "198.51.100.77"], "cannot listen on 198.51.100.77"),
])
def test_cluster_up_bad_input_is_one_line_and_starts_nothing(folder: Path, args: list[str], message: str) -> None:
    started = time.time()
    proc = farm("cluster", "up", "--folder", str(folder), *args, check=False, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("farm: error:") and message in lines[0], proc.stderr
    assert leftovers(folder, started) == []
