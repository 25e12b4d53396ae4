"""Build functions that fail on purpose, run in ProcessPoolBuilder's build processes (tests/test_builder.py)."""

from __future__ import annotations

import os
import time

from workers.builder import BuildResult, build_one

HANG, CRASH = 3, 5  # config indices that hang and crash the compiler process


def faulty_build(task_json: str, index: int, out_dir: str) -> BuildResult:
    """`build_one`, except that config HANG never finishes and config CRASH kills its process."""
    if index == HANG:
        time.sleep(3600)
    if index == CRASH:
        os._exit(139)  # as a segfault in the compiler would
    return build_one(task_json, index, out_dir)
