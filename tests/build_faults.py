"""Build functions that fail on purpose, run in ProcessPoolBuilder's build processes (tests/test_builder.py)."""

from __future__ import annotations

import os
import sys
import time

from workers.builder import build_one
from workers.compiler import BuildResult

HANG, CRASH = 3, 5  # config indices that hang and crash the compiler process
SLOW, SLOW_SECONDS = 7, 6.0  # a config index that paced_build takes this long to build
SPIN_SECONDS = 1.0  # the CPU time spinning_build computes for


def faulty_build(task_json: str, index: int, out_dir: str) -> BuildResult:
    """`build_one`, except that config HANG never finishes and config CRASH kills its process."""
    if index == HANG:
        time.sleep(3600)
    if index == CRASH:
        os._exit(139)  # as a segfault in the compiler would
    return build_one(task_json, index, out_dir)


def paced_build(task_json: str, index: int, out_dir: str) -> BuildResult:
    """A build that takes no time, except that config SLOW takes SLOW_SECONDS (nothing is compiled:
    the builder's timing, not a kernel, is under test)."""
    if index == SLOW:
        time.sleep(SLOW_SECONDS)
    return BuildResult(index, {})


def spinning_build(task_json: str, index: int, out_dir: str) -> BuildResult:
    """A build that computes for SPIN_SECONDS of its own CPU time (wall time passes without it
    while its process is stopped), then reports the wall seconds it took; nothing is compiled."""
    wall, cpu = time.monotonic(), time.process_time()
    while time.process_time() - cpu < SPIN_SECONDS:
        pass
    return BuildResult(index, {}, info={"wall_seconds": time.monotonic() - wall})


def warm_build_state(task_json: str, index: int, out_dir: str) -> BuildResult:
    """Builds nothing: reports what this build process inherited from its fork server's cuda
    warm-up build (workers.build_preload_cuda): its status, or None where the server made none."""
    preload = sys.modules.get("workers.build_preload_cuda")
    warm = getattr(preload, "result", None)
    return BuildResult(index, {}, info={"warm_build": None if warm is None else ("ok" if warm.ok else warm.error)})
