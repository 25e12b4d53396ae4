"""Best-config export in the `farm.best/1` format (DESIGN.md, "Export").

One JSON document: `{"format": "farm.best/1", "records": [...]}`, one record per
(workload, target, device) with the fastest correct config, its latency statistics, GFLOPS,
the device, the TVM version, the template and its version, and when it was measured.
Files are written atomically (a temporary file renamed into place): a failed export never
leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from farm.errors import FarmError
from farm.task import Task

FORMAT = "farm.best/1"


def record(task: Task, trial: dict[str, Any]) -> dict[str, Any]:
    """The export record of one measured trial (a row of ResultStore.best)."""
    import tvm

    latencies = [float(x) for x in trial["latencies"]]
    median = statistics.median(latencies)
    return {
        "workload": task.workload.to_json(),
        "target": task.target.to_json(),
        "template": task.template.name,
        "template_version": task.template.version,
        "config": trial["config"],
        "latency_us": median * 1e6,
        "latency_stats_us": {
            "min": min(latencies) * 1e6,
            "max": max(latencies) * 1e6,
            "mean": statistics.fmean(latencies) * 1e6,
            "stdev": (statistics.stdev(latencies) if len(latencies) > 1 else 0.0) * 1e6,
            "repeats": len(latencies),
        },
        "gflops": task.workload.flops() / median / 1e9,
        "device": trial["device"],
        "tvm_version": tvm.__version__,
        "measured_at": _iso(trial["created_at"]),
    }


def job_records(store: Any, job_id: int) -> list[dict[str, Any]]:
    """The best record of every task of the job that has a correct trial."""
    out = []
    for row in store.tasks(job_id):
        best = store.best(row["id"], 1)
        if best:
            task = Task.from_json({"workload": row["workload"], "target": row["target"]})
            out.append(record(task, best[0]))
    return out


def write_json_atomic(path: str | Path, doc: Any) -> None:
    """Write `doc` as JSON to `path` via a temporary file in the same folder."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise FarmError(f"cannot write {target}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_document(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "records": records}


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
