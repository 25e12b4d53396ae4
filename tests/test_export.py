"""Best-config export: farm.best/1 files, MetaSchedule databases, merge, `farm build`, bad exports."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farm.apply import best_config, build
from farm.core.errors import FarmError
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.templates.base import new_schedule
from farm.core.workloads import make_workload
from farm.export import load, merge, validate, write_metaschedule

PARAMS = {"M": 96, "N": 64, "K": 80}
ARGS = [f"{k}={v}" for k, v in PARAMS.items()]


def farm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (small) tuning job's export."""
    tmp = tmp_path_factory.mktemp("tuned")
    proc = farm("tune", "matmul", *ARGS, "--trials", "10", "--db", f"sqlite:///{tmp}/farm.db", "--export",
                str(tmp / "best.json"), cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "best.json"


def _run(lib: Any, wl: Any) -> tuple[np.ndarray, float]:
    import tvm

    inputs = wl.random_inputs(7)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    out = tvm.runtime.tensor(np.full(wl.output_shape(), np.nan, wl.dtype), dev)
    lib["main"](*args, out)
    module = getattr(lib, "mod", lib)  # tvm.compile's Executable wraps the runtime module
    seconds = module.time_evaluator("main", dev, number=3, repeat=5, min_repeat_ms=10)(*args, out).median
    return out.numpy(), float(seconds)


@pytest.mark.slow
def test_export_then_farm_build_runs_the_tuned_kernel(tuned: Path, tmp_path: Path) -> None:
    import tvm

    rec = load(tuned)["records"][0]
    proc = farm("build", "matmul", *ARGS, "--best", str(tuned), "-o", str(tmp_path / "kernel.so"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    lib = tvm.runtime.load_module(str(tmp_path / "kernel.so"))
    wl = make_workload("matmul", PARAMS)
    got, seconds = _run(lib, wl)
    ref = wl.reference(wl.random_inputs(7))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < wl.tolerance()
    # The same kernel as measured: its latency agrees with the stored one within CPU noise.
    assert 0.33 < seconds * 1e6 / rec["latency_us"] < 3.0


@pytest.mark.slow
def test_metaschedule_database_builds_the_same_kernel(tuned: Path, tmp_path: Path) -> None:
    import tvm
    from tvm.s_tir import meta_schedule as ms

    rec = load(tuned)["records"][0]
    folder = write_metaschedule([rec], tmp_path / "msdb")
    db = ms.database.JSONDatabase(str(folder / "database_workload.json"),
                                  str(folder / "database_tuning_record.json"), allow_missing=False)
    task = Task(make_workload("matmul", PARAMS), parse_target(rec["target"]))
    sch = ms.tir_integration.compile_tir(db, new_schedule(task.workload).mod, task.target.tvm())
    assert sch is not None
    ours = task.schedule(task.space.from_json(rec["config"]))
    tvm.ir.assert_structural_equal(sch.mod, ours.mod)  # the same schedule, replayed from the trace
    got, _ = _run(tvm.compile(sch.mod, target=task.target.tvm()), task.workload)
    ref = task.workload.reference(task.workload.random_inputs(7))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < task.workload.tolerance()
    with pytest.raises(FarmError, match="already holds"):
        write_metaschedule([rec], folder)


def test_metaschedule_database_refuses_a_kernel_written_in_tirx(tmp_path: Path) -> None:
    """cuda.wgmma's kernels are TIRx, not a schedule of the workload: no trace could replay them,
    so the database is refused, in one error that says what to do, and nothing is written."""
    task = Task(make_workload("matmul", dict(M=256, N=256, K=256, dtype="float16")),
                parse_target({"kind": "cuda", "arch": "sm_90a"}))
    assert task.template.name == "cuda.wgmma"
    config = dict(warpgroups=1, slices=1, block_n=64, stages=2, raster=1, producer=0, tiles_per_block=1)
    rec = {"workload": task.workload.to_json(), "target": task.target.to_json(), "config": config,
           "latency_us": 10.0}
    with pytest.raises(FarmError, match=r"written in TIRx.*--format farm.*farm build"):
        write_metaschedule([rec], tmp_path / "msdb")
    assert not (tmp_path / "msdb").exists()


def test_metaschedule_database_refuses_a_schedule_of_a_rewritten_prim_func(tmp_path: Path) -> None:
    """cuda.tensorcore schedules a convolution that reads its kernel through a matrix view: the
    trace, replayed on the workload's own PrimFunc, would build another kernel, so the database
    is refused, in one error that says what to do, and nothing is written."""
    task = Task(make_workload("conv2d_nchw", dict(N=2, CI=16, H=8, W=8, CO=32, KH=3, KW=3, pad=1,
                                                  dtype="float16")), parse_target("cuda"))
    assert task.template.name == "cuda.tensorcore"
    config = dict(tile_i=[1, 2, 1], tile_j=[2, 1, 4], tile_k=[3, 3], vector=4, pad=0, pipeline=1,
                  auto_unroll_max_step=64, store=0, im2col=0)
    assert task.check(task.space.from_json(config)) is None
    rec = {"workload": task.workload.to_json(), "target": task.target.to_json(), "config": config,
           "latency_us": 10.0}
    with pytest.raises(FarmError, match=r"rewritten PrimFunc.*--format farm.*farm build"):
        write_metaschedule([rec], tmp_path / "msdb")
    assert not (tmp_path / "msdb").exists()


@pytest.mark.slow
def test_merge_keeps_the_fastest_per_workload_target_device(tuned: Path) -> None:
    doc = load(tuned)
    rec = doc["records"][0]
    slower = {**copy.deepcopy(rec), "latency_us": rec["latency_us"] * 2}
    faster = {**copy.deepcopy(rec), "latency_us": rec["latency_us"] / 2}
    other_device = {**copy.deepcopy(rec), "device": "another CPU", "latency_us": rec["latency_us"] * 5}
    merged = merge([doc, {"format": "farm.best/1", "records": [slower, other_device]},
                    {"format": "farm.best/1", "records": [faster]}])
    by_device = {r["device"]: r["latency_us"] for r in merged["records"]}
    assert by_device == {rec["device"]: faster["latency_us"], "another CPU": other_device["latency_us"]}
    task = Task(make_workload("matmul", PARAMS), parse_target("llvm"))
    assert best_config(task, merged) is not None


@pytest.mark.slow
def test_missing_workload_builds_with_the_default_config_and_a_warning(tuned: Path) -> None:
    with pytest.warns(UserWarning, match=r"matmul\(M=32"):
        lib = build("matmul", "llvm", best=tuned, params={"M": 32, "N": 32, "K": 32})
    assert lib is not None


def _tamper(rec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {"format": "farm.best/1", "records": [{**copy.deepcopy(rec), **changes}]}


@pytest.mark.slow
def test_bad_exports_are_refused(tuned: Path, tmp_path: Path) -> None:
    rec = load(tuned)["records"][0]
    bad_split = copy.deepcopy(rec["config"])
    bad_split["tile_i"] = [7, 7]  # 49 != 96: outside the template's space
    cases: list[tuple[Any, str]] = [
        ({"format": "farm.best/2", "records": []}, "newer than this farm"),
        ({"format": "autotvm", "records": []}, "unknown format"),
        ({"records": []}, "not a farm export"),
        ({"format": "farm.best/1", "records": {}}, "must be a list"),
        (_tamper(rec, config=bad_split), "not one of its values"),
        (_tamper(rec, config={**rec["config"], "evil": "__import__('os')"}), "unknown knobs"),
        (_tamper(rec, workload={"name": "conv3d", "params": {}}), "unknown workload"),
        (_tamper(rec, workload={"name": "matmul", "params": {"M": -1, "N": 2, "K": 2}}), "must be >= 1"),
        (_tamper(rec, template="cuda.tiled"), "cuda.tiled does not schedule"),
        (_tamper(rec, latency_us=-3.0), "positive"),
        (_tamper(rec, latency_us=True), "latency_us"),
        (_tamper(rec, template_version="0ld"), "--allow-stale"),
        ([1, 2], "not a farm export"),
    ]
    for doc, message in cases:
        with pytest.raises(FarmError, match=message):
            validate(doc)
    assert validate(_tamper(rec, template_version="0ld"), allow_stale=True)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(tuned.read_text()[:-40])
    with pytest.raises(FarmError, match="not valid JSON"):
        load(truncated)
    # Through the CLI: one line, exit 2, no library written.
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(_tamper(rec, config=bad_split)))
    for export in (truncated, tampered, tmp_path / "missing.json"):
        proc = farm("build", "matmul", *ARGS, "--best", str(export), "-o", str(tmp_path / "k.so"), cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "k.so").exists()


@pytest.mark.slow
def test_an_export_carries_the_template_version_it_was_tuned_with(tuned: Path, tmp_path: Path) -> None:
    """A job tuned with an older template exports that version, and applying it is refused."""
    import shutil
    import sqlite3

    from db.store import open_store
    from farm.export import export_job

    db = tmp_path / "farm.db"
    shutil.copy(tuned.parent / "farm.db", db)
    with sqlite3.connect(db) as connection:
        connection.execute("update tasks set template_version = '0ld'")
    (rec,) = export_job(open_store(f"sqlite:///{db}"), 1, tmp_path / "old.json")
    assert rec["template_version"] == "0ld"
    with pytest.raises(FarmError, match="--allow-stale"):
        build("matmul", "llvm", best=tmp_path / "old.json", params=PARAMS)
    assert build("matmul", "llvm", best=tmp_path / "old.json", params=PARAMS, allow_stale=True) is not None
