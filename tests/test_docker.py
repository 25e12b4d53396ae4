"""The compose farm, for real: docker/docker-compose.yml with its offline override
(docker/offline/compose.offline.yml) on a private Docker engine, two gpu-worker replicas measuring
llvm kernels on one logical GPU each, a job submitted from this machine with the Python client.

The engine runs in a network namespace of its own (its bridges and iptables rules stay there),
reached through a veth pair: Postgres is published on the namespace's end of it, as
FARM_PUBLISH_HOST would publish it on a host's private address. No registry is reachable, so the
base images are built offline (docker/offline/prepare.sh: debootstrap, a wheelhouse); they, the
wheelhouse and the engine's images and build cache are kept in $FARM_DOCKER_CACHE
[/var/cache/farm-docker], which makes later runs fast. Needs root, docker.io, debootstrap and the
Compose plugin (scripts/setup.sh's ensure_docker installs them). Prometheus and Grafana are not
started: their images come only from a registry. Neither are GPUs reserved: there are none here.
"""

from __future__ import annotations

import collections
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.client import Client

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("FARM_DOCKER_CACHE", "/var/cache/farm-docker"))
PLUGIN_CONFIG = REPO / ".venv" / "docker-config"  # holds cli-plugins/docker-compose (scripts/setup.sh)
PROJECT = "farmtest"
SUBNET = "10.213.13"  # the veth pair: .1 on this side, .2 in the engine's namespace


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{output}")
    return proc


class PrivateEngine:
    """dockerd in a network namespace of its own, with a veth pair to it from this namespace.

    `start` removes what a killed earlier run left (its namespace, its processes), then starts the
    engine on the cache's data root; `stop` ends the engine and every process in the namespace and
    deletes the namespace. One engine per cache at a time (a lock on the cache held until `stop`).
    """

    def __init__(self) -> None:
        self.netns = f"farmdk{os.getpid()}"
        self.run_dir = Path(f"/run/farmdk-{os.getpid()}")  # short: containerd's sockets live here
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.run_dir}/docker.sock",
                        DOCKER_CONFIG=str(PLUGIN_CONFIG), FARM_DOCKER_CACHE=str(CACHE))
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock: Any = None

    def start(self) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        self._lock = open(CACHE / ".engine.lock", "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        for name in run(["ip", "netns", "list"]).stdout.split():
            if name.startswith("farmdk") and name != self.netns:
                self._remove_namespace(name)  # a killed run's: the lock says it is not in use
        run(["ip", "netns", "add", self.netns])
        host_end, ns_end = f"fdk{os.getpid()}h"[:15], f"fdk{os.getpid()}n"[:15]
        run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end])
        run(["ip", "link", "set", ns_end, "netns", self.netns])
        run(["ip", "addr", "add", f"{SUBNET}.1/30", "dev", host_end])
        run(["ip", "link", "set", host_end, "up"])
        for cmd in (["addr", "add", f"{SUBNET}.2/30", "dev", ns_end], ["link", "set", ns_end, "up"],
                    ["link", "set", "lo", "up"]):
            run(["ip", "-n", self.netns, *cmd])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(CACHE / "dockerd.log", "wb")
        # nsenter, not `ip netns exec`: that remounts /sys and hides the cgroups dockerd needs.
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{self.netns}", "dockerd", "--data-root", str(CACHE / "engine"),
             "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.run_dir / "dockerd.pid"),
             "--host", self.env["DOCKER_HOST"]], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while run(["docker", "version"], self.env, check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dockerd did not start; see {CACHE / 'dockerd.log'}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            # Bound the cache: images and build cache that no run of this commit needs go.
            run(["docker", "image", "prune", "-f"], self.env, check=False, timeout=120)
            run(["docker", "builder", "prune", "-f", "--keep-storage", "8gb"], self.env, check=False, timeout=120)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._remove_namespace(self.netns)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()

    @staticmethod
    def _remove_namespace(name: str) -> None:
        """Kill every process in the namespace (containers' included), then delete it and its veth."""
        pids = run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while run(["ip", "netns", "pids", name], check=False).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.2)
        run(["ip", "netns", "delete", name], check=False)


class Farm:
    """The compose project: `compose(...)` runs `docker compose` on it with the test's environment."""

    def __init__(self, engine: PrivateEngine, env_file: Path) -> None:
        self.engine = engine
        self.base = ["docker", "compose", "-p", PROJECT, "--env-file", str(env_file),
                     "-f", str(REPO / "docker/docker-compose.yml"),
                     "-f", str(REPO / "docker/offline/compose.offline.yml")]
        password = env_file.read_text().split("POSTGRES_PASSWORD=")[1].split()[0]
        self.db = f"postgresql://farm:{password}@{SUBNET}.2:5432/farm"

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run([*self.base, *args], self.engine.env, timeout=timeout)


@pytest.fixture(scope="module")
def farm(unavailable: Callable[[str], Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    """The compose farm with two gpu-worker replicas, up and healthy; down (volumes too) afterwards."""
    if os.geteuid() != 0:
        unavailable("the compose test needs root (a network namespace and a Docker engine of its own)")
    missing = [tool for tool in ("dockerd", "docker", "debootstrap", "nsenter", "ip") if shutil.which(tool) is None]
    if missing or not (PLUGIN_CONFIG / "cli-plugins" / "docker-compose").exists():
        unavailable(f"missing {', '.join(missing) or 'the Compose plugin'}: run `bash scripts/test.sh` "
                    "(scripts/setup.sh's ensure_docker installs docker.io, debootstrap and Compose)")
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    env_file.write_text(f"POSTGRES_PASSWORD={secrets.token_hex(16)}\nRAY_AUTH_TOKEN={secrets.token_hex(32)}\n"
                        f"GRAFANA_ADMIN_PASSWORD={secrets.token_hex(16)}\nFARM_PUBLISH_HOST={SUBNET}.2\n")
    env_file.chmod(0o600)
    engine = PrivateEngine()
    try:
        try:
            engine.start()
        except (AssertionError, OSError) as e:
            unavailable(f"cannot run a private Docker engine here: {str(e).splitlines()[0]}")
        farm = Farm(engine, env_file)
        farm.compose("down", "-v", "--timeout", "5")  # a killed run's containers and volumes
        run([str(REPO / "docker/offline/prepare.sh")], engine.env, timeout=1200)
        try:
            farm.compose("up", "-d", "--build", "--wait", "--wait-timeout", "300", "--scale", "gpu-worker=2",
                         timeout=1500)
            yield farm
        finally:
            logs = run([*farm.base, "logs", "--no-color", "--tail", "40"], engine.env, check=False)
            print(logs.stdout[-20000:])  # shown by pytest when a test failed
            farm.compose("down", "-v", "--timeout", "5")
    finally:
        engine.stop()


def wait_for_trials(job: Any, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while job.status()["trials"] < count:
        assert time.monotonic() < deadline, f"fewer than {count} trials after {timeout:.0f} s: {job.status()}"
        assert job.status()["status"] not in ("failed", "cancelled"), job.status()
        time.sleep(1)


def check_trials(job: Any, budget: int) -> collections.Counter[str]:
    """Assert the job stored exactly its budget, each config once, and measured; return the trials
    per device that measured them. (A failed measurement is data, recorded like the others: not
    asserted away; a candidate that never reached a device, a build stopped on a busy machine
    say, has none.)"""
    trials = job.trials()
    assert len(trials) == budget
    assert not trials.duplicated(["task_id", "config_index"]).any()
    assert (trials["status"] == "ok").sum() > budget // 2, trials["error"].dropna().head().tolist()
    return collections.Counter(device for device in trials["device"] if device)


def test_compose_farm_runs_a_job_on_both_workers(farm: Farm) -> None:
    with Client(farm.db) as client:
        job = client.submit([("matmul", {"M": 64, "N": 64, "K": 64})], target="llvm", trials=32, workers=2,
                            search="random")
        assert job.wait(progress=False, timeout=300) == "done", job.status()
        devices = check_trials(job, 32)
        # Each device name ends with its container's hostname: two replicas, two devices.
        assert len(devices) == 2, devices
        assert len(set(job.trials()["worker"])) == 2


def test_compose_scale_adds_a_worker_mid_job(farm: Farm) -> None:
    """A third gpu-worker, scaled up while a job runs, measures some of its trials."""
    with Client(farm.db) as client:
        job = client.submit([("matmul", {"M": 128, "N": 128, "K": 128})], target="llvm", trials=160, workers=2,
                            search="random", batch_size=8)
        wait_for_trials(job, 8, timeout=300)
        farm.compose("up", "-d", "--wait", "--wait-timeout", "300", "--no-recreate", "--scale", "gpu-worker=3")
        assert job.wait(progress=False, timeout=600) == "done", job.status()
        devices = check_trials(job, 160)
        assert len(devices) == 3, f"the third gpu-worker never measured: {devices}"
