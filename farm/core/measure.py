"""What measuring one candidate yields. Failures are data: every outcome is a MeasureResult."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    OK = "ok"
    BUILD_ERROR = "build_error"  # the template or the compiler failed
    INVALID = "invalid"  # built, but breaks a device limit (threads, smem, registers)
    RUNTIME_ERROR = "runtime_error"  # launch failed, the server crashed, ...
    TIMEOUT = "timeout"  # build or run took longer than its limit
    WRONG_RESULT = "wrong_result"  # ran, but its output differs from the reference


@dataclass
class MeasureResult:
    """One candidate's outcome. `latencies` holds every repeat's mean time in seconds."""

    config_index: int
    config: dict[str, Any]
    status: Status
    error: str = ""
    latencies: list[float] = field(default_factory=list)
    build_seconds: float = 0.0
    run_seconds: float = 0.0
    device: str = ""
    worker: str = ""
    shard: int = 0
    round: int = 0
    # When and where its steps ran, epoch seconds: "build" [start, end] and "slot" (the build
    # process, host:pid), "measure" [start, end] on the device, "timed" [[start, end], ...]: the
    # calls of the timed kernel runs (the device's busy time). Empty where nothing ran.
    timeline: dict[str, Any] = field(default_factory=dict)
    # What proposed the config (farm.core.search.ORIGINS: "random", "explore", "plan", ...), set by
    # the tuning loop; empty where nothing says (a worker's own result, a trial stored before).
    origin: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK  # also when the status came back as a plain string

    @property
    def latency(self) -> float | None:
        """Median of the repeats in seconds, None unless the candidate ran correctly."""
        return statistics.median(self.latencies) if self.ok and self.latencies else None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["status"] = self.status.value
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> MeasureResult:
        """Inverse of `to_json` (results cross process boundaries as plain dicts)."""
        return cls(**{**doc, "status": Status(doc["status"])})
