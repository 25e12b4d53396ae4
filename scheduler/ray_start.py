"""Ray for the scheduler's pools: `RayStart` starts (or joins) it once, counts its devices and
starts the Ray worker pools (scheduler.ray_pool) on it; `close` stops what it started."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from scheduler.cluster import init_ray, stop_ray
from scheduler.pool import WorkerPool
from scheduler.ray_pool import RayWorkerPool
from workers.compiler import warm_nvcc

log = logging.getLogger("farm.scheduler")


class RayStart:
    """Ray at `address` (None: started on this machine, stopped by `stop`), and the worker pools
    started on it: actors of the devices registered with `tracker`."""

    def __init__(self, address: str | None, tracker: tuple[str, int], build_workers: int | None,
                 log_dir: Path | None) -> None:
        self.ray_address, self.tracker = address, tracker
        self.build_workers, self.log_dir = build_workers, log_dir
        self._started_ray = False  # a local Ray instance started here, stopped by stop()
        self.ready = False
        self._lock = threading.Lock()

    def start(self, kind: str = "") -> None:
        """Start (or join) Ray once, saying so (`farm tune` shows these steps). Call it first from a
        thread that lives on: a Ray driver started in a thread that then ends loses its cluster."""
        with self._lock:
            if not self.ready:
                self._init_ray(kind)

    def _init_ray(self, kind: str) -> None:
        start = time.monotonic()
        if kind == "cuda" and self.ray_address is None:
            # This machine builds the kernels: its CUDA toolchain comes off disk while Ray starts.
            threading.Thread(target=_warm_nvcc, daemon=True, name="farm-nvcc-warm").start()
        log.info("starting Ray")
        self._started_ray = init_ray(self.ray_address) or self._started_ray
        self.ready = True
        log.info("Ray ready in %.1f s", time.monotonic() - start)

    def pool(self, kind: str, count: int, keys: Sequence[str], name: str = "") -> WorkerPool:
        start = time.monotonic()
        self.start(kind)
        log.info("starting %d %s worker actor(s): build processes, RPC servers", count, kind)
        pool = RayWorkerPool(self.tracker, kind, count, list(keys) or None, self.build_workers,
                             str(self.log_dir) if self.log_dir else None, name=name or f"{kind}-worker")
        log.info("%d %s worker actor(s) up in %.1f s (each: %s; RPC servers register meanwhile)", pool.size, kind,
                 time.monotonic() - start, ", ".join(f"{i['name']} {i['startup_seconds']:.1f} s" for i in pool.infos))
        return pool

    def devices(self) -> int | None:
        """The devices of the cluster the Ray pools use (GPUs; logical ones on a CPU cluster);
        None before Ray runs (it starts with the first job)."""
        if not self.ready:
            return None
        import ray

        return int(ray.cluster_resources().get("GPU", 0))

    def stop(self) -> None:
        """Stop the local Ray instance started here, if any."""
        if self._started_ray:
            stop_ray()
            self._started_ray = False


def _warm_nvcc() -> None:
    seconds = warm_nvcc()
    if seconds is not None:
        log.info("CUDA toolchain warmed: an empty kernel compiled in %.1f s", seconds)
