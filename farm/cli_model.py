"""The model commands of `farm`: `farm tune-model` and `farm build-model` (registered by farm.cli).

A model is a file: ONNX (``model.onnx``), a saved `torch.export` program (``model.pt2``), or a
Python file that builds it (``model.py`` defining ``model`` and ``example_inputs``).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from farm.core.errors import FarmError
from farm.core.files import replacing, writable_file
from farm.progress import format_latency, make_console

if TYPE_CHECKING:
    from farm.core.model import Model

console = make_console(stderr=True)
out = make_console()

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="model.onnx, a saved torch.export program (model.pt2), or model.py defining `model` "
    "(a torch.nn.Module) and `example_inputs` (a tuple of tensors).")]
InputOpt = Annotated[list[str] | None, typer.Option(
    "--input", metavar="NAME=SHAPE", help="An ONNX input's shape where the model leaves it symbolic, e.g. "
    "input=1x3x224x224 (repeat per input).")]
DbOpt = Annotated[str | None, typer.Option(
    "--db", help="Database URL (sqlite:///FILE or postgresql://USER@HOST/DB). Default: $FARM_DB, else "
    "sqlite:///farm.db.")]
TargetOpt = Annotated[str, typer.Option(help='llvm, cuda, or a JSON target like \'{"kind":"cuda","arch":"sm_90"}\'.')]
# A compiled fp32 model's outputs against its framework's: relative to the largest output value.
CHECK_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}


def tune_model(
    model: ModelArg,
    target: TargetOpt = "llvm",
    trials: Annotated[int, typer.Option(min=1, help="Measurements in all, handed to the model's kernels where "
                                        "its latency falls fastest.")] = 64,
    db: DbOpt = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="Devices to measure on (default: every GPU for cuda, 1 for llvm).")] = None,
    search: Annotated[str, typer.Option(help="Search strategy and its options (see farm tune --help).")] = "xgb",
    seed: Annotated[int, typer.Option(help="Seed of the search.")] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Candidates per worker per round.")] = 16,
    skip: Annotated[list[str] | None, typer.Option(
        metavar="PATTERN", help="Leave out the kernels this name or shell pattern matches (repeat); a build "
        "schedules them with TVM's defaults.")] = None,
    task_trials: Annotated[list[str] | None, typer.Option(
        metavar="PATTERN=N", help="Give the kernels a name or pattern matches N trials each (repeat); the rest "
        "of the budget goes to the others.")] = None,
    retune: Annotated[bool, typer.Option(help="Tune kernels again that an earlier job tuned on this target.")]
    = False,
    inputs: InputOpt = None,
    export: Annotated[Path | None, typer.Option(help="Write the best config of every kernel (farm.best/1 JSON) "
                                                "here; `farm build-model --best` applies it.")] = None,
    queue: Annotated[bool, typer.Option("--queue", help="Only queue the job for the farm's schedulers "
                                        "(`farm scheduler`) and print its id.")] = False,
    log_dir: Annotated[Path | None, typer.Option(help="Keep the RPC tracker's, servers' and workers' logs here.")]
    = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log scheduler details.")] = False,
) -> None:
    """Tune every kernel of a model in one job, on every device at once.

    The model is imported into TVM Relax, legalized and fused; each distinct kernel is a task,
    weighted by its calls per inference. The job's trials go a round at a time to the kernel whose
    next trials should lower the model's estimated latency (Σ weight x best latency) the most.
    Kernels an earlier job tuned on this target are reused, not tuned again (unless --retune).
    Then `farm build-model MODEL --best FILE` (or --db) compiles the model with the results."""
    from farm.client import Client
    from farm.core.model import load_model, model_job
    from farm.core.targets import parse_target

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    spec = parse_target(target)
    if export is not None:
        writable_file(export)
    workers = _workers(spec, workers)
    loaded = load_model(model, input_shapes=_shapes(inputs or []))
    budgets = dict(_assignment(text) for text in task_trials or [])
    options: dict[str, Any] = {"search": search, "workers": workers, "seed": seed, "batch_size": batch_size}
    request = model_job(loaded, spec, trials, skip=skip or [], budgets=budgets, retune=retune, **options)
    _describe(loaded, request.model or {}, trials, workers, spec.kind)
    if queue:
        with Client(db, in_process=False) as client:
            job = client.submit_request(request)
        out.print(job.id)
        console.print(f"job {job.id} queued; follow it with `farm status {job.id}`", markup=False)
        return
    with Client(db, in_process=True, log_dir=log_dir) as client:
        client.prepare(spec, workers)
        job = client.submit_request(request)
        try:
            job.wait(progress=True)
        except KeyboardInterrupt:
            console.print(f"job {job.id} interrupted: stopping it, its trials kept", markup=False)
            raise
        print_breakdown(job.status())
        if export is not None:
            job.export(export)
            out.print(f"exported the best config of each kernel to {export}", markup=False)


def build_model(
    model: ModelArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="The shared library to write.")] = Path("model.so"),
    target: TargetOpt = "cuda",
    best: Annotated[Path | None, typer.Option(help="An export (farm.best/1) holding tuned kernels.")] = None,
    db: DbOpt = None,
    cuda_graph: Annotated[bool, typer.Option(help="Capture the model's kernel launches in a CUDA graph.")] = True,
    check: Annotated[bool, typer.Option(help="Check the outputs against the model's own framework (PyTorch "
                                        "eager, onnxruntime) on random inputs before writing.")] = True,
    inputs: InputOpt = None,
) -> None:
    """Compile a model with the farm's tuned kernels into a library TVM's runtime loads.

    Each kernel takes its fastest record from --best (an export) and from the farm's database
    (--db, or $FARM_DB / farm.db when it exists): the database is a store of tuning records every
    later build draws on. Kernels without one are scheduled by TVM's defaults and listed. The
    library runs in `tvm.relax.VirtualMachine(tvm.runtime.load_module(PATH), device)`."""
    from farm.build_model import compile_model
    from farm.core.model import load_model

    writable_file(output)
    store = _records_store(db)
    if best is None and store is None:
        raise FarmError("give the tuned records: --best FILE (an export) or --db URL (the farm's database)")
    loaded = load_model(model, input_shapes=_shapes(inputs or []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_model(loaded, target=target, best=best, store=store, cuda_graph=cuda_graph)
    for w in caught:
        console.print(f"farm: warning: {w.message}", markup=False, highlight=False)
    total = len(compiled.tuned) + len(compiled.untuned)
    if check:
        error = compiled.check()
        tolerance = max(CHECK_TOLERANCE.get(i.dtype, 1e-3) for i in loaded.inputs)
        if error > tolerance:
            raise FarmError(f"the compiled model's outputs differ from {loaded.framework_name}'s by {error:.2e} "
                            f"(relative; more than {tolerance:g}): nothing written")
        out.print(f"outputs match {loaded.framework_name} (largest relative difference {error:.2e})", markup=False)
    with replacing(output, suffix=".so") as tmp:
        compiled.executable.export_library(str(tmp))
    kept = f" ({len(compiled.defaults)} of them TVM's default schedule, which no config beat)" \
        if compiled.defaults else ""
    out.print(f"wrote {output}: {loaded.name} for {compiled.target.kind}, {len(compiled.tuned)} of {total} kernels "
              f"from tuning{kept}", markup=False, highlight=False)


def print_breakdown(job: dict[str, Any]) -> None:
    """A model job's kernels: weight, trials, best latency, share of the estimated model latency."""
    from farm.core.allocation import model_kernels, model_latency

    kernels = model_kernels(job["tasks"])
    total = model_latency(kernels)
    table = Table(title=f"job {job['id']}: {job['name']}")
    for column in ("kernel", "calls", "trials", "best", "share"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for k in sorted(kernels, key=lambda k: -(k.best or 0) * k.weight):
        share = f"{k.weight * k.best / total:.0%}" if total and k.best is not None else "-"
        trials = "reused" if k.reused else str(k.trials)
        table.add_row(k.name, str(k.weight), trials, format_latency(k.best), share)
    out.print(table)
    estimate = format_latency(total) if total is not None else "- (a kernel has no correct trial yet)"
    out.print(f"estimated model latency (Σ calls x best): {estimate}", markup=False, highlight=False)


def _describe(model: Model, record: dict[str, Any], trials: int, workers: int, kind: str) -> None:
    kernels = record.get("kernels", [])
    console.print(f"model {model.name}: {len(kernels)} kernels ({sum(w for _, w in kernels)} calls per inference), "
                  f"{trials} trials on {workers} {kind} worker(s)", markup=False, highlight=False)
    for name in record.get("skipped", []):
        console.print(f"  skipped: {name}", markup=False, highlight=False)
    for name, why in record.get("untunable", []):
        console.print(f"  not tunable, left to TVM's defaults: {name} ({why})", markup=False, highlight=False)


def _workers(spec: Any, workers: int | None) -> int:
    if spec.is_gpu:
        from farm.core.host import gpu_count

        gpus = gpu_count()
        if gpus == 0:
            raise FarmError("no GPU visible here (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): "
                            "use --target llvm, or run on a machine with an NVIDIA GPU")
        return workers or gpus
    return workers or 1


def _assignment(text: str) -> tuple[str, int]:
    name, sep, value = text.rpartition("=")
    if not sep or not name or not value.isdigit() or int(value) < 1:
        raise FarmError(f"--task-trials takes PATTERN=N with N a positive number, got {text!r}")
    return name, int(value)


def _shapes(texts: list[str]) -> dict[str, list[int]]:
    shapes = {}
    for text in texts:
        name, sep, shape = text.partition("=")
        dims = shape.split("x")
        if not sep or not name or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise FarmError(f"--input takes NAME=SHAPE like input=1x3x224x224, got {text!r}")
        shapes[name] = [int(d) for d in dims]
    return shapes


def _records_store(db: str | None) -> Any:
    """The farm's database to draw records from: `db`, else the default one if it exists, else None."""
    from db.engine import resolve_url
    from db.store import open_store

    url = resolve_url(db)
    if db is None and url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        return None
    return open_store(db)
