"""Worker actors: one Ray actor per device, owning that device's RPC server.

An actor created with `num_gpus=1` sees one GPU (Ray sets CUDA_VISIBLE_DEVICES); it starts
the farm's RPC server pinned to it, registered with the farm's tracker under the device's
key, and measures through it with a kept-open session while its node's CPUs compile the
next candidates (workers.worker.Worker). On a machine without GPUs the scheduler gives the
Ray cluster logical GPU resources, and the actors measure llvm kernels on the CPU.

A device that runs only a TVM RPC server registered with the tracker (a board in a lab, no
Ray) is driven by an actor with `own_server=False` and that device's key: the actor builds
and measures, the board only runs kernels.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from farm.task import Task
from workers.device import ServerProcess, wait_for_keys
from workers.worker import Worker, WorkerConfig


class WorkerActor:
    """The body of a worker actor (wrapped with `ray.remote` by scheduler.ray_pool)."""

    def __init__(self, name: str, tracker: tuple[str, int], kind: str, key: str | None = None,
                 own_server: bool = True, build_workers: int | None = None, log_dir: str | None = None) -> None:
        import ray

        gpus = [str(g) for g in ray.get_gpu_ids()]
        self.host = socket.gethostname()
        self.gpu = ",".join(gpus) if gpus else None
        self.key = key or f"farm-{kind}-{self.host}-{name}"
        self.server: ServerProcess | None = None
        if own_server:
            log = Path(log_dir) / f"{name}.log" if log_dir else None
            self.server = ServerProcess(tracker, self.key, kind, self.gpu if kind == "cuda" else None,
                                        host=os.environ.get("FARM_RPC_HOST", "127.0.0.1"), log=log)
            wait_for_keys(tracker, [self.key], 90.0, [self.server.proc])
        on_hang = self.server.kill_sessions if self.server is not None else None
        # On a device the farm does not own, a hung kernel holds the device until the server
        # ends the session: keep sessions short there.
        self.worker = Worker(WorkerConfig(name=name, tracker=tracker, key=self.key, kind=kind,
                                          build_workers=build_workers,
                                          session_timeout=600.0 if own_server else 120.0), on_hang=on_hang)

    def info(self) -> dict[str, Any]:
        """Where this worker runs and which device key it measures on."""
        return {"name": self.worker.config.name, "host": self.host, "gpu": self.gpu, "key": self.key,
                "busy_seconds": self.worker.busy_seconds}

    def process(self, task_json: str, indices: list[int], shard: int, round_: int) -> list[dict[str, Any]]:
        """Build and measure; results as dicts (MeasureResult.to_json) for the object store."""
        task = Task.from_json(json.loads(task_json))
        return [r.to_json() for r in self.worker.process(task, indices, shard, round_)]

    def close(self) -> None:
        self.worker.close()
        if self.server is not None:
            self.server.stop()

