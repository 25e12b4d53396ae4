"""Run a module as a child that dies with the process that started it.

    python -m workers.lifeline PARENT_PID MODULE [ARGS ...]

runs ``python -m MODULE ARGS ...`` in this process, and kills this process's whole process group
(it must lead one: workers.processes.spawn_module starts it with start_new_session) as soon as
PARENT_PID is no longer its parent: the parent ended, even by SIGKILL, and the child was handed
to init. So an RPC tracker or server never outlives the scheduler, worker actor or test that
started it, however that one ended.

Why not prctl(PR_SET_PDEATHSIG)? It fires when the *thread* that forked the child ends, not its
process: a tracker started from a job's thread, or restarted by a watchdog thread, would be
killed with that thread. Polling getppid() (every `POLL_SECONDS`) has no such catch.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_SECONDS = 0.5


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    # The group: what the module started (TVM's serving processes) goes with it.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    """`argv`: PARENT_PID MODULE [ARGS ...] (see the module docstring)."""
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m workers.lifeline PARENT_PID MODULE [ARGS ...]")
    parent, module, args = int(argv[0]), argv[1], argv[2:]
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="farm-lifeline").start()
    if module.split(".")[0] == "tvm":
        from farm.core.tvm_import import import_tvm

        import_tvm()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
