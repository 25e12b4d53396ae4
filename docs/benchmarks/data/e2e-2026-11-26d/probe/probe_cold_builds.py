"""The probe behind workers/build_preload_cuda.py's figures (2 x H100 host, 32 cores, 2026-11-26):
a tidied copy of the ad-hoc script run there (same steps; this copy ran only on 2 cores). From
the repository root with PYTHONPATH=.:

    python probe_cold_builds.py 32 none    # 32 build processes forked from a parent that imported TVM
    python probe_cold_builds.py 32 llvm    # ... from a parent that also built one llvm kernel
    python probe_cold_builds.py 32 cuda    # ... from a parent that also built one cuda kernel

Each forked process builds two quick (auto_unroll_max_step 0) resnet-last-conv configs for
cuda sm_90 through the builder's own steps, all processes at once; printed: the median and max
seconds of their first and second builds. Run there: none 7.18 / 7.26 s median first build (max
7.38 / 7.40), llvm 7.16 s, cuda 0.93 / 0.86 s (max 2.35 / 2.52); second builds 0.89-1.05 s.
"""

import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.templates.verify import verify_gpu
from farm.core.workloads import make_workload
from workers.builder import _init_pool_process, _task, build_one
from workers.compiler import BuildResult, compile_into

CUDA = {"kind": "cuda", "arch": "sm_90"}


def quick_config(task: Task, rng: np.random.Generator) -> int:
    while True:
        i = int(rng.integers(task.space.size))
        config = task.space.get(i)
        if config.to_json().get("auto_unroll_max_step") == 0 and not task.check(config):
            return i


def two_builds(seed: int) -> list[float]:
    """Seconds of this process's first and second build (schedule, verify, compile with nvcc)."""
    task = Task(make_workload("resnet-last-conv", {}), parse_target(CUDA))
    task_json = json.dumps(task.to_json(), sort_keys=True)
    rng, out, seconds = np.random.default_rng(seed), tempfile.mkdtemp(), []
    for rep in range(2):
        index = quick_config(task, rng)
        start = time.perf_counter()
        built = _task(task_json)
        sch = built.schedule(built.space.get(index))
        verify_gpu(sch.mod, built.target)
        compile_into(sch.mod, built.target, Path(out) / f"c{seed}-{rep}", BuildResult(index, {}))
        seconds.append(time.perf_counter() - start)
    return seconds


def warm(kind: str) -> None:
    task = Task(make_workload("matmul", {"M": 16, "N": 16, "K": 16}), parse_target(CUDA if kind == "cuda" else kind))
    index = next(i for i in range(task.space.size) if task.check(task.space.get(i)) is None)
    build_one(json.dumps(task.to_json(), sort_keys=True), index, tempfile.mkdtemp())


if __name__ == "__main__":
    n, kind = int(sys.argv[1]), sys.argv[2]
    _init_pool_process()
    if kind != "none":
        warm(kind)
    with mp.get_context("fork").Pool(n) as pool:
        runs = pool.map(two_builds, range(n))
    for rep in range(2):
        s = sorted(r[rep] for r in runs)
        print(f"{kind}: build {rep + 1}: median {s[n // 2]:.2f} s, max {s[-1]:.2f} s")
