"""What this process may use of the machine it runs on: its cores, GPUs and CPU, a free port.

Cores: `usable_cores`, since `os.cpu_count()` counts the machine's cores, not those this process may run on. A container
given part of a host (`docker run --cpus 4`, a CPU quota, or `--cpuset-cpus`), a job pinned with
`taskset`, or two benchmarks sharing a 2-GPU host by halves all see the whole machine there, and
sizing build pools by it oversubscribes their cores, which runs builds into their timeouts
(docs/defaults.md#usable-cores). GPUs: `gpu_count`, those nvidia-smi lists narrowed by
CUDA_VISIBLE_DEVICES. Ports: `free_port`, one for a process started next to listen on, below the
kernel's ephemeral range.
"""

from __future__ import annotations

import functools
import math
import os
import random
import socket
import subprocess
import threading
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


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, "unknown" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"  # the GPUs CUDA shows a process


@functools.cache
def gpu_count() -> int:
    """GPUs this process may use, 0 when there are none: those nvidia-smi lists, narrowed by
    CUDA_VISIBLE_DEVICES where it is set (`visible_gpus`; nvidia-smi itself ignores it). Asked
    once per process: nvidia-smi takes a second or more on a GPU host, and `farm tune` needs the
    answer twice (its worker count, Ray's GPU resources)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    listed = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return visible_gpus(listed, os.environ.get(VISIBLE_GPUS_ENV))


def visible_gpus(listed: int, visible: str | None) -> int:
    """How many of a machine's `listed` GPUs CUDA shows a process whose CUDA_VISIBLE_DEVICES is
    `visible` (None: unset, all of them): its comma-separated entries up to the first that names
    no GPU (CUDA stops there: "1,7" on a 2-GPU machine is GPU 1 alone, "" and "-1" hide them all).
    An entry is an index below `listed`, or a GPU or MIG UUID (taken to exist)."""
    if visible is None:
        return listed
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < listed)):
            break
        count += 1
    return min(count, listed)


# Where `free_port` picks: above Ray's worker ports (10002-19999 by default), below the kernel's
# ephemeral range (Linux: 32768-60999 by default, /proc/sys/net/ipv4/ip_local_port_range).
PORTS_FROM = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED: set[int] = set()  # ports free_port gave out in this process
_HANDED_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a process started next to listen on.

    Picked at random below the kernel's ephemeral range where it can be, not by binding port 0:
    a port from bind(0) is ephemeral, and in the seconds before the process it is meant for binds
    it (a tracker imports TVM first) the kernel may hand it to any process that binds port 0 or
    connects, as Ray's components do by the dozen as they start. `farm tune` processes started at
    once on one GPU host lost a job so (docs/defaults.md#free-port). Where there is no room below
    the ephemeral range, an ephemeral port as before.

    A port is handed out once per process: the processes it is meant for bind later, so two draws
    before either binds could otherwise meet (`farm cluster up` gave a Ray head's GCS and its
    metrics exporter one port).
    """
    with _HANDED_LOCK:
        port = _draw_port(host)
        _HANDED.add(port)
        return port


def _draw_port(host: str) -> int:
    try:
        ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = PORTS_FROM  # unknown: no room, ephemeral ports
    draw = random.SystemRandom()  # not the random module's state, which tests and searches seed
    for _ in range(64 if ephemeral - PORTS_FROM >= 1000 else 0):
        port = draw.randrange(PORTS_FROM, ephemeral)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use (listening, connected or in TIME_WAIT): another
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
