"""The Ray cluster the scheduler's worker actors run on: joined, or started on this machine.

`farm tune`, the embedded `farm.Client()` and a `farm scheduler` without `--ray-address`
start Ray here; with an address they join a running cluster (`ray start --head` on the head
node, `ray start --address` on each GPU node).

A Ray cluster runs whatever its clients send it (Ray passes task arguments as cloudpickle), so
the one the farm starts is closed to everyone else:

- it listens on the loopback interface only: Ray binds its GCS, raylet and workers to 127.0.0.1
  when the node's address is exactly 127.0.0.1, and ray.init turns an explicit 127.0.0.1 into the
  machine's routable address unless Ray is in its single-machine mode, which
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects (Ray's default on Windows and macOS; Ray 2.60);
- token authentication is on (``RAY_AUTH_MODE=token``): every RPC to the cluster carries the
  token, which ray.init generates into ``~/.ray/auth_token`` (mode 600 under the user's home)
  unless ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` gives one.

A cluster the farm joins is configured by whoever started it: see docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Ray's switches, read from the environment by Ray itself (and by the processes it starts).
AUTH_MODE_ENV = "RAY_AUTH_MODE"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def init_ray(address: str | None = None) -> bool:
    """Connect to the Ray cluster at `address`, or start a local one (once per process); True
    when this call started a local instance (its starter stops it: `stop_ray`).

    A local instance listens on 127.0.0.1 only and requires Ray's token authentication (see the
    module docstring). On a machine without GPUs it gets one logical GPU resource per core, so
    that one worker actor per "device" can be placed, whatever number of devices a job asks for
    up to the cores; those actors measure llvm kernels on the CPU. A GPU machine whose GPUs
    CUDA_VISIBLE_DEVICES narrows gets those GPUs (Ray's own GPU ids are the visible ones).
    """
    if address:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return False
    # Before Ray reads them: at import for the single-machine switch, at init for the auth mode.
    os.environ[SINGLE_MACHINE_ENV] = "0"
    os.environ[AUTH_MODE_ENV] = "token"
    import ray

    if ray.is_initialized():
        return False
    # Ray may have been imported before these were set (by a test, or a library), and read them
    # then: its single-machine constant, and its cached config (which ray.init also refreshes this
    # way when it turns token authentication on by default).
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    from ray._raylet import AuthenticationMode, Config, get_authentication_mode

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        Config.initialize("")
    from farm.core.host import usable_cores
    from workers.device import VISIBLE_GPUS_ENV, gpu_count

    gpus = gpu_count()
    logging.getLogger("ray").setLevel(logging.ERROR)  # its start-up notices are not the user's business
    # Ray refuses more GPU resources than CUDA_VISIBLE_DEVICES lists, and the logical GPUs of a
    # machine without visible GPUs are no CUDA devices: Ray starts without it there (it was
    # "Attempting to start raylet with 2 GPU, but CUDA_VISIBLE_DEVICES contains []" for llvm jobs
    # with the GPUs hidden). The instance's processes inherit the environment it starts with.
    hidden = os.environ.pop(VISIBLE_GPUS_ENV, None) if gpus == 0 else None
    try:
        with _without_head_extras():
            # address="local": a new instance of our own, never a `ray start` cluster running on this machine.
            ray.init(address="local", _node_ip_address=LOOPBACK, num_gpus=gpus or usable_cores(),
                     include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                     configure_logging=False)
    finally:
        if hidden is not None:
            os.environ[VISIBLE_GPUS_ENV] = hidden
    return True


def stop_ray() -> None:
    """Stop the local Ray instance `init_ray` started. Call it from the thread that started it:
    there Ray's driver shuts down in a fraction of a second; from any other thread (Ray's own exit
    hook in the main thread, when a client ran its jobs in a thread) it waits 5 s more (Ray 2.60)."""
    import ray

    ray.shutdown()


# What ray.init starts on a new head node besides its GCS, raylet and the raylet's agents, none of
# which a farm's own instance uses (Ray 2.60, `ray._private.node.Node`):
# - the dashboard's API server (with include_dashboard=False, a process serving usage statistics):
#   ray.init waits for it to register before it starts the raylet, 0.5-0.6 s of its 2.4 s on
#   2 idle cores;
# - the autoscaler's monitor, for a cluster of fixed size: ray.shutdown stops it after the GCS it
#   reports to, and it then took a whole second to exit;
# - the log monitor, which streams the workers' output to the driver (log_to_driver=False: no one).
_HEAD_EXTRAS = ("start_api_server", "start_monitor", "start_log_monitor")


@contextmanager
def _without_head_extras() -> Iterator[None]:
    """While a local instance starts in this block, its node starts none of `_HEAD_EXTRAS`:
    each method of Ray's private node class is a no-op until the block ends. Where a later Ray
    lacks the class or one of them, that one starts as before."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield
        return
    saved = {name: Node.__dict__[name] for name in _HEAD_EXTRAS if name in Node.__dict__}
    try:
        for name in saved:
            setattr(Node, name, _skipped)
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


def _skipped(*_: object, **__: object) -> None:
    """Stands in for a node's method that starts a process the farm does not use."""
