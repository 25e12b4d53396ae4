"""Whole models (issue 47) on llvm: import from PyTorch and ONNX, tasks with weights, one job whose
budget moves between the model's kernels, reuse of kernels tuned before, a compiled model checked
against its framework, and bad input refused in one line with nothing written."""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farm.core.allocation import FAILING_SLICES, GradientAllocation, TaskState, model_kernels, model_latency
from farm.core.errors import FarmError
from farm.core.targets import parse_target
from farm.core.task import BASELINE

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

LLVM = parse_target("llvm")
ROOT = Path(__file__).resolve().parent.parent

# A model file as a user writes one: `model` and `example_inputs`. Its two 3x3 convolutions of 8
# channels at 8x8 are the same kernel (weight 2); `width` changes the last layer only.
MODEL_PY = """
import torch

class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.body = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(torch.relu(self.stem(x)))
        return self.head(x.mean((2, 3)))

torch.manual_seed(0)
model = Net({width})
example_inputs = (torch.randn(1, 3, 8, 8),)
"""


def farm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def model_file(folder: Path, width: int = 10, name: str = "net.py") -> Path:
    path = folder / name
    path.write_text(MODEL_PY.format(width=width))
    return path


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("farm: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from farm.core.model import load_model

    return load_model(model_file(tmp_path_factory.mktemp("net")))


def test_a_model_imports_the_same_from_every_form(net: Any, tmp_path: Path) -> None:
    """A module with inputs, a saved torch.export program, a .py file and an ONNX export give the
    model's kernels with their weights (the two identical convolutions: one task, weight 2)."""
    import runpy

    from farm.core.model import load_model

    scope = runpy.run_path(str(model_file(tmp_path)))
    module, inputs = scope["model"], scope["example_inputs"]
    tasks = net.tasks(LLVM)
    weights = {t.name: t.weight for t in tasks}
    assert sorted(weights.values()) == [1, 1, 1, 2] and net.inputs[0].shape == (1, 3, 8, 8)
    assert weights[max(weights, key=weights.get)] == 2 and "conv2d" in max(weights, key=weights.get)

    program = torch.export.export(module.eval(), inputs)
    torch.export.save(program, tmp_path / "net.pt2")
    torch.onnx.export(module, inputs, tmp_path / "net.onnx", dynamo=False, input_names=["x"])
    for source in (module, tmp_path / "net.pt2"):
        loaded = load_model(source, inputs)
        assert loaded.hash == net.hash  # the same Relax program, weights included
    onnx_tasks = load_model(tmp_path / "net.onnx").tasks(LLVM)
    assert sorted(t.weight for t in onnx_tasks) == [1, 1, 1, 2]
    assert {t.workload.flops() for t in onnx_tasks} == {t.workload.flops() for t in tasks}


def test_batch_norm_folds_into_the_convolution_before_it() -> None:
    """For inference a batch norm's scale and shift fold into the convolution's weights and bias,
    so conv + batch norm + ReLU is one kernel (a conv with a bias and a ReLU), and the build computes
    what PyTorch does."""
    import warnings

    from farm.build_model import compile_model
    from farm.core.model import load_model

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                 torch.nn.ReLU()).eval()
    with torch.no_grad():  # statistics and an affine transform that are not the identity
        norm = module[1]
        for tensor, low, high in ((norm.running_mean, -0.5, 0.5), (norm.running_var, 0.5, 2.0),
                                  (norm.weight, 0.5, 2.0), (norm.bias, -1.0, 1.0)):
            tensor.uniform_(low, high)
    model = load_model(module, (torch.randn(1, 3, 8, 8),))
    (task,) = model.tasks(LLVM)
    assert task.name.startswith("fused_conv2d") and task.name.endswith("relu") and "divide" not in task.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned record: TVM's default schedule
        assert compile_model(model, target="llvm").check() < 1e-5


def test_a_half_precision_model_imports_and_builds_to_what_pytorch_computes() -> None:
    """TVM's frontend gives a convolution's and a linear layer's product in float32 and then adds a
    float16 bias, which does not import; the farm's import sums in float32, rounds to float16 and
    adds the bias there, as PyTorch does, keeps every activation in float16, and folds the batch norm
    into the convolution."""
    import warnings

    from farm.build_model import compile_model
    from farm.core.model import load_model

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                 torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).eval().half()
    model = load_model(module, (torch.randn(1, 3, 8, 8).half(),))
    assert [i.dtype for i in model.inputs] == ["float16"]
    assert str(model.mod["main"].ret_ty.fields[0].dtype) == "float16"
    names = [t.name for t in model.tasks(LLVM)]
    assert any(n.startswith("fused_conv2d") and "cast" in n for n in names), names
    # The batch norm is folded into the convolution before it, through the cast, as in float32.
    assert not any(op in n for n in names for op in ("subtract", "divide", "multiply")), names
    assert any(n.startswith("fused_matmul") and "cast" in n for n in names), names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned record: TVM's default schedule
        assert compile_model(model, target="llvm").check() < 2e-2


def test_model_job_weights_skips_and_fixed_budgets(net: Any) -> None:
    from farm.core.model import model_job

    request = model_job(net, "llvm", 40, skip=["mean*"], budgets={"fused_matmul*": 5})
    rows = request.task_rows()
    names = [r["workload"]["params"]["func"] for r in rows]
    assert not any(n.startswith("mean") for n in names) and len(rows) == 3
    assert {r["budget"] for r in rows if r["workload"]["params"]["func"].startswith("fused_matmul")} == {5}
    assert sum(r["budget"] for r in rows) == 5  # the rest is the allocation's to hand out
    assert sorted(r["weight"] for r in rows) == [1, 1, 2]
    assert request.spec()["allocation"] == "gradient" and request.spec()["model"]["hash"] == net.hash
    with pytest.raises(FarmError, match="matches no kernel"):
        model_job(net, "llvm", 40, skip=["softmax*"])
    with pytest.raises(FarmError, match="more than the job's"):
        model_job(net, "llvm", 40, budgets={"*": 30})


def test_gradient_allocation_warms_up_every_task_then_follows_the_steepest() -> None:
    """Each task gets a first slice (of the warm-up's size) in order; then the slice goes where
    weight x expected gain is largest; an exhausted space gives its unused trials back; the budget is
    never exceeded."""
    states = [TaskState(weight=1, flops=10**6, family="a"), TaskState(weight=4, flops=10**6, family="a"),
              TaskState(weight=1, flops=10**6, family="b")]
    plan = GradientAllocation(states, budget=100, slice_trials=10, warmup_trials=5)
    given, grants = [], []
    latencies = {0: 1e-3, 1: 1e-3, 2: 1e-6}
    while (step := plan.next()) is not None:
        index, n = step
        given.append(index)
        grants.append(n)
        exhausted = index == 2  # a tiny space: done after its first slice, with 3 trials
        trials = 3 if exhausted else states[index].trials + n
        plan.observe(index, trials, latencies[index], exhausted)
    assert given[:3] == [0, 1, 2] and grants[:3] == [5, 5, 5] and set(grants[3:-1]) == {10}
    later = given[3:]
    assert 2 not in later and later.count(1) > later.count(0)  # the heavier task of equal latency
    assert sum(s.trials for s in states) <= 100
    assert sum(s.trials for s in states) >= 100 - 10  # what is left is less than one slice


def test_a_task_whose_configs_all_fail_gets_two_slices_then_none() -> None:
    """A kernel none of whose configs runs correctly first draws slices (it must find one), but only
    FAILING_SLICES of them: the rest of the budget goes to the kernels that run."""
    states = [TaskState(weight=1, flops=10**6, family="a"), TaskState(weight=1, flops=10**6, family="b")]
    plan = GradientAllocation(states, budget=100, slice_trials=10)
    while (step := plan.next()) is not None:
        index, n = step
        plan.observe(index, states[index].trials + n, 1e-3 if index == 0 else None, False)
    assert states[1].trials == FAILING_SLICES * 10 and states[0].trials == 100 - states[1].trials


def test_slices_asked_for_while_others_are_out_are_not_handed_out_twice() -> None:
    """The scheduler asks for the next slice before the last one's outcome is known: a task with a
    slice out gets no other, and the trials out count against the budget until their outcome comes."""
    states = [TaskState(weight=1, flops=10**6, family="a") for _ in range(3)]
    plan = GradientAllocation(states, budget=25, slice_trials=10)
    assert plan.next() == (0, 10) and plan.next() == (1, 10) and plan.next() == (2, 5)
    assert plan.next() is None  # the budget is all out
    plan.observe(1, 4, 1e-3, exhausted=True)  # a small space: 6 of its trials come back
    assert plan.next() is None  # tasks 0 and 2 have slices out, task 1 is spent
    plan.observe(0, 10, 1e-3, exhausted=False)
    assert plan.next() == (0, 6)


def test_model_latency_sums_weighted_kernels_fastest_template() -> None:
    tasks = [{"workload_key": "k1", "workload": {"name": "tir", "params": {"func": "conv"}}, "weight": 2,
              "best_latency": 3e-6, "trials": 10},
             {"workload_key": "k1", "workload": {"name": "tir", "params": {"func": "conv"}}, "weight": 2,
              "best_latency": 2e-6, "trials": 5},
             {"workload_key": "k2", "workload": {"name": "tir", "params": {"func": "mean"}}, "weight": 1,
              "best_latency": 1e-6, "trials": 4, "reused": True}]
    kernels = model_kernels(tasks)
    assert [(k.name, k.weight, k.best, k.trials) for k in kernels] == [("conv", 2, 2e-6, 15), ("mean", 1, 1e-6, 4)]
    assert model_latency(kernels) == pytest.approx(5e-6) and kernels[1].reused
    assert model_latency(model_kernels([{**tasks[0], "best_latency": None}])) is None


def test_tune_a_model_build_it_and_reuse_its_kernels(tmp_path: Path) -> None:
    """`farm tune-model` on 2 llvm workers spends exactly its budget over the model's kernels;
    `farm build-model` compiles it with every kernel from tuning, checked against PyTorch eager, into a
    library TVM's runtime runs. A second model sharing all but its last layer spends its budget on
    that layer alone (the shared kernels' records are reused); so does the first model's ONNX export,
    built from the database and checked against onnxruntime. The first model again tunes nothing;
    --retune tunes every kernel again."""
    import tvm
    from tvm import relax

    db = f"sqlite:///{tmp_path / 'farm.db'}"
    first = model_file(tmp_path, 10, "first.py")
    proc = farm("tune-model", str(first), "--trials", "24", "--workers", "2", "--batch-size", "2", "--db", db,
                "--export", "best.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "estimated model latency" in proc.stdout
    with sqlite3.connect(tmp_path / "farm.db") as con:
        per_task = con.execute("SELECT tasks.id, tasks.budget, count(trials.id), count(DISTINCT config_index) "
                               "FROM tasks LEFT JOIN trials ON trials.task_id = tasks.id GROUP BY tasks.id").fetchall()
    assert sum(n for _, _, n, _ in per_task) == 24  # the job's budget, exactly
    assert all(n == distinct == budget and n > 0 for _, budget, n, distinct in per_task)  # each kernel tuned
    with sqlite3.connect(tmp_path / "farm.db") as con:  # each kernel's baseline, TVM's own schedule, measured
        baselines = con.execute("SELECT count(*) FROM trials WHERE origin = 'baseline' GROUP BY task_id").fetchall()
    assert baselines == [(1,)] * len(per_task)
    assert _overlapping_slices(tmp_path / "farm.db", 1)  # the next slice builds while the last one measures
    proc = farm("status", "1", "--db", db, cwd=tmp_path)
    assert proc.returncode == 0 and "estimated model latency (Σ calls x best): " in proc.stdout, proc.stderr
    assert "- (a kernel has no" not in proc.stdout
    proc = farm("report", "1", "--db", db, "-o", "curve.png", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "curve.png").stat().st_size > 0, proc.stderr

    proc = farm("build-model", str(first), "--target", "llvm", "--best", "best.json", "-o", "first.so",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "4 of 4 kernels from tuning" in proc.stdout and "outputs match PyTorch eager" in proc.stdout
    kept = sum(r["config"] == BASELINE for r in json.loads((tmp_path / "best.json").read_text())["records"])
    assert (f"({kept} of them TVM's default schedule" in proc.stdout) == (kept > 0), proc.stdout
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "first.so")), tvm.cpu())
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 8, 8)).astype("float32")
    import runpy

    module = runpy.run_path(str(first))["model"].eval()
    expected = module(torch.from_numpy(x)).detach().numpy()
    got = vm["main"](tvm.runtime.tensor(x))
    got = got[0] if not isinstance(got, tvm.runtime.Tensor) else got
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)

    second = model_file(tmp_path, 12, "second.py")
    proc = farm("tune-model", str(second), "--trials", "8", "--workers", "1", "--batch-size", "2", "--db", db,
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = _job(tmp_path, 2)
    reused = [t for t in job if t["origin"] == "reused"]
    tuned = [t for t in job if t["origin"] != "reused"]
    assert len(reused) == 3 and all(t["trials"] == 1 for t in reused)  # the shared kernels: not tuned again
    assert [t["trials"] for t in tuned] == [8] and tuned[0]["func"].startswith("fused_matmul")
    assert proc.stdout.count("reused") == 3
    # The first model again: every kernel has a record, so none is tuned (no first trial is needed
    # to learn which device the job measures on: the workers say).
    proc = farm("tune-model", str(first), "--trials", "8", "--workers", "1", "--db", db, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    again = _job(tmp_path, 3)
    assert len(again) == 4 and all(t["origin"] == "reused" and t["trials"] == 1 for t in again), again

    # The ONNX path: the same network exported to ONNX shares its convolutions and reduction with the
    # PyTorch import (its Gemm is another kernel): those are reused, the Gemm tuned, and the build
    # takes every kernel from the database, checked against onnxruntime.
    torch.onnx.export(module, (torch.from_numpy(x),), tmp_path / "first.onnx", dynamo=False, input_names=["x"])
    proc = farm("tune-model", "first.onnx", "--trials", "4", "--workers", "2", "--batch-size", "2", "--db", db,
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [t["origin"] == "reused" for t in _job(tmp_path, 4)].count(True) == 3
    proc = farm("build-model", "first.onnx", "--target", "llvm", "--db", db, "-o", "first-onnx.so", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "4 of 4 kernels from tuning" in proc.stdout and "outputs match onnxruntime" in proc.stdout

    proc = farm("tune-model", str(second), "--trials", "4", "--workers", "2", "--batch-size", "2", "--db", db,
                "--retune", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not any(t["origin"] == "reused" for t in _job(tmp_path, 5))
    assert sum(t["trials"] for t in _job(tmp_path, 5)) == 4


# A depthwise convolution (two outputs per channel) + batch norm + ReLU, a grouped convolution, max and
# average pooling and an attention's batch matmul of two heads: the operators the hand templates take
# inside fused kernels besides a convolution and a matmul (farm.core.fused).
OPERATORS_PY = """
import torch

class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(3, 6, 3, padding=1, groups=3, bias=False)
        self.bn = torch.nn.BatchNorm2d(6)
        self.group = torch.nn.Conv2d(6, 8, 3, padding=1, groups=2)
        self.pool, self.avg = torch.nn.MaxPool2d(3, 2, 1), torch.nn.AvgPool2d(2, 2)
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avg(self.pool(torch.relu(self.group(torch.relu(self.bn(self.dw(x)))))))
        t = x.flatten(2).transpose(1, 2)
        q = self.q(t).reshape(1, 4, 2, 4).transpose(1, 2)
        k = self.k(t).reshape(1, 4, 2, 4).transpose(1, 2)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)

torch.manual_seed(0)
model = Net().eval()
example_inputs = (torch.randn(1, 3, 8, 8),)
"""


def test_depthwise_grouped_pooling_and_attention_kernels_tune_on_the_hand_templates_and_build(
        tmp_path: Path) -> None:
    """Each of those kernels is tuned with the hand template of its operator (llvm.tiled), and
    `farm build-model` applies every record (their traces through MetaSchedule's database) into a
    model whose outputs match PyTorch eager."""
    (tmp_path / "ops.py").write_text(OPERATORS_PY)
    proc = farm("tune-model", "ops.py", "--trials", "24", "--batch-size", "2", "--export", "best.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with sqlite3.connect(tmp_path / "farm.db") as con:
        templates = dict(con.execute("SELECT json_extract(workload, '$.params.func'), template FROM tasks").fetchall())
    hand = {name: template for name, template in templates.items()
            if any(op in name for op in ("conv2d", "pool2d", "matmul"))}
    assert len(hand) == 6 and set(hand.values()) == {"llvm.tiled"}, templates  # dw, group, 2 pools, 2 matmuls
    proc = farm("build-model", "ops.py", "--target", "llvm", "--best", "best.json", "-o", "ops.so", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(templates)} of {len(templates)} kernels from tuning" in proc.stdout
    assert "outputs match PyTorch eager" in proc.stdout


def _overlapping_slices(db: Path, job_id: int) -> int:
    """How many of the job's tasks had a candidate built before the task tuned before it had its last
    candidate measured (scheduler.tuner._allocate overlaps slices), from the trials' timelines."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT trials.task_id, trials.timeline FROM trials JOIN tasks ON tasks.id = trials.task_id "
                           "WHERE tasks.job_id = ?", (job_id,)).fetchall()
    first_build: dict[int, float] = {}
    last_measured: dict[int, float] = {}
    for task, timeline in rows:
        times = json.loads(timeline)
        first_build[task] = min(first_build.get(task, math.inf), times["build"][0])
        last_measured[task] = max(last_measured.get(task, 0.0), times["measure"][1])
    order = sorted(first_build, key=first_build.__getitem__)
    return sum(first_build[b] < last_measured[a] for a, b in itertools.pairwise(order))


def _job(folder: Path, job_id: int) -> list[dict[str, Any]]:
    """Each task of a job: its kernel's name, trial count, and the origin of its first trial."""
    with sqlite3.connect(folder / "farm.db") as con:
        rows = con.execute("SELECT tasks.workload, count(trials.id), min(trials.origin) FROM tasks "
                           "JOIN trials ON trials.task_id = tasks.id WHERE tasks.job_id = ? GROUP BY tasks.id",
                           (job_id,)).fetchall()
    return [{"func": json.loads(w)["params"]["func"], "trials": n, "origin": o} for w, n, o in rows]


BAD_MODELS = {
    # an operator TVM's PyTorch frontend does not have: named in the error
    "unsupported.py": ("import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                       "        return torch.special.bessel_j0(x)\nmodel = M()\nexample_inputs = (torch.randn(4),)\n",
                       "bessel_j0"),
    "wrong_inputs.py": ("import torch\nmodel = torch.nn.Linear(8, 4)\nexample_inputs = (torch.randn(2, 5),)\n",
                        "does not run on example inputs of shape 2x5"),
    "no_model.py": ("import torch\nexample_inputs = (torch.randn(2, 5),)\n", "must define `model`"),
    "corrupt.onnx": ("this is not a protobuf", "is not an ONNX model"),
    "corrupt.pt2": ("not a zip", "is not a saved torch.export program"),
    "model.txt": ("", "a model file ends in"),
}


@pytest.mark.parametrize("name", sorted(BAD_MODELS))
def test_bad_models_are_one_line_and_write_nothing(tmp_path: Path, name: str) -> None:
    text, message = BAD_MODELS[name]
    (tmp_path / name).write_text(text)
    proc = farm("tune-model", name, "--trials", "8", "--db", f"sqlite:///{tmp_path / 'farm.db'}", cwd=tmp_path)
    assert message in one_error_line(proc)
    assert not (tmp_path / "farm.db").exists()


def test_dynamic_shapes_a_missing_file_and_an_export_without_the_model(net: Any, tmp_path: Path) -> None:
    from farm.core.model import load_model

    dim = torch.export.Dim("batch")
    program = torch.export.export(torch.nn.Linear(8, 4), (torch.randn(2, 8),), dynamic_shapes=({0: dim},))
    with pytest.raises(FarmError, match="dynamic shape"):
        load_model(program)
    proc = farm("tune-model", "missing.onnx", "--trials", "8", cwd=tmp_path)
    assert "does not exist" in one_error_line(proc)
    # An export of another kernel: nothing of this model in it, nothing written.
    (tmp_path / "other.json").write_text(json.dumps({"format": "farm.best/1", "records": []}))
    model_file(tmp_path)
    proc = farm("build-model", "net.py", "--target", "llvm", "--best", "other.json", "-o", "net.so", cwd=tmp_path)
    assert "holds no record of any kernel" in one_error_line(proc)
    assert not (tmp_path / "net.so").exists()
