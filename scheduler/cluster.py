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

Stopping: SIGTERM and SIGINT stay the farm's (`stop_on_signals`), wherever Ray starts. `ray.init`
replaces SIGTERM's Python handler with its own (`sys.exit`) in the main thread, and its core worker
installs Abseil's failure-signal handler for SIGTERM in every thread: that one calls the previous
handler, then aborts the process 3 s later, whatever the handler is doing (giving a job back). The
driver's core worker is started without it; `init_ray` puts the Python handler back.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

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
    with _signals_kept():
        return _init_ray(address)


def _init_ray(address: str | None) -> bool:
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
    from farm.core.host import VISIBLE_GPUS_ENV, gpu_count, usable_cores

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


@contextmanager
def _signals_kept() -> Iterator[None]:
    """Ray starts in this block without taking SIGTERM from the farm (see the module docstring):
    its driver's core worker without Abseil's failure-signal handler (Ray's own switch for it, read
    from this constant when the driver connects; the processes Ray starts keep theirs), and, in the
    main thread, SIGTERM's Python handler as it was."""
    import ray._private.ray_constants as constants

    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def stop_on_signals(program: bool = False) -> bool:
    """SIGTERM (docker stop, systemd, kill) raises KeyboardInterrupt in the main thread, as SIGINT
    (Ctrl-C) does: the process stops as from Ctrl-C, giving its jobs back or cancelling them, and
    closing what it started. Where SIGTERM already has a handler of the program's own (a program
    that embeds the farm), that handler is kept. With `program` (the farm is the program: its CLI),
    SIGINT is taken back too where it is ignored (a shell without job control starts background
    commands so), so that SIGINT stops it however it was started. A no-op outside the main thread.
    True when it installed the SIGTERM handler (`restore_sigterm` undoes it)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if program and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False
    signal.signal(signal.SIGTERM, _interrupt)
    return True


def restore_sigterm() -> None:
    """Undo `stop_on_signals`'s SIGTERM handler (from the main thread; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _interrupt:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def stop_ray() -> None:
    """Stop the local Ray instance `init_ray` started. Call it from the thread that started it:
    there Ray's driver shuts down in a fraction of a second; from any other thread (Ray's own exit
    hook in the main thread, when a client ran its jobs in a thread) it waits 5 s more (Ray 2.60).
    Where some of the instance's processes have died already (they got the signal that stops this
    process), the others are killed without a word to them."""
    import ray
    from ray._private import worker

    node = worker._global_node
    if node is not None and not node.remaining_processes_alive():
        # Part of the instance ended with this process's own signal (SIGTERM to its process group, as
        # systemd sends it): ray.shutdown would wait 5-6 s on the dead GCS to disconnect the driver.
        # The process is ending: the instance's other processes are killed, the driver left as it is
        # (this process cannot start Ray again).
        logging.getLogger("farm.scheduler").info("Ray's processes are ending with this one: killing the rest")
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        atexit.unregister(worker.shutdown)  # which would wait on the GCS all the same
        return
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
