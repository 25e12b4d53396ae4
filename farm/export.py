"""Best-config export in the `farm.best/1` format (DESIGN.md, "Export").

One JSON document: `{"format": "farm.best/1", "records": [...]}`, one record per
(workload, target, device) with the fastest correct config, its latency statistics, GFLOPS,
the device, the TVM version, the template and its version, and when it was measured.
Files are written atomically (a temporary file renamed into place): a failed export never
leaves a half-written file.

Reading an export (`load`) trusts nothing in it: the format and every record are validated,
each config must be a point of the current template's space, and a record tuned against
another version of the template is refused unless the caller allows it. Nothing from an
export is executed but the farm's own templates with validated knob values.

`write_metaschedule` writes the same best configs as a MetaSchedule database (the schedule of
each as a trace), which `tvm.s_tir.meta_schedule.database.JSONDatabase` loads and
`tir_integration.compile_tir` applies in any TVM build pipeline.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from db.store import ResultStore
from farm.core.errors import FarmError, brief
from farm.core.files import replacing, writable_file, writable_folder
from farm.core.task import Task
from farm.core.untrusted import MAX_JSON_BYTES, check_depth, parse_json

FORMAT = "farm.best/1"
# A kernel slower than a day is not a measurement.
MAX_LATENCY_US = 8.64e10
_FIELDS = {"workload": dict, "target": dict, "template": str, "template_version": str, "config": dict,
           "latency_us": (int, float), "device": str}
# Every field a record may hold (`record` writes them all): one it does not know is refused, as a
# config's unknown knob is, rather than applied without a word (a typo, or a newer farm's field).
RECORD_FIELDS = frozenset({*_FIELDS, "latency_stats_us", "gflops", "tvm_version", "measured_at"})
DOCUMENT_FIELDS = frozenset({"format", "records"})


def record(task: Task, trial: dict[str, Any], template_version: str) -> dict[str, Any]:
    """The export record of one measured trial (a row of ResultStore.best), tuned with
    `template_version` of the task's template (which may be older than the farm's own)."""
    import tvm

    latencies = [float(x) for x in trial["latencies"]]
    median = statistics.median(latencies)
    return {
        "workload": task.workload.to_json(),
        "target": task.target.to_json(),
        "template": task.template.name,
        "template_version": template_version,
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


def job_records(store: ResultStore, job_id: int) -> list[dict[str, Any]]:
    """The best record of every kernel of the job that has a correct trial: of every task, and of
    a kernel tuned with several templates (one task each), the faster template's."""
    out = []
    for row in store.tasks(job_id):
        best = store.best(row["id"], 1)
        if best:
            task = Task.from_json({"workload": row["workload"], "target": row["target"], "template": row["template"]})
            out.append(record(task, best[0], row["template_version"]))
    return merge([export_document(out)])["records"]


FORMATS = ("farm", "metaschedule")
METASCHEDULE_FILES = ("database_workload.json", "database_tuning_record.json")


def write(records: list[dict[str, Any]], path: str | Path, format: str = "farm") -> None:
    """Write `records` as `format`: farm, one farm.best/1 JSON file; metaschedule, a folder
    holding a MetaSchedule JSON database. FarmError for another format."""
    check_output(path, format)
    if format == "farm":
        write_json_atomic(path, export_document(records))
    else:
        write_metaschedule(records, path)


def check_output(path: str | Path, format: str = "farm") -> Path:
    """`path` as a Path if an export of `format` can be written there: a file whose folder takes
    new files (farm), or a folder that holds no MetaSchedule database yet, in a folder that takes
    new files (metaschedule). FarmError otherwise, before anything is written."""
    if format not in FORMATS:
        raise FarmError(f"unknown export format {format!r}: use {' or '.join(FORMATS)}")
    if format == "farm":
        return writable_file(path)
    out = Path(path)
    if any((out / name).exists() for name in METASCHEDULE_FILES):
        raise FarmError(f"{out} already holds a MetaSchedule database; choose an empty folder")
    if out.exists() and not out.is_dir():
        raise FarmError(f"cannot write {out}: it is a file; a MetaSchedule export is a folder")
    if not out.parent.is_dir():
        raise FarmError(f"cannot write {out}: folder {out.parent} does not exist")
    writable_folder(out.parent, out)
    return out


def export_job(store: ResultStore, job_id: int, path: str | Path, format: str = "farm") -> list[dict[str, Any]]:
    """Write the job's best records to `path` as `format`, note the export in the store, and
    return the records. FarmError when no trial of the job ran correctly yet."""
    records = job_records(store, job_id)
    if not records:
        raise FarmError(f"job {job_id} has no correct trial to export yet")
    write(records, path, format)
    store.add_export(job_id, format, str(path), len(records))
    return records


def write_json_atomic(path: str | Path, doc: Any) -> None:
    """Write `doc` as JSON to `path`, whole or not at all (farm.core.files.replacing)."""
    with replacing(path) as tmp, tmp.open("w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


def export_document(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "records": records}


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def record_key(rec: dict[str, Any]) -> tuple[str, str, str]:
    """What one record is the best of: (workload, target, device)."""
    return (json.dumps(rec["workload"], sort_keys=True), json.dumps(rec["target"], sort_keys=True), rec["device"])


def merge(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document with the fastest record per (workload, target, device) of all `documents`."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for doc in documents:
        for rec in doc["records"]:
            key = record_key(rec)
            if key not in best or rec["latency_us"] < best[key]["latency_us"]:
                best[key] = rec
    return export_document(sorted(best.values(), key=record_key))


def load(path: str | Path, allow_stale: bool = False) -> dict[str, Any]:
    """Read and validate an export file; FarmError (one line, saying what is wrong) otherwise.

    `allow_stale` accepts records tuned against another version of their template (their
    configs must still be points of the current space).
    """
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # never more than the parser would take
    except OSError as e:
        raise FarmError(f"cannot read export {path}: {e.strerror}") from None
    return validate(parse_json(data, f"export {path}"), str(path), allow_stale)


def validate(doc: Any, source: str = "export", allow_stale: bool = False) -> dict[str, Any]:
    """`doc` if it is a well-formed farm.best/1 document whose configs fit the current templates."""
    check_depth(doc, source)
    if not isinstance(doc, dict) or "format" not in doc:
        raise FarmError(f"{source} is not a farm export: no \"format\" field")
    fmt = doc["format"]
    if fmt != FORMAT:
        if isinstance(fmt, str) and fmt.startswith("farm.best/"):
            raise FarmError(f"{source} has format {brief(fmt)}, newer than this farm reads ({FORMAT}): "
                            "upgrade the farm")
        raise FarmError(f"{source} has unknown format {brief(fmt)}; expected {FORMAT}")
    if not isinstance(doc.get("records"), list):
        raise FarmError(f"{source}: \"records\" must be a list")
    if unknown := set(doc) - DOCUMENT_FIELDS:
        raise FarmError(f"{source}: unknown top-level field(s) {brief(sorted(unknown))}; a {FORMAT} document "
                        f"holds only {', '.join(sorted(DOCUMENT_FIELDS))}")
    first: dict[tuple[str, str, str], int] = {}
    for n, rec in enumerate(doc["records"]):
        task = _validate_record(rec, f"{source}, record {n}", allow_stale)
        # One record per key (canonical: defaults filled in): two would leave which one a build
        # applies to the order of the file.
        key = (task.workload.key, task.target.doc_json, rec["device"])
        if key in first:
            raise FarmError(f"{source}: records {first[key]} and {n} are both the best of {_describe(key)}; "
                            "an export holds one record per (workload, target, device)")
        first[key] = n
    return doc


def _describe(key: tuple[str, str, str]) -> str:
    workload, target, device = key
    return f"workload {workload} on target {brief(target, 80)} and device {brief(device, 80)}"


def _validate_record(rec: Any, where: str, allow_stale: bool) -> Task:
    """The record's task, if `rec` is a well-formed record whose config fits the current template."""
    from farm.core.targets import parse_target
    from farm.core.workloads import workload_from_json

    if not isinstance(rec, dict):
        raise FarmError(f"{where}: a record must be a JSON object")
    if unknown := set(rec) - RECORD_FIELDS:
        raise FarmError(f"{where}: unknown field(s) {brief(sorted(unknown))}; a record holds "
                        f"{', '.join(sorted(RECORD_FIELDS))}")
    for field, kind in _FIELDS.items():
        if not isinstance(rec.get(field), kind) or isinstance(rec.get(field), bool):
            raise FarmError(f"{where}: field {field!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    # Compared, not converted: an integer of 400 digits does not fit a float, and NaN is not < anything.
    if not 0 < rec["latency_us"] < MAX_LATENCY_US:
        raise FarmError(f"{where}: latency_us must be a positive number of microseconds below {MAX_LATENCY_US:.0e}")
    try:
        # FarmError naming the templates that do schedule it, for one that does not.
        task = Task(workload_from_json(rec["workload"]), parse_target(rec["target"]), rec["template"])
        task.config_from_json(rec["config"])
    except FarmError as e:
        raise FarmError(f"{where}: {e}") from None
    if rec["template_version"] != task.template.version and not allow_stale:
        raise FarmError(f"{where}: tuned with {rec['template']} version {brief(rec['template_version'])}, the farm "
                        f"now has {task.template.version}; tune again, or accept it with --allow-stale")
    return task


def _replays(task: Task, sch: Any) -> bool:
    """Whether `sch`'s trace, replayed on the workload's own PrimFunc as MetaSchedule replays a
    tuning record, makes the module `sch` made (not so where a template schedules the
    computation written another way: cuda.tensorcore's convolutions)."""
    import tvm

    from farm.core.templates.base import new_schedule

    replay = new_schedule(task.workload)
    try:
        sch.trace.apply_to_schedule(replay, remove_postproc=False)
        tvm.ir.assert_structural_equal(replay.mod, sch.mod)
    except (RuntimeError, ValueError):  # a step that does not apply (TVM's errors), or another module
        return False
    return True


def metaschedule_schedule(rec: dict[str, Any]) -> tuple[dict[str, Any], Task, Any]:
    """(record, its task, the schedule its config makes) of a record MetaSchedule can replay;
    FarmError, saying why and what to do instead, for one it cannot (write_metaschedule)."""
    from farm.core.targets import parse_target
    from farm.core.templates.base import DEFAULT_PIPELINE, tir_pipeline
    from farm.core.workloads import workload_from_json

    task = Task(workload_from_json(rec["workload"]), parse_target(rec["target"]), rec.get("template"))
    sch = task.schedule(task.config_from_json(rec["config"]))
    if tir_pipeline(sch.mod) != DEFAULT_PIPELINE:
        raise FarmError(f"{task.template.name} kernels are written in TIRx, not scheduled, so MetaSchedule "
                        f"cannot replay them: export {task.workload} with --format farm (the default) and build "
                        "it with `farm build`")
    if not _replays(task, sch):
        raise FarmError(f"{task.template.name} schedules {task.workload} from a rewritten PrimFunc, so "
                        "MetaSchedule's replay of its trace on the workload would build another kernel: export "
                        "it with --format farm (the default) and build it with `farm build`")
    return rec, task, sch


def commit(database: Any, scheduled: list[tuple[dict[str, Any], Task, Any]]) -> None:
    """Commit each (record, task, schedule) of `metaschedule_schedule` to a MetaSchedule database:
    the kernel's unscheduled PrimFunc as its workload, the schedule's trace, the measured latency."""
    from tvm.s_tir import meta_schedule as ms

    from farm.core.templates.base import new_schedule

    for rec, task, sch in scheduled:
        mod = new_schedule(task.workload).mod
        database.commit_tuning_record(ms.database.TuningRecord(
            sch.trace, database.commit_workload(mod), [rec["latency_us"] / 1e6], task.target.tvm(),
            ms.arg_info.ArgInfo.from_prim_func(mod["main"])))


def write_metaschedule(records: list[dict[str, Any]], folder: str | Path) -> Path:
    """Write `records` as a MetaSchedule JSON database in `folder` (created; must not hold one).

    Each record becomes a workload (the kernel's unscheduled PrimFunc) and a tuning record
    whose trace is the template's schedule for the config, with the measured latencies.
    FarmError, before anything is written, for a record whose kernel is not a schedule of its
    workload (a kernel written in TIRx, such as cuda.wgmma's, or scheduled from a rewritten
    PrimFunc, such as cuda.tensorcore's convolutions): MetaSchedule could not replay it.
    """
    from tvm.s_tir import meta_schedule as ms

    scheduled = [metaschedule_schedule(rec) for rec in records]  # all before anything is written
    out = check_output(folder, "metaschedule")
    files = [out / name for name in METASCHEDULE_FILES]
    # Build the database in a temporary folder, then move it into place: never half-written.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        commit(ms.database.JSONDatabase(str(tmp / files[0].name), str(tmp / files[1].name), allow_missing=True),
               scheduled)
        out.mkdir(exist_ok=True)
        for f in files:
            os.replace(tmp / f.name, f)
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
    return out
