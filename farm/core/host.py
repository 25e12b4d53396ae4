"""What this process may use of the machine it runs on.

`os.cpu_count()` counts the machine's cores, not those this process may run on. A container
given part of a host (`docker run --cpus 4`, a CPU quota, or `--cpuset-cpus`), a job pinned with
`taskset`, or two benchmarks sharing a 2-GPU host by halves all see the whole machine there, and
sizing build pools by it oversubscribes their cores, which runs builds into their timeouts
(docs/defaults.md#usable-cores).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may keep busy, at least 1: those its CPU affinity allows
    (`sched_getaffinity`), fewer where its cgroup's CPU quota is smaller (a quota of 2.5 cores
    counts as 3, as Ray and the JVM count it). Read at each call: affinity can change."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The CPU quota of the cgroup mounted at `root`, rounded up to whole cores: cgroup v2's
    ``cpu.max`` ("QUOTA PERIOD", or "max" for none), else v1's ``cpu/cpu.cfs_quota_us`` over
    ``cpu/cpu.cfs_period_us`` (-1 for none). None where there is no quota or no such file.

    A container sees its own cgroup at the root of the mount (cgroup namespaces, Docker's default
    on cgroup v2), which is where Docker's ``--cpus`` puts the quota."""
    for quota_file, period_file in ((root / "cpu.max", None),
                                    (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us")):
        try:
            words = quota_file.read_text().split()
            if period_file is not None:
                words.append(period_file.read_text().strip())
        except OSError:
            continue
        try:
            quota, period = int(words[0]), int(words[1])
        except (ValueError, IndexError):  # "max" (v2) or an unreadable file: no quota
            return None
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    return None
