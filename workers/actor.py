"""Worker actors: one Ray actor per device, owning that device's RPC server.

An actor created with `num_gpus=1` sees one GPU (Ray sets CUDA_VISIBLE_DEVICES); it starts
the farm's RPC server pinned to it, registered with the farm's tracker under the device's
key, and measures through it with a kept-open session while its node's CPUs compile the
next candidates (a workers.device.LocalDevice). On a machine without GPUs the scheduler gives
the Ray cluster logical GPU resources, and the actors measure llvm kernels on the CPU.

A device that runs only a TVM RPC server registered with the tracker (a board in a lab, no
Ray) is driven by an actor with `own_server=False` and that device's key: the actor builds
and measures, the board only runs kernels.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from farm.core import metrics
from farm.core.host import usable_cores
from farm.core.task import Task
from farm.core.tvm_import import import_tvm
from workers.device import LocalDevice


class WorkerActor:
    """The body of a worker actor (wrapped with `ray.remote` by scheduler.ray_pool)."""

    def __init__(self, name: str, tracker: tuple[str, int], kind: str, key: str | None = None,
                 own_server: bool = True, build_workers: int | None = None, log_dir: str | None = None) -> None:
        import ray

        start = time.monotonic()
        _import_tvm_in_background()
        if log_dir:
            _log_to(Path(log_dir) / f"{name}-actor.log")
        gpus = [str(g) for g in ray.get_gpu_ids()]
        self.host = socket.gethostname()
        self.gpu = ",".join(gpus) if gpus else None
        self.device = LocalDevice(kind, name, tracker, key=key, gpu=self.gpu, own_server=own_server,
                                  host=os.environ.get("FARM_RPC_HOST", "127.0.0.1"),
                                  build_workers=build_workers or _build_slots(),
                                  log_dir=Path(log_dir) if log_dir else None).start()
        self.startup_seconds = time.monotonic() - start
        self.metrics_address = _serve_metrics(int(gpus[0]) if gpus else 0)
        metrics.start_worker(name, self.device.key, kind)

    def info(self) -> dict[str, Any]:
        """Where this worker runs (host, process id, GPU) and which device key it measures on."""
        return {"name": self.device.name, "host": self.host, "pid": os.getpid(), "gpu": self.gpu,
                "key": self.device.key,
                "startup_seconds": self.startup_seconds, "metrics_address": self.metrics_address,
                "busy_seconds": self.device.worker.busy_seconds}

    def build_and_measure(self, task_json: str, indices: list[int], shard: int, round_: int) -> list[dict[str, Any]]:
        """Build and measure; results as dicts (MeasureResult.to_json) for the object store."""
        task = Task.from_json(json.loads(task_json))
        return [r.to_json() for r in self.device.worker.build_and_measure(task, indices, shard, round_)]

    def device_name(self) -> str:
        """The name of the device it measures on, as its trials give it (workers.worker.Worker.device_name)."""
        return self.device.device_name()

    def cancel(self) -> None:
        """Stop the calls in flight (workers.worker.Worker.cancel); returns once they are told."""
        self.device.cancel()

    def close(self) -> None:
        metrics.set_worker_up(self.device.name, self.device.key, False)
        self.device.close()


def _log_to(path: Path) -> None:
    """The farm's INFO records of this actor process (start-up steps, sessions, build slots) go to
    `path`, on the actor's node: Ray keeps an actor's own output in its session folder, out of the
    user's sight. A path this node cannot write costs the log, never the actor."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as e:
        logging.getLogger("farm.worker").warning("cannot keep this worker's log in %s: %s", path, e)
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    farm_log = logging.getLogger("farm")
    farm_log.addHandler(handler)
    farm_log.setLevel(logging.INFO)


def _import_tvm_in_background() -> None:
    """Import TVM as the farm's processes do (farm.core.tvm_import: without torch) in a thread of
    its own, and return once that import has begun: any later `import tvm` in this process, in any
    thread, then waits for it rather than importing TVM as it comes. Without this, the device's
    registration thread imported TVM first, and with torch where torch is installed (most of the
    import's time), before the first session could open, which waited seconds for it
    (docs/defaults.md#start-up).
    In the background, because nothing of the device's start needs TVM in this process: its
    tracker, server and build processes are processes of their own. The other threads import TVM
    by its package first (`import tvm`, `from tvm import rpc`), which waits for a package being
    initialised; a dotted `import tvm.rpc` would not wait for it (Python's import system)."""
    importing = threading.Thread(target=import_tvm, daemon=True, name="farm-import-tvm")
    importing.start()
    while "tvm" not in sys.modules and importing.is_alive():
        time.sleep(0.001)


def _build_slots() -> int:
    """Build processes for one device: this node's cores shared by its devices (its GPU
    resources), so that two GPUs of one host do not run twice as many compiles as it has cores."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
    return max(1, usable_cores() // max(1, int(gpus)))


def _serve_metrics(local_gpu: int) -> str:
    """Serve this actor's metrics on its node (farm.core.metrics.worker_port, on FARM_METRICS_HOST,
    default 127.0.0.1); the HOST:PORT Prometheus scrapes. When the port is taken (another farm on
    this machine), a free one: the scheduler lists the actual addresses (scheduler.service)."""
    import ray

    host = os.environ.get("FARM_METRICS_HOST", "127.0.0.1")
    try:
        port = metrics.serve(metrics.worker_port(local_gpu), host)
    except OSError:
        port = metrics.serve(0, host)
    return f"{ray.util.get_node_ip_address() if host == '0.0.0.0' else host}:{port}"
