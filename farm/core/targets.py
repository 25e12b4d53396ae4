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

from farm.core.errors import FarmError

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


def parse_target(text: str | dict[str, Any] | TargetSpec) -> TargetSpec:
    """`llvm`, `cuda`, or a JSON dict such as `{"kind": "cuda", "arch": "sm_80"}`.

    Raises FarmError for anything else (with the accepted forms in the message).
    """
    if isinstance(text, TargetSpec):
        return text
    if isinstance(text, dict):
        doc = dict(text)
    else:
        raw = str(text).strip()
        if raw.startswith("{"):
            try:
                doc = json.loads(raw)
            except json.JSONDecodeError as e:
                raise FarmError(f"target JSON is malformed: {e.msg} at column {e.colno}") from None
        elif raw in KINDS:
            doc = {"kind": raw}
        else:
            raise FarmError(
                f"unknown target {raw!r}: use llvm, cuda, or a JSON dict like "
                '\'{"kind": "cuda", "arch": "sm_90"}\''
            )
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        raise FarmError(f"target {doc!r} needs \"kind\" set to one of {', '.join(KINDS)}")
    if doc["kind"] == "cuda":
        doc = {**DEFAULT_CUDA, **doc}
        arch = str(doc["arch"])
        if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
            raise FarmError(f"cuda arch {arch!r} must look like sm_90")
    else:
        doc.setdefault("num-cores", os.cpu_count() or 1)
    spec = TargetSpec(json.dumps(doc, sort_keys=True))
    try:
        spec.tvm()
    except Exception as e:  # TVM's own validation of attribute names and types
        raise FarmError(f"TVM rejects target {doc}: {str(e).splitlines()[0]}") from None
    return spec
