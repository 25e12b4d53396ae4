"""Targets: parse `llvm`, `cuda` or a JSON target dict into a TVM Target plus the limits
templates check configs against.

TVM 0.27 refuses the old string form (`"cuda -arch=sm_90"`): targets are dicts. The farm's
canonical form is that dict, so a target stored in the database round-trips exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from farm.core.errors import FarmError, brief
from farm.core.host import usable_cores
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
# Shared memory a block may have once its kernel opts in (cudaDevAttrMaxSharedMemoryPerBlockOptin),
# by compute capability (the CUDA C++ Programming Guide's table of technical specifications);
# without opting in, `max_shared_memory_per_block` (48 KiB). Unlisted: no opt-in beyond 48 KiB.
SHARED_MEMORY_OPTIN = {70: 96 * 1024, 75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024,
                       89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 101: 227 * 1024, 120: 99 * 1024}
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
# The attributes TVM 0.27 knows for each kind, and their types (what
# `tvm.target.TargetKind.options_from_name(kind)` lists; tests/test_targets.py checks this table
# against the installed TVM, and that TVM accepts every target the farm accepts). A target is
# checked against it without importing TVM, which takes seconds in a fresh process: `farm submit`
# validates a job completely without it.
_COMMON_OPTIONS = {"kind": "str", "keys": "Array<str>", "tag": "str", "device": "str", "model": "str",
                   "libs": "Array<str>", "host": "target.Target", "from_device": "int",
                   "target_device_type": "int", "mcpu": "str"}
TVM_OPTIONS: dict[str, dict[str, str]] = {
    "cuda": {**_COMMON_OPTIONS, "arch": "str", "max_shared_memory_per_block": "int",
             "max_threads_per_block": "int", "thread_warp_size": "int", "registers_per_block": "int",
             "l2_cache_size_bytes": "int", "max_num_threads": "int"},
    "llvm": {**_COMMON_OPTIONS, "mattr": "Array<str>", "mtriple": "str", "mfloat-abi": "str", "mabi": "str",
             "num-cores": "int", "fast-math": "bool", "fast-math-nnan": "bool", "fast-math-ninf": "bool",
             "fast-math-nsz": "bool", "fast-math-arcp": "bool", "fast-math-contract": "bool",
             "fast-math-reassoc": "bool", "opt-level": "int", "cl-opt": "Array<str>", "jit": "str",
             "vector-width": "int"},
}
# TVM's integer attributes are 64-bit.
_INT64 = (-(2**63), 2**63 - 1)


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
        return int(self.doc.get("num-cores", usable_cores()))

    @property
    def arch(self) -> str:
        return str(self.doc.get("arch", DEFAULT_CUDA["arch"]))

    @property
    def compute_capability(self) -> int:
        """The arch as a number: sm_90a -> 90."""
        return int(self.arch.removeprefix("sm_").rstrip("af"))

    @property
    def max_shared_memory_optin(self) -> int:
        """Shared memory per block for a kernel that opts in (SHARED_MEMORY_OPTIN), never less than
        `max_shared_memory_per_block`."""
        limit = self.limit("max_shared_memory_per_block")
        return max(limit, SHARED_MEMORY_OPTIN.get(self.compute_capability, limit))

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


def parse_target(text: str | dict[str, Any] | TargetSpec) -> TargetSpec:
    """`llvm`, `cuda`, or a JSON dict such as `{"kind": "cuda", "arch": "sm_80"}`.

    Raises FarmError for anything else (with the accepted forms in the message): a kind other
    than llvm or cuda, an attribute TVM does not know for that kind or of the wrong type
    (TVM_OPTIONS), a cuda arch not in CUDA_ARCHS, a numeric attribute outside NUMERIC_ATTRS'
    bounds. TVM is not imported.
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
    for name, value in doc.items():
        _check_option(kind, name, value)
    if kind == "cuda":
        doc = {**DEFAULT_CUDA, **doc}
        if doc["arch"] not in CUDA_ARCHS:
            raise FarmError(f"cuda arch {brief(doc['arch'])} is not one the farm compiles for; "
                            f"use one of {', '.join(CUDA_ARCHS)}")
    else:
        doc.setdefault("num-cores", usable_cores())
    for name, (low, high) in NUMERIC_ATTRS[kind].items():
        if name in doc:
            value = doc[name]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise FarmError(f"target attribute {name}={brief(value)} must be an integer in [{low}, {high}]")
    try:
        spec = TargetSpec(json.dumps(doc, sort_keys=True))
    except (TypeError, ValueError) as e:  # values that are not JSON (a set, an object)
        raise FarmError(f"target {brief(doc)} is not a JSON dict of attributes: {e}") from None
    return spec


def _check_option(kind: str, name: str, value: Any) -> None:
    """FarmError unless TVM knows attribute `name` for `kind` and `value` is of its type. Stricter
    than TVM where TVM converts: a bool attribute takes true or false (not 0 or 1), an integer
    one no boolean, and a host is llvm (the farm's hosts are CPUs)."""
    options = TVM_OPTIONS[kind]
    if name not in options:
        raise FarmError(f"target attribute {brief(name)} is not one TVM knows for {kind}; "
                        f"it knows {', '.join(sorted(options))}")
    want = options[name]
    if want == "str":
        ok = isinstance(value, str)
    elif want == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    elif want == "bool":
        ok = isinstance(value, bool)
    elif want == "Array<str>":
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
    else:  # target.Target: the host of a cuda target
        ok = value == "llvm" or (isinstance(value, dict) and value.get("kind") == "llvm")
        if ok and isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str) or key == "host":
                    raise FarmError(f"target host {brief(value)}: attribute names are strings, and a host has no host")
                _check_option("llvm", key, item)
    if not ok:
        kinds = {"str": "a string", "int": "a 64-bit integer", "bool": "true or false",
                 "Array<str>": "a list of strings", "target.Target": '"llvm" or an llvm target dict'}
        raise FarmError(f"target attribute {name}={brief(value)} must be {kinds[want]}")
