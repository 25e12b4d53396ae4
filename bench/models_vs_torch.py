"""Whole models (issue 47): ResNet-50 and BERT-base tuned by `farm tune-model`, against PyTorch eager,
`torch.compile`, TVM's untuned build and, optionally, stock MetaSchedule's `tune_relax`.

    python bench/models_vs_torch.py [--case resnet50 --case bert] [--batch 1 16] [--trials 2000]
                                    [--seeds 0 1 2] [--gpus 1] [--target cuda] [--dtype float32]
                                    [--max-autotune [--compile-limit 600]] [--ms-tune-relax] [--profile]
                                    [--tune-limit SECONDS] [--reuse-from CASE]
                                    [--out DIR] [--json FILE] [--retime]
    python bench/models_vs_torch.py --case tiny --target llvm --trials 16 --seeds 0   # the script, on a CPU

Cases: `resnet50` and `resnet101` (torchvision's, random weights), `bert` (transformers' BertModel with BertConfig()'s
defaults, BERT-base, on input_ids of sequence 128; where transformers is missing, a
torch.nn.TransformerEncoder of BERT-base's size with word and position embeddings, and the JSON says
which), `tiny` (a small conv net, for checking this script anywhere). Each case and batch is written
as a model file OUT/CASE-bBATCH.py defining `model` and `example_inputs`, as `farm tune-model` takes
it, the weights drawn after torch.manual_seed(0): every process that runs the file builds the same
model, cast to --dtype (float32, or float16: its weights and inputs in half precision, against PyTorch's
own float16 model).

Per case, batch and seed, `python -m farm tune-model OUT/CASE-bB.py --target T --trials N --workers W
--seed S --db sqlite:///OUT/CASE-bB-sS.db --export OUT/CASE-bB-sS.json --verbose` runs as a user runs it (its
log says where each task's slices spent their time), a
process of its own timed whole (W = --gpus: the farm measures on one GPU per worker; a fresh
database each time, so that no kernel is reused from an earlier job, unless --reuse-from CASE says to
start from the database of CASE's job of the same batch and seed, e.g. ResNet-101 after ResNet-50:
the JSON then counts the kernels reused and the trials spent on the others). With --ms-tune-relax, stock
MetaSchedule tunes the same model with the same total trials on one GPU, also a process of its own
timed whole: `ms.relax_integration.tune_relax` (max_trials_global = N, its defaults otherwise, its
LocalBuilder sized and timed out as bench/vs_metaschedule.py does) on the model legalized and fused as
`compile_relax` fuses it (tune_relax extracts the module's PrimFuncs as it is given; it fuses
nothing), then built by `ms.relax_integration.compile_relax(database, mod, target, params=None)`.
tune_relax hands trials out 64 at a time (num_trials_per_iter), each kernel first once: below 64 x
kernels trials it leaves kernels untuned (DLight's), so the JSON counts the kernels it tuned.

Then, in this process, on the same inputs, checked against PyTorch eager (relative L2 error of each
output, `correct` when the largest is within TOLERANCE) and timed side by side by one method:
- eager: the module in PyTorch, TF32 off (torch_baseline.vendor_precision; cuDNN's autotuner on);
- torch.compile: `torch.compile(module)`, default mode (its compile seconds: the first call); with
  --max-autotune also mode="max-autotune-no-cudagraphs", first compiled in a child process given
  --compile-limit seconds (not finished: recorded so, and not timed), then here again from the
  child's caches (Inductor's and Triton's caches are folders of OUT, fresh for each run);
- tvm untuned: `farm.torch.compile(module, inputs, target=T)` with no records: TVM's default
  schedules (DLight on GPUs), CUDA graphs on; its build seconds;
- farm: `farm.torch.compile(module, inputs, target=T, best=EXPORT)`, CUDA graphs on; its build
  seconds, how many kernels came from tuning (CompiledModel.tuned / untuned) and how many of those
  keep TVM's default schedule, no config having beaten it (`defaults`);
- metaschedule: compile_relax's executable, run by the same torch-tensor wrapper (farm.torch's
  FarmModule over DLPack, on PyTorch's stream; compile_relax builds without CUDA graphs).
The farm's builds import the module from its CPU copy (as `farm tune-model` does) and run on the
target's device. Eager, torch.compile and the untuned build are made once per case and batch and
timed again beside each seed's tuned models. --retime tunes nothing: it builds and times the exports
and MetaSchedule databases an earlier run left in OUT. Timing: every contender warmed up, then
ROUNDS rounds that alternate between the contenders, each round SAMPLES samples of CALLS
back-to-back calls per contender (fewer calls where one call takes more than MAX_SAMPLE_S / CALLS),
timed with CUDA events around the calls (on the CPU with time.perf_counter); a sample's figure is
its time / calls; per contender the median and the 10th/90th percentiles of its samples. Prints a
line per seed and one per case and batch with the medians over seeds (min, max): farm tune wall
seconds, each contender's latency, eager/farm and compile/farm, MetaSchedule's wall seconds and
latency; --json writes every figure after every seed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from costmodel_common import machine
from torch_baseline import vendor_precision

from farm.core.errors import one_line
from farm.core.targets import TargetSpec, parse_target

# A contender's outputs against eager PyTorch's: the largest relative L2 error of an output, per dtype
# (float16: the farm's own check of a half-precision kernel, farm.core.tir).
TOLERANCE = {"float32": 1e-3, "float16": 2e-2}
ROUNDS, SAMPLES, CALLS, WARMUP = 5, 4, 50, 10
# Model calls profiled per contender (--profile).
PROFILE_CALLS = 20
MAX_SAMPLE_S = 2.0  # a sample of a slow contender (an untuned build) takes fewer calls than CALLS
DUMP_SECONDS = 3.0  # between SIGUSR1 to a process that outlasted its limit and its kill (timed_process)
CONTENDERS = ("eager", "torch.compile", "torch.compile max-autotune", "tvm untuned", "farm", "metaschedule")

MODEL_FILES = {
    "tiny": '''"""A small conv net, batch {batch}: two conv-BN-ReLU stages, average pool, linear."""
import torch

torch.manual_seed(0)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1))
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


IMPLEMENTATION = "tiny conv net"
model = Tiny().eval().to(torch.{dtype})
example_inputs = (torch.randn({batch}, 3, 32, 32).to(torch.{dtype}),)
''',
    **{f"resnet{depth}": '''"""torchvision's ResNet-DEPTH, random weights, batch {batch}."""
import torch
import torchvision

torch.manual_seed(0)
IMPLEMENTATION = f"torchvision {{torchvision.__version__}} resnetDEPTH(weights=None)"
model = torchvision.models.resnetDEPTH(weights=None).eval().to(torch.{dtype})
example_inputs = (torch.randn({batch}, 3, 224, 224).to(torch.{dtype}),)
'''.replace("DEPTH", str(depth)) for depth in (50, 101)},
    "bert": '''"""BERT-base, random weights, batch {batch}, sequence 128: transformers' BertModel with BertConfig()'s
defaults, or where transformers is missing a torch.nn.TransformerEncoder of its size."""
import torch

torch.manual_seed(0)
try:
    import transformers
except ImportError:
    transformers = None

if transformers is not None:
    IMPLEMENTATION = f"transformers {{transformers.__version__}} BertModel(BertConfig())"
    model = transformers.BertModel(transformers.BertConfig())
    vocab = model.config.vocab_size
else:
    IMPLEMENTATION = "torch.nn.TransformerEncoder (12 layers, d_model 768, 12 heads, ff 3072, GELU) with embeddings"

    class Bert(torch.nn.Module):
        """BERT-base's shape: word and position embeddings, layer norm, 12 post-norm encoder layers."""

        def __init__(self) -> None:
            super().__init__()
            self.word = torch.nn.Embedding(30522, 768)
            self.position = torch.nn.Embedding(512, 768)
            self.norm = torch.nn.LayerNorm(768, eps=1e-12)
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu", batch_first=True,
                                                     layer_norm_eps=1e-12)
            self.encoder = torch.nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)

        def forward(self, input_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            return self.encoder(self.norm(self.word(input_ids) + self.position(positions)))

    model = Bert()
    vocab = 30522
model = model.eval().to(torch.{dtype})
example_inputs = (torch.randint(0, vocab, ({batch}, 128)),)
''',
}


def write_model_file(case: str, batch: int, dtype: str, out: Path) -> Path:
    """OUT/CASE-bBATCH.py: the model file `farm tune-model` takes (`model`, `example_inputs`)."""
    path = out / f"{case}-b{batch}.py"
    path.write_text(MODEL_FILES[case].format(batch=batch, dtype=dtype))
    return path


def load_module(path: Path) -> tuple[Any, tuple[Any, ...], str]:
    """The model file run as `farm tune-model` runs it: (module, example inputs, which implementation)."""
    scope = runpy.run_path(str(path))
    inputs = scope["example_inputs"]
    return scope["model"], tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,), scope["IMPLEMENTATION"]


def tensors(value: Any) -> list[Any]:
    """The tensors of a model's outputs, in order (a tensor, tuples, dicts and ModelOutputs of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors(item)]
    return []


def rel_l2_error(outputs: Any, expected: Any) -> float:
    """The largest relative L2 error of an output against eager's; inf where they do not match in
    number or shape."""
    ours, theirs = tensors(outputs), tensors(expected)
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
        return float("inf")
    return max(float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))
               for a, b in zip(ours, theirs, strict=True))


def per_call_s(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    """Seconds per call of `calls` back-to-back calls of `fn` (CUDA events on a GPU)."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def time_side_by_side(fns: dict[str, Callable[[], Any]], cuda: bool) -> dict[str, dict[str, Any]]:
    """Each contender warmed up, then timed in rounds that alternate between them (module docstring);
    ms figures per contender."""
    import torch

    calls = {}
    for name, fn in fns.items():
        estimate = per_call_s(fn, 2, cuda)
        calls[name] = max(1, min(CALLS, int(MAX_SAMPLE_S / max(estimate, 1e-9))))
        per_call_s(fn, min(WARMUP, calls[name]), cuda)
    if cuda:
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):  # alternate, so drifting clocks or a busy neighbour hit all alike
        for name, fn in fns.items():
            samples[name] += [per_call_s(fn, calls[name], cuda) * 1e3 for _ in range(SAMPLES)]
    return {name: {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
                   "p90_ms": float(np.percentile(ms, 90)), "calls_per_sample": calls[name], "samples_ms": ms}
            for name, ms in samples.items()}


@contextlib.contextmanager
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    """Warnings kept (farm's 'kernels have no tuned record', torch.export's deprecations), not printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def torch_compiled(model: Any, inputs: tuple[Any, ...], mode: str | None, cuda: bool) -> tuple[Any, dict[str, Any]]:
    """`torch.compile(model, mode=mode)` compiled by its first call: (the compiled module or None, figures)."""
    import torch

    begin = time.perf_counter()
    try:
        compiled = torch.compile(model, mode=mode)
        compiled(*inputs)
        sync(cuda)
    except Exception as e:  # no C++ compiler on a CPU host, an operator Inductor cannot lower
        return None, {"error": one_line(e)}
    return compiled, {"compile_s": time.perf_counter() - begin, "mode": mode or "default"}


def farm_build(model: Any, inputs: tuple[Any, ...], target: str, best: Path | None) -> tuple[Any, dict[str, Any]]:
    """`farm.torch.compile` of the CPU module for `target`, with the export `best` or no records."""
    import farm.torch

    begin = time.perf_counter()
    try:
        with quiet() as caught:
            module = farm.torch.compile(model, inputs, target=target, best=str(best) if best else None)
    except Exception as e:  # a FarmError: the model does not import or build
        return None, {"error": one_line(e)}
    compiled = module.compiled
    return module, {"build_s": time.perf_counter() - begin, "tuned": len(compiled.tuned),
                    "untuned": len(compiled.untuned), "kernels": len(compiled.tuned) + len(compiled.untuned),
                    "tvm_default": len(compiled.defaults), "warnings": len(caught)}


def timed_process(command: list[str], log: Path, limit: float | None = None) -> tuple[float, int | None]:
    """Run `command` (output to `log`): (wall seconds, exit status, or None when it outlasted `limit`).
    With a limit it runs in a process group of its own, killed whole at the limit (Inductor's compile
    workers too), after SIGUSR1 and DUMP_SECONDS (a `farm` process prints its threads' stacks into
    the log: what it was waiting for); without one it stays in ours, so that a `timeout` around this
    script ends it too."""
    begin = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=limit is not None)
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(DUMP_SECONDS)
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the compile workers it started
            proc.wait()
            code = None
    return time.perf_counter() - begin, code


def log_tail(log: Path, chars: int = 2000) -> str:
    return log.read_text(errors="replace")[-chars:]


def farm_tune_model(path: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """`python -m farm tune-model` on the model file into a fresh OUT/NAME-sS.db, exported to
    OUT/NAME-sS.json; timed whole."""
    stem = f"{path.stem}-s{seed}"
    db, export = args.out / f"{stem}.db", args.out / f"{stem}.json"
    figures: dict[str, Any] = {"db": str(db), "export": str(export)}
    if args.retime:
        return figures if export.exists() else {**figures, "error": f"--retime: no export {export}"}
    db.unlink(missing_ok=True)
    export.unlink(missing_ok=True)
    if args.reuse_from:
        # CASE-bBATCH-sSEED: the same batch and seed of the case whose records are reused.
        earlier = args.out / f"{args.reuse_from}-{path.stem.split('-', 1)[1]}-s{seed}.db"
        if not earlier.exists():
            return {**figures, "error": f"--reuse-from: no database {earlier} (run --case {args.reuse_from} first)"}
        shutil.copy(earlier, db)
        figures["reused_from"] = str(earlier)
    command = [sys.executable, "-m", "farm", "tune-model", str(path), "--target", args.target, "--trials",
               str(args.trials), "--workers", str(args.gpus), "--seed", str(seed), "--db", f"sqlite:///{db}",
               "--export", str(export), "--log-dir", str(args.out / f"logs-{stem}"), "--verbose"]
    wall, code = timed_process(command, args.out / f"{stem}.log", args.tune_limit)
    figures.update(wall_s=wall, command=" ".join(command))
    if code != 0 or not export.exists():
        figures["error"] = f"farm tune-model exit {code}: {log_tail(args.out / f'{stem}.log')}"
    else:
        figures.update(job_tasks(db))
    return figures


def job_tasks(db: Path) -> dict[str, Any]:
    """The newest job's kernels in `db`: how many, how many reused from an earlier job's records (not
    tuned again), and the trials spent on the others."""
    from db.store import open_store
    from farm.core.allocation import model_kernels

    store = open_store(f"sqlite:///{db}")
    kernels = model_kernels(store.job(max(j["id"] for j in store.jobs()))["tasks"])
    return {"kernels": len(kernels), "reused": sum(k.reused for k in kernels),
            "trials_tuned": sum(k.trials for k in kernels if not k.reused)}


def run_metaschedule(path: Path, target: str, trials: int, seed: int, work_dir: Path) -> None:
    """Child process: stock `tune_relax` of the model file into `work_dir`; writes work_dir/tune.json."""
    from tvm.s_tir import meta_schedule as ms

    from farm.core.host import usable_cores
    from farm.core.model import load_model
    from workers.worker import BUILD_TIMEOUT_S

    spec = parse_target(target)
    model = load_model(path)
    # tune_relax hands the module as given to extract_tasks, which collects its PrimFuncs: the model
    # is legalized and fused first, with the passes compile_relax runs before it applies the database
    # (farm.core.model.fuse_passes: the target's library dispatch, LegalizeOps ... FuseTIR).
    fused = model.fused(spec)
    # As bench/vs_metaschedule.py: one build process per core this process may use, the farm's
    # build timeout (its default 30 s times builds out on a shared host).
    builder = ms.builder.LocalBuilder(max_workers=usable_cores(), timeout_sec=BUILD_TIMEOUT_S)
    begin = time.perf_counter()
    ms.relax_integration.tune_relax(fused, None, spec.tvm(), str(work_dir), max_trials_global=trials, seed=seed,
                                    builder=builder)
    (work_dir / "tune.json").write_text(json.dumps({"tune_relax_s": time.perf_counter() - begin}))


def metaschedule(path: Path, args: argparse.Namespace, seed: int, out_spec: Any) -> tuple[Any, dict[str, Any]]:
    """Stock MetaSchedule's whole-model tuning (a child process, timed whole), then compile_relax;
    (its model over farm.torch's wrapper or None, figures)."""
    from tvm.s_tir import meta_schedule as ms

    from farm.build_model import CompiledModel
    from farm.core.model import load_model
    from farm.torch import FarmModule

    work_dir = args.out / f"{path.stem}-s{seed}-ms"
    figures: dict[str, Any] = {"work_dir": str(work_dir), "gpus": 1}
    if not args.retime:
        shutil.rmtree(work_dir, ignore_errors=True)
        work_dir.mkdir(parents=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--run-metaschedule", str(work_dir),
                   "--model-file", str(path), "--target", args.target, "--trials", str(args.trials),
                   "--seed", str(seed)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
        begin = time.perf_counter()
        with (work_dir / "tune.log").open("wb") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        figures["wall_s"] = time.perf_counter() - begin
        if code != 0:
            return None, {**figures, "error": f"tune_relax exit {code}: {log_tail(work_dir / 'tune.log')}"}
    try:
        figures.update(json.loads((work_dir / "tune.json").read_text()))
        records = (work_dir / "database_tuning_record.json").read_text().splitlines()
        run_secs = [json.loads(line)[1][1] for line in records]  # [workload, [trace, run_secs, target, args]]
        ok = sum(1 for secs in run_secs if secs and max(secs) < 1e9)  # a failure is recorded as 1e10 s
        figures.update(trials=len(run_secs), ok=ok, failed=len(run_secs) - ok)
        database = ms.database.JSONDatabase(str(work_dir / "database_workload.json"),
                                            str(work_dir / "database_tuning_record.json"), allow_missing=False)
        spec = parse_target(args.target)
        model = load_model(path)
        tasks = ms.relax_integration.extract_tasks(model.fused(spec), spec.tvm())
        tuned = [t.task_name for t in tasks
                 if database.query_tuning_record(t.dispatched[0], spec.tvm(), t.task_name) is not None]
        begin = time.perf_counter()
        with quiet():
            executable = ms.relax_integration.compile_relax(database, model.mod, spec.tvm(), params=None)
        figures.update(compile_s=time.perf_counter() - begin, tuned=len(tuned), kernels=len(tasks))
        untuned = [t.task_name for t in tasks if t.task_name not in tuned]
        module = FarmModule(CompiledModel(model, spec, executable, tuned, untuned, []), out_spec)
    except Exception as e:  # no records file, a database TVM cannot load, a build that fails
        return None, {**figures, "error": one_line(e)}
    return module, figures


def probe_compile(path: Path, device: str, mode: str, out: Path) -> None:
    """Child process: the model file's module compiled by torch.compile(mode=mode) on `device`;
    writes `out` (its compile seconds)."""
    import torch

    vendor_precision(torch)
    model, inputs, _ = load_module(path)
    model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
    with torch.no_grad():
        _, figures = torch_compiled(model, inputs, mode, device == "cuda")
    out.write_text(json.dumps(figures))


def max_autotune(path: Path, args: argparse.Namespace, model: Any, inputs: tuple[Any, ...],
                 cuda: bool) -> tuple[Any, dict[str, Any]]:
    """torch.compile's max-autotune-no-cudagraphs: compiled in a child within --compile-limit
    seconds, then here (from the child's caches)."""
    mode = "max-autotune-no-cudagraphs"
    result = args.out / f"{path.stem}-max-autotune.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--probe-compile", str(result), "--model-file",
               str(path), "--device", "cuda" if cuda else "cpu"]
    wall, code = timed_process(command, args.out / f"{path.stem}-max-autotune.log", args.compile_limit)
    figures: dict[str, Any] = {"mode": mode, "limit_s": args.compile_limit, "child_wall_s": wall}
    if code is None:
        return None, {**figures, "finished": False, "error": f"not compiled within {args.compile_limit:g} s"}
    child = json.loads(result.read_text()) if result.exists() else {}
    if code != 0 or "error" in child:
        return None, {**figures, "finished": False,
                      "error": child.get("error") or f"exit {code}: {log_tail(result.with_suffix('.log'))}"}
    compiled, here = torch_compiled(model, inputs, mode, cuda)
    figures.update(finished=True, compile_s=child["compile_s"], compile_s_cached=here.get("compile_s"),
                   **({"error": here["error"]} if "error" in here else {}))
    return compiled, figures


def versions(cuda: bool) -> dict[str, Any]:
    import torch
    import tvm

    found: dict[str, Any] = {"torch": torch.__version__, "tvm": tvm.__version__}
    for name in ("torchvision", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    if cuda:
        found.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return found


def bench_case(case: str, batch: int, args: argparse.Namespace, spec: TargetSpec, figures: dict[str, Any]) -> None:
    """One case at one batch: its model file, the contenders that do not depend on the seed, then per
    seed a tuning job (and MetaSchedule's), the builds, the check and the timing; JSON after each seed."""
    import torch

    cuda = spec.is_gpu
    path = write_model_file(case, batch, args.dtype, args.out)
    cpu_model, cpu_inputs, implementation = load_module(path)
    model = copy.deepcopy(cpu_model).to("cuda") if cuda else cpu_model
    inputs = tuple(x.to("cuda") for x in cpu_inputs) if cuda else cpu_inputs
    name = f"{case}-b{batch}"
    entry: dict[str, Any] = {"case": case, "batch": batch, "model_file": str(path), "implementation": implementation,
                             "inputs": [[list(x.shape), str(x.dtype).removeprefix("torch.")] for x in inputs],
                             "contenders": {}, "runs": []}
    figures["cases"][name] = entry
    print(f"{name}: {implementation}", flush=True)
    with torch.no_grad():
        expected = model(*inputs)
        fixed: dict[str, Any] = {"eager": model}
        compiled, entry["contenders"]["torch.compile"] = torch_compiled(model, inputs, None, cuda)
        if compiled is not None:
            fixed["torch.compile"] = compiled
        if args.max_autotune:
            tuned_compile, entry["contenders"]["torch.compile max-autotune"] = max_autotune(
                path, args, model, inputs, cuda)
            if tuned_compile is not None:
                fixed["torch.compile max-autotune"] = tuned_compile
        untuned, entry["contenders"]["tvm untuned"] = farm_build(cpu_model, cpu_inputs, args.target, None)
        if untuned is not None:
            fixed["tvm untuned"] = untuned
        out_spec = None  # the structure of the model's outputs, for MetaSchedule's model in farm.torch's wrapper
        if args.ms_tune_relax:
            with quiet():
                out_spec = torch.export.export(cpu_model, cpu_inputs).call_spec.out_spec
        for label, info in entry["contenders"].items():
            if "error" in info:
                print(f"  {label}: {info['error'].splitlines()[0][:300]}", flush=True)
        for seed in args.seeds:
            run: dict[str, Any] = {"seed": seed, "farm_tune": farm_tune_model(path, args, seed)}
            entry["runs"].append(run)
            modules = dict(fixed)
            if "error" not in run["farm_tune"]:
                export = Path(run["farm_tune"]["export"])
                tuned, run["farm_build"] = farm_build(cpu_model, cpu_inputs, args.target, export)
                if tuned is not None:
                    modules["farm"] = tuned
            if args.ms_tune_relax:
                ms_module, run["metaschedule"] = metaschedule(path, args, seed, out_spec)
                if ms_module is not None:
                    modules["metaschedule"] = ms_module
            checks: dict[str, dict[str, Any]] = {}
            for label, module in list(modules.items()):
                try:
                    error = rel_l2_error(module(*inputs), expected)
                except Exception as e:  # a build that fails when it runs: recorded, not timed
                    run.setdefault("failed_to_run", {})[label] = one_line(e)
                    del modules[label]
                    continue
                checks[label] = {"rel_l2_error": error, "correct": bool(error <= TOLERANCE[args.dtype])}
            timing = time_side_by_side({label: (lambda m=module: m(*inputs)) for label, module in modules.items()},
                                       cuda)
            run["timing"] = {label: {**checks[label], **timing[label]} for label in modules}
            if args.profile and cuda:
                run["profile"] = {label: kernel_profile(lambda m=module: m(*inputs))
                                  for label, module in modules.items()}
                for label, kernels in run["profile"].items():
                    top = ", ".join(f"{k['name'][:40]} {k['us_per_call']:.1f}" for k in kernels["kernels"][:5])
                    print(f"  {label}: {kernels['kernels_per_call']:.0f} kernels, {kernels['us_per_call']:.1f} µs of "
                          f"GPU time per call; top: {top}", flush=True)
            if "farm" in timing:
                farm_ms = timing["farm"]["median_ms"]
                run["ratios"] = {f"{label}/farm": timing[label]["median_ms"] / farm_ms
                                 for label in timing if label != "farm"}
            print(seed_line(name, run), flush=True)
            if args.json:  # after every seed: a run cut short (a device lease ending) keeps what it finished
                args.json.write_text(json.dumps(figures, indent=1))
    entry["summary"] = summarise(entry["runs"])
    print(summary_line(name, entry["summary"]), flush=True)


def kernel_profile(fn: Callable[[], Any], calls: int = PROFILE_CALLS) -> dict[str, Any]:
    """Where one contender's GPU time goes: every CUDA kernel of `calls` calls, as CUPTI sees it
    (torch.profiler; TVM's kernels and CUDA-graph replays included), grouped by name, the slowest
    first: µs per model call and launches per call. The time between kernels is what the model's
    latency has on top of their sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [{"name": e.key, "us_per_call": e.device_time_total / calls, "launches_per_call": e.count / calls}
               for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda k: -k["us_per_call"])
    return {"calls": calls, "us_per_call": sum(k["us_per_call"] for k in kernels),
            "kernels_per_call": sum(k["launches_per_call"] for k in kernels), "kernels": kernels[:40]}


def seed_line(name: str, run: dict[str, Any]) -> str:
    tune = run["farm_tune"]
    parts = [f"farm tune {tune['wall_s']:.0f} s" if "wall_s" in tune else "farm tune (earlier run)"]
    if tune.get("reused"):
        parts.append(f"{tune['reused']}/{tune['kernels']} kernels reused, {tune['trials_tuned']} trials on the rest")
    if "error" in tune:
        parts.append(f"farm tune FAILED: {tune['error'].splitlines()[-1][:200]}")
    for label, t in run["timing"].items():
        parts.append(f"{label} {t['median_ms']:.3f} ms" + ("" if t["correct"] else f" WRONG ({t['rel_l2_error']:.1e})"))
    build = run.get("farm_build", {})
    if "tuned" in build:
        parts.append(f"farm kernels tuned {build['tuned']}/{build['kernels']}")
    if "error" in build:
        parts.append(f"farm build FAILED: {build['error'][:200]}")
    for label, error in run.get("failed_to_run", {}).items():
        parts.append(f"{label} FAILED to run: {error[:200]}")
    ms = run.get("metaschedule")
    if ms:
        parts.append(f"MetaSchedule {ms['wall_s']:.0f} s" if "wall_s" in ms else "MetaSchedule (earlier run)")
        if "tuned" in ms:
            parts.append(f"MetaSchedule kernels tuned {ms['tuned']}/{ms['kernels']}")
        if "error" in ms:
            parts.append(f"MetaSchedule FAILED: {ms['error'].splitlines()[-1][:200]}")
    return f"{name} seed {run['seed']}: " + "; ".join(parts)


def summarise(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per figure, its values over the seeds that have it."""
    summary: dict[str, list[float]] = {"farm_tune_wall_s": [r["farm_tune"]["wall_s"] for r in runs
                                                            if "wall_s" in r["farm_tune"]]}
    for label in CONTENDERS:
        summary[f"{label}_ms"] = [r["timing"][label]["median_ms"] for r in runs if label in r["timing"]]
    for ratio in [f"{label}/farm" for label in CONTENDERS if label != "farm"]:
        summary[ratio] = [r["ratios"][ratio] for r in runs if ratio in r.get("ratios", {})]
    summary["metaschedule_wall_s"] = [r["metaschedule"]["wall_s"] for r in runs
                                      if "wall_s" in r.get("metaschedule", {})]
    return {key: values for key, values in summary.items() if values}


def spread(values: list[float]) -> str:
    """'median (min-max)' of a figure over seeds, to three significant digits (whole seconds from 100)."""
    def number(v: float) -> str:
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"

    return f"{number(statistics.median(values))} ({number(min(values))}-{number(max(values))})"


def summary_line(name: str, summary: dict[str, list[float]]) -> str:
    def figure(key: str, unit: str) -> str:
        return f"{key.removesuffix('_ms').removesuffix('_wall_s')} {spread(summary[key])}{unit}"

    parts = [f"farm tune {spread(summary['farm_tune_wall_s'])} s"] if "farm_tune_wall_s" in summary else []
    parts += [figure(f"{label}_ms", " ms") for label in CONTENDERS if f"{label}_ms" in summary]
    parts += [f"{key} {spread(summary[key])}x" for key in summary if key.endswith("/farm")]  # above 1: farm faster
    if "metaschedule_wall_s" in summary:
        parts.append(f"MetaSchedule tune {spread(summary['metaschedule_wall_s'])} s")
    runs = len(summary.get("eager_ms", []))
    return f"{name}, median over {runs} seed(s) (min-max): " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(MODEL_FILES),
                        help="a model (repeat for more; default: resnet50 and bert)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32",
                        help="the models' weights and inputs: float32, or float16 (against PyTorch in float16)")
    parser.add_argument("--trials", type=int, default=2000,
                        help="farm tune-model's trials, and tune_relax's (which gives a kernel 64 at a time: "
                             "at least 64 x kernels for it to reach every kernel)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--gpus", type=int, default=1, help="farm tune-model's workers, one GPU each")
    parser.add_argument("--target", default="cuda", help="cuda, or llvm for a check of this script on a CPU")
    parser.add_argument("--max-autotune", action="store_true",
                        help='also torch.compile(mode="max-autotune-no-cudagraphs"), given --compile-limit seconds')
    parser.add_argument("--compile-limit", type=float, default=600.0)
    parser.add_argument("--reuse-from", metavar="CASE", choices=sorted(MODEL_FILES),
                        help="each job starts from the database of CASE's job of the same batch and seed, an "
                             "earlier run in --out: the kernels it tuned are reused, not tuned again")
    parser.add_argument("--tune-limit", type=float, default=None,
                        help="seconds a farm tune-model may run; then its threads' stacks go to its log, it is "
                             "stopped and the seed records the error")
    parser.add_argument("--ms-tune-relax", action="store_true",
                        help="also stock MetaSchedule's tune_relax, same trials, one GPU, and its model")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each contender's GPU kernels (torch.profiler): time per kernel, launches "
                             "per call, the 40 slowest in the JSON, where a model is slower than another")
    parser.add_argument("--out", type=Path, default=Path("/tmp/models-vs-torch"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--retime", action="store_true",
                        help="tune nothing: build and time the exports (and MetaSchedule databases) of an "
                             "earlier run in --out again")
    parser.add_argument("--run-metaschedule", type=Path, help=argparse.SUPPRESS)  # the child's work dir
    parser.add_argument("--probe-compile", type=Path, help=argparse.SUPPRESS)  # the child's result file
    parser.add_argument("--model-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_metaschedule:
        run_metaschedule(args.model_file, args.target, args.trials, args.seed, args.run_metaschedule)
        return
    if args.probe_compile:
        probe_compile(args.model_file, args.device, "max-autotune-no-cudagraphs", args.probe_compile)
        return
    spec = parse_target(args.target)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    # torch.compile compiles from scratch in every run: Inductor's and Triton's caches are folders of
    # OUT, emptied here (the max-autotune child and its children inherit them).
    for variable, folder in (("TORCHINDUCTOR_CACHE_DIR", "inductor-cache"), ("TRITON_CACHE_DIR", "triton-cache")):
        shutil.rmtree(args.out / folder, ignore_errors=True)
        os.environ[variable] = str(args.out / folder)
    import torch

    vendor_precision(torch)
    cuda = spec.is_gpu
    figures: dict[str, Any] = {
        "command": " ".join(sys.argv), "target": args.target, "trials": args.trials, "gpus": args.gpus,
        "dtype": args.dtype, "seeds": args.seeds, "tolerance": TOLERANCE[args.dtype], "machine": machine(),
        "device": torch.cuda.get_device_name() if cuda else machine(), "versions": versions(cuda),
        "timing": {"rounds": ROUNDS, "samples_per_round": SAMPLES, "calls_per_sample": CALLS, "warmup": WARMUP,
                   "max_sample_s": MAX_SAMPLE_S, "clock": "CUDA events" if cuda else "time.perf_counter",
                   "tf32": False},
        "cases": {},
    }
    for case in args.case or ["resnet50", "bert"]:
        for batch in args.batch:
            bench_case(case, batch, args, spec, figures)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
