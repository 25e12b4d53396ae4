"""farm.core.host: the cores a process may use, from its CPU affinity and its cgroup's quota."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from farm.core.host import cgroup_cpu_quota, usable_cores

ROOT = Path(__file__).resolve().parent.parent


def _pinned(code: str, cores: set[int]) -> str:
    """`code`'s output, run by a fresh interpreter whose affinity allows `cores` only (taskset's
    way: the child inherits it from before exec)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores)).stdout.strip()


def test_a_pinned_process_counts_and_builds_on_its_own_cores() -> None:
    """Pinned to one core of a larger machine, a process counts one core, and so do the pools the
    farm sizes by it: the node's build slots and an llvm target's threads."""
    assert os.cpu_count() and os.cpu_count() > 1, "needs a machine of 2 cores or more"
    code = ("from farm.core.host import usable_cores; from workers.builder import ProcessPoolBuilder; "
            "from farm.core.targets import parse_target; b = ProcessPoolBuilder(); "
            "print(usable_cores(), b.workers, parse_target('llvm').num_cores); b.close()")
    assert _pinned(code, {0}) == "1 1 1"
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2, 1.5 cores: counted as 2
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "max 100000\n"}, None),  # no quota
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbled"}, None),
    ({}, None),  # no cgroup file: no quota known
], ids=["v2-1.5", "v2-2", "v2-max", "v1-0.5", "v1-none", "garbled", "none"])
def test_cgroup_quota_in_whole_cores(tmp_path: Path, files: dict[str, str], quota: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == (min(affinity, quota) if quota else affinity)
