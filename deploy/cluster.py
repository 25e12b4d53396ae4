"""The one-machine cluster: the farm's services as local processes (`farm cluster up|down|status`).

It runs what docker/docker-compose.yml runs in containers, on this machine: PostgreSQL (a running
one given by URL, or a private one initialised in the cluster's folder), a Ray head, N Ray worker
nodes with GPU resources of their own (logical GPUs on a CPU-only machine: their worker actors
measure llvm kernels on the CPU), the TVM RPC tracker, `farm scheduler`, and Prometheus if it is
installed. Clients submit jobs to the database URL that `up` prints (`farm submit --db URL`,
`farm.Client(URL)`).

The cluster's folder holds everything it writes: `cluster.json` (addresses and the processes,
each by pid and start time, so that a recycled pid is never taken for a service), `logs/` (one
log per service, the RPC servers' in `logs/rpc/`), `ray-auth-token` (mode 0600: Ray runs with
RAY_AUTH_MODE=token, and every driver needs the token), `postgres/` (the private database), and
`ray`, a link to the Ray nodes' temporary folders under /tmp (a Unix socket path must stay under
108 bytes, which a deep folder would break).

Every service listens on `host` only (127.0.0.1 by default): an RPC server runs whatever it is sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer

from farm.core.errors import FarmError
from farm.core.host import free_port
from scheduler.cluster import SINGLE_MACHINE_ENV

STATE_FILE = "cluster.json"
TOKEN_FILE = "ray-auth-token"
RAY_DRAIN_SECONDS = 40.0  # `ray start --block` drains its node for up to 30 s on SIGTERM


@dataclass
class Service:
    """A process `up` started: the leader of its own process group."""

    name: str
    pid: int
    started: float  # psutil's create_time: with the pid, identifies the process
    log: str

    def process(self) -> psutil.Process | None:
        """The running process, or None if it ended (or its pid now belongs to another process)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.started) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.NoSuchProcess:
            return None


@dataclass
class ClusterState:
    """What `up` started and where it listens; saved as the folder's cluster.json."""

    host: str
    db: str
    ray_address: str
    tracker: str
    ray_temp: str
    workers: int
    gpus_per_worker: int
    metrics: dict[str, str] = field(default_factory=dict)  # Prometheus endpoints by service
    prometheus: str | None = None
    services: list[Service] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        doc = json.loads(path.read_text())
        doc["services"] = [Service(**s) for s in doc["services"]]
        return cls(**doc)


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


class LocalCluster:
    """The one-machine cluster kept in `folder` (see the module docstring).

    Contract: `up` starts the services in dependency order and returns once each one answers;
    if one does not, it stops everything it started and raises FarmError naming the log to read.
    It refuses a folder whose cluster still runs. `down` stops every process `up` started,
    children included (Ray's workers, the RPC servers of worker actors), SIGKILL after a grace
    period, and leaves none behind; it is idempotent and keeps the logs. `status` reports each
    service and the addresses without changing anything. Not thread-safe: one command at a time
    per folder.
    """

    def __init__(self, folder: Path | str = ".farm-cluster") -> None:
        self.folder = Path(folder).resolve()
        self.state_path = self.folder / STATE_FILE
        self.logs = self.folder / "logs"

    # -- up --------------------------------------------------------------------------------

    def up(self, workers: int = 2, gpus_per_worker: int = 1, db: str | None = None, host: str = "127.0.0.1",
           ray_port: int = 0, tracker_port: int = 0, timeout: float = 120.0) -> ClusterState:
        """Start the cluster; return its state. `db`: a running database's URL (its schema is created
        or upgraded); None initialises a private PostgreSQL in the folder. Ports 0: free ones."""
        if workers < 0 or gpus_per_worker < 1:
            raise FarmError("--workers must be at least 0 (0: GPU hosts join with `ray start`), "
                            "--gpus-per-worker at least 1")
        if self.state_path.exists() and any(s.process() for s in ClusterState.load(self.state_path).services):
            raise FarmError(f"a cluster is running in {self.folder}: `farm cluster down --folder {self.folder}` first")
        try:
            free_port(host)
        except socket.gaierror as e:
            raise FarmError(f"host {host!r} does not resolve: {e.strerror}") from None
        except OSError as e:
            raise FarmError(f"cannot listen on {host}: {e.strerror} (--host is an address of this machine)") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        ray_temp = self._ray_temp()
        state = ClusterState(host=host, db=db or "", ray_address=f"{host}:{ray_port or free_port(host)}",
                             tracker=f"{host}:{tracker_port or free_port(host)}", ray_temp=str(ray_temp),
                             workers=workers, gpus_per_worker=gpus_per_worker)
        self._save(state)
        try:
            if db is None:
                state.db = self._start_postgres(state, timeout)
            self._farm(["db", "upgrade"], state.db, "the database")
            self._start_ray(state, timeout)
            self._start_tracker(state, timeout)
            self._start_scheduler(state, timeout)
            self._start_prometheus(state, timeout)
        except BaseException:
            self.down()
            raise
        return state

    def _save(self, state: ClusterState) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.touch(mode=0o600)  # it holds the database URL, password included
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_path)

    def _ray_temp(self) -> Path:
        """The Ray nodes' temporary root, short and unique to this folder, emptied; linked as FOLDER/ray."""
        root = Path("/tmp") / f"farm-ray-{hashlib.sha256(str(self.folder).encode()).hexdigest()[:10]}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(mode=0o700)
        link = self.folder / "ray"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(root)
        return root

    def _env(self, host: str = "127.0.0.1") -> dict[str, str]:
        """The services' environment: Ray's token authentication, this checkout importable, the marker,
        and the address the worker actors' RPC servers and metrics bind (the one the tracker hands out for
        them, and the one Prometheus scrapes)."""
        token = self.folder / TOKEN_FILE
        if not token.exists():
            token.touch(mode=0o600)
            token.write_text(secrets.token_hex(32))
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), PYTHONUNBUFFERED="1",
                   FARM_CLUSTER=str(self.folder),  # the marker `down` finds every process of the cluster by
                   FARM_RPC_HOST=host, FARM_METRICS_HOST=host)
        env.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the cluster's token file
        # Set by init_ray in a process that started a local Ray (scheduler.cluster): inherited, it would
        # make every Ray node of this cluster refuse other nodes ("Multi-node Ray clusters are not supported").
        env.pop(SINGLE_MACHINE_ENV, None)
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        return env

    def _spawn(self, state: ClusterState, name: str, argv: list[str], user: str | None = None,
               env: dict[str, str] | None = None) -> Service:
        """Start `argv` as the leader of a new process group, its output in logs/NAME.log, and record it.
        `env`: variables beyond `_env`'s (secrets go there, never on a command line others can read)."""
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env={**self._env(state.host), **(env or {})}, start_new_session=True,
                                    user=user)
        service = Service(name, proc.pid, psutil.Process(proc.pid).create_time(), str(log))
        state.services.append(service)
        self._save(state)
        return service

    def _wait(self, service: Service, ready: Any, what: str, timeout: float) -> None:
        """Poll `ready()` until true; FarmError if the service ends first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if service.process() is None:
                raise FarmError(f"{what} exited while starting; see {service.log}")
            if ready():
                return
            time.sleep(0.2)
        raise FarmError(f"{what} did not come up within {timeout:.0f} s; see {service.log}")

    def _farm(self, args: list[str], db: str, what: str) -> None:
        """Run a `farm` command on database `db` to completion; its error line becomes a FarmError."""
        proc = subprocess.run([sys.executable, "-m", "farm", *args], env=dict(self._env(), FARM_DB=db),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
            raise FarmError(f"{what}: {lines[-1].removeprefix('farm: error: ')}")

    def _start_postgres(self, state: ClusterState, timeout: float) -> str:
        """Initialise (once) and start a private PostgreSQL on `host`; return its URL.

        PostgreSQL refuses to run as root: as root, it runs as the `postgres` user."""
        bin_dir = _postgres_bin()
        user = None
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres").pw_name
            except KeyError:
                raise FarmError("PostgreSQL refuses to run as root and there is no `postgres` user: "
                                "run `farm cluster up` as another user, or give --db URL") from None
        data = self.folder / "postgres"
        password_file = self.folder / "postgres-password"
        port = free_port(state.host)
        if not (data / "PG_VERSION").exists():
            data.mkdir(mode=0o700, exist_ok=True)
            password_file.touch(mode=0o600)
            password_file.write_text(secrets.token_hex(16))
            initdb_password = self.folder / ".initdb-password"  # read by initdb as the server's user
            shutil.copyfile(password_file, initdb_password)
            if user is not None:
                shutil.chown(data, user, user)
                shutil.chown(initdb_password, user, user)
            # Passwords over TCP (`host` may be a private network's address); the socket lives in the
            # data folder, which only the server's user can enter.
            init = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", "farm", "--auth-local=trust",
                                   "--auth-host=scram-sha-256", f"--pwfile={initdb_password}", "--no-sync"],
                                  user=user, capture_output=True, text=True)
            initdb_password.unlink()
            if init.returncode != 0:
                raise FarmError(f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1]}")
        password = password_file.read_text().strip()
        service = self._spawn(state, "postgres", [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port),
                                                  "-c", f"listen_addresses={state.host}",
                                                  "-c", f"unix_socket_directories={data}"], user=user)
        self._wait(service, lambda: subprocess.run(
            [str(bin_dir / "pg_isready"), "-q", "-h", state.host, "-p", str(port)]).returncode == 0,
            "PostgreSQL", timeout)
        client = {"env": dict(os.environ, PGPASSWORD=password), "capture_output": True, "text": True}
        connect = ["-h", state.host, "-p", str(port), "-U", "farm"]
        exists = subprocess.run([str(bin_dir / "psql"), *connect, "-d", "postgres", "-tAc",
                                 "SELECT 1 FROM pg_database WHERE datname = 'farm'"], **client)
        if exists.stdout.strip() != "1":
            subprocess.run([str(bin_dir / "createdb"), *connect, "farm"], check=True, **client)
        return f"postgresql://farm:{password}@{state.host}:{port}/farm"

    def _ray_node(self, state: ClusterState, name: str, head: bool) -> Service:
        """`ray start --block` for one node, with ports of its own (several nodes share this machine)."""
        host = state.host
        metrics = free_port(host)
        temp = Path(state.ray_temp) / name
        argv = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={host}", f"--temp-dir={temp}", f"--metrics-export-port={metrics}",
                f"--dashboard-agent-listen-port={free_port(host)}", f"--dashboard-agent-grpc-port={free_port(host)}",
                f"--runtime-env-agent-port={free_port(host)}"]
        if head:
            argv += ["--head", f"--port={state.ray_address.rsplit(':', 1)[1]}", "--num-gpus=0",
                     f"--dashboard-host={host}", f"--dashboard-port={free_port(host)}"]
        else:
            argv += [f"--address={state.ray_address}", f"--num-gpus={state.gpus_per_worker}"]
        state.metrics[name] = f"{host}:{metrics}"
        return self._spawn(state, name, argv)

    def _start_ray(self, state: ClusterState, timeout: float) -> None:
        """The head, then the workers; each is up once its raylet's socket exists (it has joined)."""
        host, port = state.ray_address.rsplit(":", 1)
        head = self._ray_node(state, "ray-head", head=True)
        self._wait(head, lambda: port_open(host, int(port)) and _raylet_up(Path(state.ray_temp) / "ray-head"),
                   "the Ray head", timeout)
        nodes = [self._ray_node(state, f"ray-worker-{i}", head=False) for i in range(state.workers)]
        for node in nodes:
            self._wait(node, lambda n=node: _raylet_up(Path(state.ray_temp) / n.name), f"Ray node {node.name}",
                       timeout)

    def _start_tracker(self, state: ClusterState, timeout: float) -> None:
        host, port = state.tracker.rsplit(":", 1)
        tracker = self._spawn(state, "tracker", [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host,
                                                 "--port", port, "--port-end", str(int(port) + 1), "--silent"])
        self._wait(tracker, lambda: port_open(host, int(port)), "the RPC tracker", timeout)

    def _start_scheduler(self, state: ClusterState, timeout: float) -> None:
        """`farm scheduler`, up once it logs that it serves (it has opened the database). It serves its
        metrics on `host` and lists its worker actors' in prometheus-targets/ (Prometheus' file_sd)."""
        metrics = free_port(state.host)
        state.metrics["scheduler"] = f"{state.host}:{metrics}"
        targets = self.folder / "prometheus-targets"
        targets.mkdir(exist_ok=True)
        scheduler = self._spawn(state, "scheduler", [
            sys.executable, "-m", "farm", "scheduler", "--ray-address", state.ray_address,
            "--tracker", state.tracker, "--log-dir", str(self.logs / "rpc"),
            "--metrics-host", state.host, "--metrics-port", str(metrics)],
            env={"FARM_DB": state.db, "FARM_PROMETHEUS_TARGETS": str(targets)})
        self._wait(scheduler, lambda: " serving " in Path(scheduler.log).read_text(errors="replace"),
                   "the scheduler", timeout)

    def _start_prometheus(self, state: ClusterState, timeout: float) -> None:
        """Prometheus, if `prometheus` is installed (else nothing), scraping what deploy/prometheus
        names: the Ray nodes (job ray), the scheduler (farm-scheduler) and the worker actors the
        scheduler lists (farm-workers, also on GPU hosts that joined)."""
        binary = shutil.which("prometheus")
        if binary is None:
            return
        port = free_port(state.host)
        config = self.folder / "prometheus.yml"
        ray_nodes = sorted(v for k, v in state.metrics.items() if k != "scheduler")
        workers = str(self.folder / "prometheus-targets" / "workers-*.json")
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "5s"},
            "scrape_configs": [
                {"job_name": "ray", "static_configs": [{"targets": ray_nodes}]},
                {"job_name": "farm-scheduler", "static_configs": [{"targets": [state.metrics["scheduler"]]}]},
                {"job_name": "farm-workers", "file_sd_configs": [{"files": [workers]}]},
            ]}, indent=1))
        prometheus = self._spawn(state, "prometheus", [
            binary, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'prometheus'}",
            f"--web.listen-address={state.host}:{port}"])
        self._wait(prometheus, lambda: port_open(state.host, port), "Prometheus", timeout)
        state.prometheus = f"http://{state.host}:{port}"
        self._save(state)

    # -- down and status --------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stop every process of the cluster; return the names of the services that were running.

        The scheduler goes first, so that it is not left driving dead actors. Each Ray node's
        `ray start --block` gets SIGTERM and stops its node's processes itself (its raylet and GCS
        would each drain for half a minute if signalled directly); the tracker and Prometheus get
        SIGTERM, PostgreSQL a fast shutdown (SIGINT) last. Then every process still carrying this
        cluster's marker (FARM_CLUSTER in its environment, which `up` gives each service and Ray
        passes on to its workers, the actors' RPC servers included) is killed."""
        if not self.state_path.exists():
            return []
        state = ClusterState.load(self.state_path)
        running = {s.name: p for s in state.services if (p := s.process()) is not None}
        stopped = list(running)
        if "scheduler" in running:
            _stop(_family(running.pop("scheduler")), signal.SIGTERM, 15.0)
        postgres = running.pop("postgres", None)
        for name, proc in running.items():
            _signal(proc if name.startswith("ray-") else _family(proc), signal.SIGTERM)
        _stop([p for proc in running.values() for p in _family(proc)], None, RAY_DRAIN_SECONDS)
        if postgres is not None:
            _stop(_family(postgres), signal.SIGINT, 15.0)
        _stop(self._marked(), signal.SIGKILL, 5.0)  # orphans: the actors' RPC servers, Ray workers
        self._save(ClusterState(**{**asdict(state), "services": []}))
        return stopped

    def _marked(self) -> list[psutil.Process]:
        """The running processes that carry this cluster's marker (see `down`)."""
        marked = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get("FARM_CLUSTER") == str(self.folder):
                    marked.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return marked

    def status(self) -> dict[str, Any]:
        """The cluster as a document: addresses, and each service's pid, state and log."""
        if not self.state_path.exists():
            return {"folder": str(self.folder), "running": False, "services": []}
        state = ClusterState.load(self.state_path)
        services = [{"name": s.name, "pid": s.pid, "running": s.process() is not None, "log": s.log}
                    for s in state.services]
        doc = asdict(state)
        doc.update(folder=str(self.folder), running=any(s["running"] for s in services), services=services,
                   ray_auth_token_path=str(self.folder / TOKEN_FILE))
        return doc


def _postgres_bin() -> Path:
    """The folder of PostgreSQL's server programs (initdb, postgres, pg_isready, createdb, psql)."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True) \
        if Path("/usr/lib/postgresql").is_dir() else []
    for folder in candidates:
        if all((folder / tool).exists() for tool in ("initdb", "postgres", "pg_isready", "createdb", "psql")):
            return folder
    raise FarmError("PostgreSQL's server programs (initdb) are not installed: install PostgreSQL "
                    "(Debian: apt-get install postgresql), or give --db URL of a running database")


def _raylet_up(temp: Path) -> bool:
    return (temp / "session_latest" / "sockets" / "raylet").exists()


def _family(proc: psutil.Process) -> list[psutil.Process]:
    """The process and its descendants."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [proc]


def _signal(procs: psutil.Process | list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs if isinstance(procs, list) else [procs]:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _stop(procs: list[psutil.Process], sig: signal.Signals | None, grace: float) -> None:
    """Send `sig` (if any) to `procs`, wait up to `grace` seconds for them to end, then SIGKILL the rest."""
    if sig is not None:
        _signal(procs, sig)
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    _signal(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5.0)


# -- `farm cluster` ------------------------------------------------------------------------------

cluster_app = typer.Typer(help="The one-machine cluster: the farm's services as local processes.",
                          no_args_is_help=True)
FolderOption = Annotated[Path, typer.Option(help="The cluster's folder: state, logs, private database.")]


@cluster_app.command("up")
def up_command(
    folder: FolderOption = Path(".farm-cluster"),
    workers: Annotated[int, typer.Option(help="Ray worker nodes, each with GPUS_PER_WORKER GPUs (0: only the "
                                         "head's services; GPU hosts join with `ray start`).")] = 2,
    gpus_per_worker: Annotated[int, typer.Option(help="GPU resources per worker node (logical on a CPU-only "
                                                 "machine: their actors measure llvm kernels).")] = 1,
    db: Annotated[str | None, typer.Option(help="A running database's URL (default: a private PostgreSQL "
                                           "initialised in the folder).")] = None,
    host: Annotated[str, typer.Option(help="The address every service listens on; keep it private.")] = "127.0.0.1",
    ray_port: Annotated[int, typer.Option(help="The Ray head's port (0: a free one).")] = 0,
    tracker_port: Annotated[int, typer.Option(help="The RPC tracker's port (0: a free one).")] = 0,
) -> None:
    """Start PostgreSQL, a Ray head and worker nodes, the RPC tracker, the scheduler (and Prometheus)."""
    state = LocalCluster(folder).up(workers, gpus_per_worker, db, host, ray_port, tracker_port)
    print(f"cluster up in {folder}: {workers} Ray worker node(s) x {gpus_per_worker} GPU")
    _print_addresses(state.db, state.ray_address, state.tracker, state.prometheus)


@cluster_app.command("down")
def down_command(folder: FolderOption = Path(".farm-cluster")) -> None:
    """Stop every process of the cluster (its logs stay in the folder)."""
    stopped = LocalCluster(folder).down()
    print(f"stopped {', '.join(stopped)}" if stopped else f"no cluster running in {folder}")


@cluster_app.command("status")
def status_command(
    folder: FolderOption = Path(".farm-cluster"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The cluster's services (running or not, pid, log) and addresses."""
    doc = LocalCluster(folder).status()
    if as_json:
        print(json.dumps(doc, indent=2))
    elif not doc["services"]:
        print(f"no cluster in {folder}")
    else:
        for s in doc["services"]:
            print(f"{s['name']:<14} {'running' if s['running'] else 'stopped':<8} pid {s['pid']:<8} {s['log']}")
        _print_addresses(doc["db"], doc["ray_address"], doc["tracker"], doc["prometheus"])


def _print_addresses(db: str, ray_address: str, tracker: str, prometheus: str | None) -> None:
    print(f"database    {db}        (farm submit ... --db {db})")
    print(f"ray         {ray_address}   (RAY_AUTH_MODE=token; the token is in the folder's {TOKEN_FILE})")
    print(f"tracker     {tracker}")
    if prometheus:
        print(f"prometheus  {prometheus}")
