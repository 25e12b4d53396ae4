"""The `farm` command as a user runs it: workloads, bad input, and a real tuning job."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from farm.core.host import visible_gpus
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload


def farm(*args: str, cwd: Path | None = None, timeout: float = 600,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m farm ARGS`, with `env` added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_workloads_lists_everything_with_space_sizes() -> None:
    proc = farm("workloads", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {w["name"] for w in doc["workloads"]} == {
        "conv2d_nchw", "depthwise_conv2d_nchw", "pool2d", "group_conv2d_nchw", "matmul", "batch_matmul"}
    presets = {p["name"]: p for p in doc["presets"]}
    # The AutoTVM tutorial's 10,454,400 configs, times split-K's 7 slice counts and 2 ways to fetch tiles.
    assert presets["resnet-last-conv"]["spaces"]["cuda"]["space_size"] == 10_454_400 * 7 * 2
    for p in presets.values():
        assert p["spaces"]["llvm"]["space_size"] > 0 and p["spaces"]["cuda"]["space_size"] > 0
    human = farm("workloads")
    assert human.returncode == 0 and "resnet-last-conv" in human.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["tune", "conv3d"], "unknown workload"),
    (["tune", "matmul", "M=abc", "N=4", "K=4"], "must be an integer"),
    (["tune", "matmul", "M=0", "N=4", "K=4"], "must be >= 1"),
    (["tune", "matmul", "M4"], "key=value"),
    (["tune", "conv2d_nchw", "N=1", "CI=3", "H=4", "W=4", "CO=8", "KH=9", "KW=3"], "larger than the padded"),
    (["tune", "group_conv2d_nchw", "N=1", "CI=6", "H=8", "W=8", "CO=8", "KH=3", "KW=3", "groups=4"],
     "not divisible by groups"),
    (["tune", "resnet-last-conv", "--target", "rocm"], "unknown target"),
    (["tune", "resnet-last-conv", "--target", "{bad json"], "target is not valid JSON"),
    (["tune", "resnet-last-conv", "--target", '{"kind": "cuda", "arch": "volta"}'], "not one the farm compiles for"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--export", "no/such/dir/best.json"], "does not exist"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--search", "annealing"], "unknown search"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--search", "xgb:screen=-1"], "screen must lie in [1, 1024]"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--trials", "0"], "trials"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--target", '{"kind": "llvm", "no-such-attr": 1}'], "not one TVM knows"),
    (["tune", "matmul", "M=4", "N=4", "K=4", "--target", '{"kind": "llvm", "mattr": "+avx2"}'], "a list of strings"),
    (["status", "1"], "no database at"),
    (["status", "1", "--watch"], "no database at"),
    (["top", "--once"], "no database at"),
    (["jobs"], "no database at"),
    (["trials", "1", "--csv"], "no database at"),
    (["predict", "matmul", "M=4", "N=4", "K=4"], "no database at"),
    (["report", "1", "-o", "curve.png"], "no database at"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, args: list[str], message: str) -> None:
    proc = farm(*args, "--db", f"sqlite:///{tmp_path}/farm.db", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no database, no export, nothing


def test_unreachable_database_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = farm("tune", "matmul", "M=4", "N=4", "K=4", "--db", "postgresql://postgres@127.0.0.1:1/farm", cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "127.0.0.1:1" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_cuda_without_gpu_says_what_to_do(tmp_path: Path) -> None:
    proc = farm("tune", "resnet-last-conv", "--target", "cuda", "--db", f"sqlite:///{tmp_path}/f.db", cwd=tmp_path)
    if proc.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert proc.returncode == 2 and "--target llvm" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_tune_end_to_end_on_llvm(tmp_path: Path) -> None:
    """A real job: local tracker and RPC server, SQLite, progress, export. With the GPUs hidden
    as users hide them (CUDA_VISIBLE_DEVICES empty), which Ray refused for the logical GPUs that
    place the llvm workers until the farm started it without that variable."""
    export = tmp_path / "best.json"
    proc = farm("tune", "conv2d_nchw", "N=1", "CI=16", "H=14", "W=14", "CO=32", "KH=3", "KW=3", "pad=1",
                "--target", "llvm", "--trials", "20", "--db", f"sqlite:///{tmp_path}/farm.db",
                "--export", str(export), cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "best for conv2d_nchw" in proc.stdout and "µs" in proc.stdout
    # Before the first trial it says what it is starting: the scheduler's start-up steps, one a line.
    steps = [line for line in proc.stderr.splitlines() if line.startswith("job 1: starting, ")]
    assert any("Ray ready in" in line for line in steps), proc.stderr
    assert any("llvm worker actor(s) up in" in line for line in steps), proc.stderr
    assert any("shard searches" in line for line in steps), proc.stderr
    doc = json.loads(export.read_text())
    assert doc["format"] == "farm.best/1" and len(doc["records"]) == 1
    rec = doc["records"][0]
    wl = make_workload("conv2d_nchw", dict(N=1, CI=16, H=14, W=14, CO=32, KH=3, KW=3, pad=1))
    assert rec["workload"] == wl.to_json()
    task = Task(wl, parse_target(rec["target"]))
    task.config_from_json(rec["config"])  # the exported config: a point of the space, or the baseline
    assert rec["template"] == task.template.name and rec["template_version"] == task.template.version
    assert rec["latency_us"] > 0 and rec["gflops"] > 0 and rec["device"].startswith("CPU")
    assert rec["tvm_version"].startswith("0.27") and rec["measured_at"]
    with sqlite3.connect(tmp_path / "farm.db") as db:
        rows = db.execute("select config_index, status, latency from trials").fetchall()
        status = db.execute("select status from jobs").fetchone()[0]
    assert len(rows) == 20 and len({r[0] for r in rows}) == 20  # budget met, no config twice
    assert status == "done"
    best = min(r[2] for r in rows if r[1] == "ok")
    assert rec["latency_us"] == pytest.approx(best * 1e6)


def test_a_refreshed_model_guides_between_rounds_and_is_not_saved(tmp_path: Path) -> None:
    """`--search xgb:refresh=4`: besides each round's retraining, the model is retrained whenever 4
    results have come in and the training thread is idle, in memory only. The job says how often;
    its rounds are a job's without refreshes (one per 16 results, the default batch), and the store
    holds one model per round's retraining, none per refresh."""
    db = f"sqlite:///{tmp_path}/farm.db"
    proc = farm("tune", "matmul", "M=64", "N=64", "K=64", "--trials", "48", "--search", "xgb:refresh=4",
                "--db", db, "-v", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"cost model refreshed (\d+) times between rounds", proc.stderr)
    assert found and int(found.group(1)) >= 1, proc.stderr[-3000:]
    task = json.loads(farm("status", "1", "--json", "--db", db, cwd=tmp_path).stdout)["tasks"][0]
    trials = [r["trials"] for r in task["rounds"]]
    assert trials[0] >= 16 and trials[-1] == 48 and trials == sorted(set(trials)) and len(trials) <= 3
    with sqlite3.connect(tmp_path / "farm.db") as con:
        (models,) = con.execute("SELECT count(*) FROM cost_models").fetchone()
    assert models == len(trials)


def test_visible_gpus_are_those_cuda_visible_devices_names() -> None:
    """nvidia-smi lists every GPU; CUDA shows a process those its CUDA_VISIBLE_DEVICES names, up
    to the first entry that names none."""
    assert visible_gpus(2, None) == 2 and visible_gpus(0, None) == 0
    assert visible_gpus(2, "1") == 1 and visible_gpus(2, "1,0") == 2 and visible_gpus(2, " 0 , 1 ") == 2
    assert visible_gpus(2, "") == 0 and visible_gpus(2, "-1") == 0 and visible_gpus(2, "-1,0") == 0
    assert visible_gpus(2, "1,7,0") == 1  # index 7 names no GPU of 2: CUDA stops there
    assert visible_gpus(2, "GPU-ec2c0d28-01ad,GPU-9657ca0a-29c2") == 2
    assert visible_gpus(1, "0,GPU-ec2c0d28-01ad") == 1  # never more than the machine has
    assert visible_gpus(0, "0") == 0


@pytest.mark.slow
def test_model_guided_tuning_learns_visibly_and_predicts_new_shapes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/farm.db"
    proc = farm("tune", "matmul", "M=64", "N=48", "K=64", "--trials", "24", "--batch-size", "6", "--search", "xgb",
                "--db", db, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(farm("status", "1", "--json", "--db", db, cwd=tmp_path).stdout)
    rounds = status["tasks"][0]["rounds"]
    # A round closes once 6 results (the batch size) have come in since the last, or later while
    # the last round's model still trains; the last round closes at the budget.
    trials = [r["trials"] for r in rounds]
    assert len(rounds) >= 3 and trials[0] >= 6 and trials[-1] == 24 and trials == sorted(set(trials))
    # The model needs 8 trials: every round after the first model was trained is model-guided,
    # and the model is scored (rank correlation) on the round it guided.
    guided = [i for i, r in enumerate(rounds) if r["model_id"]]
    assert rounds[0]["model_id"] is None and guided and guided == list(range(guided[0], len(rounds)))
    assert guided[0] <= 2 and all(rounds[i]["rank_corr"] is not None for i in guided)
    best = [r["best_latency"] for r in rounds]
    assert best == sorted(best, reverse=True)  # best-so-far never gets worse
    # Zero-shot: a shape never tuned, from the family's model, in well under a second of model time.
    pred = farm("predict", "matmul", "M=96", "N=32", "K=64", "--top", "3", "--json", "--db", db, cwd=tmp_path)
    assert pred.returncode == 0, pred.stderr
    configs = [p["config"] for p in json.loads(pred.stdout)]
    task = Task(make_workload("matmul", {"M": 96, "N": 32, "K": 64}), parse_target("llvm"))
    assert len(configs) == 3 and all(task.check(task.space.from_json(c)) is None for c in configs)
    curve = farm("report", "1", "-o", str(tmp_path / "curve.png"), "--db", db, cwd=tmp_path)
    assert curve.returncode == 0 and (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    # What proposed the trials: the baseline and the first round's random draws, then the model's plan and
    # exploration.
    origins = next(line for line in curve.stdout.splitlines() if "trials by origin:" in line)
    assert "baseline 1 (best " in origins and "random " in origins
    assert "plan " in origins and "the best by " in origins
