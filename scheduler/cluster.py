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
    from workers.device import VISIBLE_GPUS_ENV, gpu_count

    gpus = gpu_count()
    logging.getLogger("ray").setLevel(logging.ERROR)  # its start-up notices are not the user's business
    # Ray refuses more GPU resources than CUDA_VISIBLE_DEVICES lists, and the logical GPUs of a
    # machine without visible GPUs are no CUDA devices: Ray starts without it there (it was
    # "Attempting to start raylet with 2 GPU, but CUDA_VISIBLE_DEVICES contains []" for llvm jobs
    # with the GPUs hidden). The instance's processes inherit the environment it starts with.
    hidden = os.environ.pop(VISIBLE_GPUS_ENV, None) if gpus == 0 else None
    try:
        # address="local": a new instance of our own, never a `ray start` cluster running on this machine.
        ray.init(address="local", _node_ip_address=LOOPBACK, num_gpus=gpus or os.cpu_count() or 1,
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    finally:
        if hidden is not None:
            os.environ[VISIBLE_GPUS_ENV] = hidden
    return True


def stop_ray() -> None:
    """Stop the local Ray instance `init_ray` started. Call it from the thread that started it:
    there Ray's driver shuts down in a fraction of a second; from any other thread (Ray's own exit
    hook in the main thread, when a client ran its jobs in a thread) it waits 5 s more (Ray 2.60)."""
    import ray

    _kill_autoscaler_monitor()
    ray.shutdown()


def _kill_autoscaler_monitor() -> None:
    """Kill the autoscaler's monitor of the local instance this process started, ahead of
    ray.shutdown(). That stops the instance's processes one after another, each given a second to
    exit on SIGTERM, and the monitor (which a single-node instance of fixed size has no use for)
    took the whole second every time: told to stop after the GCS it reports to had gone, it
    waits on it (Ray 2.60). Killed first, ray.shutdown() took 0.23-0.35 s instead of 1.37 s on 2
    cores, a second off every `farm tune`. Through Ray's private node handle: where a later Ray
    lacks it, nothing is killed and ray.shutdown() stops the monitor as before."""
    try:
        from ray._private import ray_constants, worker

        processes = worker._global_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
    except (ImportError, AttributeError):  # not a node this process started, or another Ray
        return
    for info in processes:
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(timeout=5)
