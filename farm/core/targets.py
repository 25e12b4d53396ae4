"""Targets: parse `llvm`, `cuda` or a JSON target dict into a TVM Target plus the limits
templates check configs against.

TVM 0.27 refuses the old string form (`"cuda -arch=sm_90"`): targets are dicts. The farm's
canonical form is that dict, so a target stored in the database round-trips exactly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from farm.core.errors import FarmError, brief
from farm.core.untrusted import check_depth, parse_json

# The fleet's GPUs are Hopper (H100/H200); a `cuda` target without an arch means sm_90.
DEFAULT_CUDA: dict[str, Any] = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 32,
    "registers_per_block": 65536,
}
KINDS = ("llvm", "cuda")
# The CUDA architectures a target may name: the compute capabilities of CUDA 12's toolkits, from
# Maxwell (sm_50) to Blackwell (sm_120), with the arch-specific "a" variants of Hopper and
# Blackwell. Anything else (sm_999, sm_35) would only fail when the first kernel is compiled.
CUDA_ARCHS = (
    "sm_50", "sm_52", "sm_53", "sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75", "sm_80", "sm_86",
    "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_101", "sm_101a", "sm_120", "sm_120a",
)
# Numeric attributes a target may set, with their bounds (inclusive). TVM checks only their type,
# and templates size thread blocks and tiles from them, so a nonsense value (num-cores=-4, a
# 10^9-thread block) would be accepted and fail, or mean something else, much later.
NUMERIC_ATTRS: dict[str, dict[str, tuple[int, int]]] = {
    "cuda": {
        "max_threads_per_block": (32, 1024),  # every CUDA GPU: 1024
        "max_shared_memory_per_block": (1024, 256 * 1024),  # H100/H200: 227 KiB opt-in
        "thread_warp_size": (32, 32),
        "registers_per_block": (1024, 65536),  # every CUDA GPU since Kepler: 64 K
        "max_num_threads": (32, 1024),
    },
    "llvm": {"num-cores": (1, 1024)},
}
# A target is a small dict; anything much larger is not one.
MAX_TARGET_CHARS = 4096


@dataclass(frozen=True)
class TargetSpec:
    """A target as the farm stores it: a JSON-able dict with a `kind`."""

    doc_json: str

    @cached_property
    def doc(self) -> dict[str, Any]:
        return json.loads(self.doc_json)

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def limit(self, name: str) -> int:
        """A cuda resource limit (threads, shared memory, registers) for validity checks."""
        return int(self.doc.get(name, DEFAULT_CUDA[name]))

    @property
    def max_vthreads(self) -> int:
        return 8  # TVM's own VerifyGPUCode bound (MetaSchedule postproc)

    @property
    def num_cores(self) -> int:
        return int(self.doc.get("num-cores", os.cpu_count() or 1))

    @property
    def arch(self) -> str:
        return str(self.doc.get("arch", DEFAULT_CUDA["arch"]))

    def tvm(self) -> Any:
        """The tvm.target.Target (the llvm kind gets a host-native CPU unless one is named)."""
        import tvm

        # Our own limit key is not a TVM attribute.
        doc = {k: v for k, v in self.doc.items() if k != "registers_per_block"}
        return tvm.target.Target(doc)

    def to_json(self) -> dict[str, Any]:
        return dict(self.doc)

    def __str__(self) -> str:
        if self.kind == "cuda":
            return f"cuda ({self.arch})"
        return self.kind


def parse_target(text: str | dict[str, Any] | TargetSpec, *, check_with_tvm: bool = True) -> TargetSpec:
    """`llvm`, `cuda`, or a JSON dict such as `{"kind": "cuda", "arch": "sm_80"}`.

    Raises FarmError for anything else (with the accepted forms in the message): a kind other
    than llvm or cuda, a cuda arch not in CUDA_ARCHS, a numeric attribute that is not an integer
    within NUMERIC_ATTRS' bounds, and (with `check_with_tvm`) an attribute TVM does not know:
    that check imports TVM, seconds in a fresh process, so a target the farm already checked
    (stored with its job) is read back without it.
    """
    if isinstance(text, TargetSpec):
        return text
    if isinstance(text, dict):
        check_depth(text, "target")
        doc = dict(text)
    elif isinstance(text, str):
        raw = text.strip()
        if len(raw) > MAX_TARGET_CHARS:
            raise FarmError(f"target is {len(raw):,} characters long; a target is a small JSON dict")
        if raw.startswith("{"):
            doc = parse_json(raw, "target")
        elif raw in KINDS:
            doc = {"kind": raw}
        else:
            raise FarmError(
                f"unknown target {brief(raw)}: use llvm, cuda, or a JSON dict like "
                '\'{"kind": "cuda", "arch": "sm_90"}\''
            )
    else:
        raise FarmError(f"target must be llvm, cuda or a dict, got {type(text).__name__} {brief(text)}")
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        raise FarmError(f"target {brief(doc)} needs \"kind\" set to one of {', '.join(KINDS)}")
    if not all(isinstance(key, str) for key in doc):
        raise FarmError(f"target {brief(doc)}: attribute names must be strings")
    kind = doc["kind"]
    if kind == "cuda":
        doc = {**DEFAULT_CUDA, **doc}
        if doc["arch"] not in CUDA_ARCHS:
            raise FarmError(f"cuda arch {brief(doc['arch'])} is not one the farm compiles for; "
                            f"use one of {', '.join(CUDA_ARCHS)}")
    else:
        doc.setdefault("num-cores", os.cpu_count() or 1)
    for name, (low, high) in NUMERIC_ATTRS[kind].items():
        if name in doc:
            value = doc[name]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise FarmError(f"target attribute {name}={brief(value)} must be an integer in [{low}, {high}]")
    try:
        spec = TargetSpec(json.dumps(doc, sort_keys=True))
    except (TypeError, ValueError) as e:  # values that are not JSON (a set, an object)
        raise FarmError(f"target {brief(doc)} is not a JSON dict of attributes: {e}") from None
    if not check_with_tvm:
        return spec
    try:
        spec.tvm()
    except Exception as e:  # TVM's own validation of attribute names and types
        raise FarmError(f"TVM rejects target {brief(doc, 200)}: {str(e).splitlines()[0][:200]}") from None
    return spec
