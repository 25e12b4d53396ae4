"""The Ray cluster the scheduler's worker actors run on: joined, or started on this machine.

`farm tune`, the embedded `farm.Client()` and a `farm scheduler` without `--ray-address`
start Ray here; with an address they join a running cluster (`ray start --head` on the head
node, `ray start --address` on each GPU node).
"""

from __future__ import annotations

import logging


def init_ray(address: str | None = None, logical_gpus: int = 0) -> None:
    """Connect to the Ray cluster at `address`, or start a local one (once per process).

    A local instance without GPUs gets `logical_gpus` GPU resources, so that one worker actor
    per "device" can be placed; those actors measure llvm kernels on the CPU.
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
    ray.init(num_gpus=max(gpus, logical_gpus), include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False, configure_logging=False)
