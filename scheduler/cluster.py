"""The Ray cluster the scheduler's worker actors run on: joined, or started on this machine.

`farm tune`, the embedded `farm.Client()` and a `farm scheduler` without `--ray-address`
start Ray here; with an address they join a running cluster (`ray start --head` on the head
node, `ray start --address` on each GPU node).
"""

from __future__ import annotations

import logging
import os


def init_ray(address: str | None = None) -> None:
    """Connect to the Ray cluster at `address`, or start a local one (once per process).

    A local instance on a machine without GPUs gets one logical GPU resource per core, so that
    one worker actor per "device" can be placed, whatever number of devices a job asks for up
    to the cores; those actors measure llvm kernels on the CPU.
    """
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return
    from workers.device import gpu_count

    gpus = gpu_count()
    logging.getLogger("ray").setLevel(logging.ERROR)  # its start-up notices are not the user's business
    # A new instance of our own (never a `ray start` cluster running on this machine), on the
    # loopback address: not on whatever interface Ray would pick (one that may go away, and that
    # would expose the cluster to the network).
    ray.init(address="local", _node_ip_address="127.0.0.1", num_gpus=gpus or os.cpu_count() or 1,
             include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
