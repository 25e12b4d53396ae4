"""The `farm` command line. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.table import Table
from typer.core import TyperCommand

from deploy.cluster import cluster_app
from farm.cli_model import build_model, print_breakdown, tune_model
from farm.core.errors import FarmError
from farm.core.files import replacing, writable_file, writable_folder
from farm.core.workloads import workload_label
from farm.progress import format_latency, make_console

if TYPE_CHECKING:
    from db.store import ResultStore
    from farm.client import Job
    from farm.core.workloads import Workload

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="A kernel-tuning farm for Apache TVM: tune tensor kernels on CPUs and GPUs, "
    "store every measurement, export the best configs to your builds.\n\n"
    "Start with `farm workloads`, then e.g. `farm tune resnet-last-conv --target llvm --trials 64`.",
)
console = make_console(stderr=True)
out = make_console()

DbOption = Annotated[str | None, typer.Option(
    "--db", help="Database URL (sqlite:///FILE or postgresql://USER@HOST/DB). "
    "Default: $FARM_DB, else sqlite:///farm.db.")]


KernelArg = Annotated[list[str], typer.Argument(
    metavar="WORKLOAD [KEY=VALUE ...]", help="A workload or preset (see `farm workloads`), then its parameters "
    "as key=value, e.g. conv2d_nchw N=1 CI=256 H=14 W=14 CO=256 KH=3 KW=3 pad=1; or a TVMScript file of any "
    "TIR kernel, kernel.py (one @T.prim_func) or kernels.py:NAME.")]
TargetOpt = Annotated[str, typer.Option(help='llvm, cuda, or a JSON target like \'{"kind":"cuda","arch":"sm_80"}\'.')]
TemplatesOpt = Annotated[str, typer.Option(
    help="best: each kernel tuned with its preferred template; all: with every template that schedules it, "
    "one task each, the faster kept (a TIR kernel around a farm operator: its hand template and its design "
    "space; docs/tir.md).")]


# How a user names a kernel that is none of the named workloads (farm.core.tir; docs/tir.md).
TIR_HOW = ("a TIR PrimFunc in a TVMScript file, `farm tune kernel.py` (one @T.prim_func) or `farm tune "
           "kernels.py:NAME`, or from Python `client.submit([prim_func])`; tuned in MetaSchedule's design "
           "spaces (templates ms.cuda, ms.llvm): see docs/tir.md")


@app.command()
def workloads(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List workloads, their parameters, the presets, and each template's config-space size; and
    how to name any other TIR kernel."""
    from farm.core.targets import KINDS, parse_target
    from farm.core.task import Task
    from farm.core.workloads import PRESETS, WORKLOADS, make_workload

    targets = {kind: parse_target(kind) for kind in KINDS}
    doc: dict[str, Any] = {"workloads": [], "presets": [], "tir": TIR_HOW}
    for d in WORKLOADS.values():
        doc["workloads"].append({
            "name": d.name, "doc": d.doc,
            "params": [{"name": p.name, "default": p.default, **({"choices": list(p.choices)} if p.choices else {})}
                       for p in d.params],
        })
    for name, (wl_name, _params, about) in PRESETS.items():
        wl = make_workload(name)
        spaces = {}
        for kind, target in targets.items():
            task = Task(wl, target)
            spaces[kind] = {"template": task.template.name, "space_size": task.space.size}
        doc["presets"].append({"name": name, "workload": wl_name, "params": wl.p, "about": about,
                               "gflop": wl.flops() / 1e9, "spaces": spaces})
    if as_json:
        out.print_json(json.dumps(doc))
        return
    table = Table(title="Workloads", show_lines=False)
    table.add_column("workload", no_wrap=True)
    table.add_column("parameters (default)")
    table.add_column("what")
    for w in doc["workloads"]:
        params = ", ".join(p["name"] + ("" if p["default"] is None else f"[{p['default']}]") for p in w["params"])
        table.add_row(w["name"], params, w["doc"])
    out.print(table)
    presets = Table(title="Presets (config-space size per target kind)")
    for col in ("preset", "workload", "GFLOP", *KINDS):
        presets.add_column(col, no_wrap=col in ("preset", "workload"))
    for p in doc["presets"]:
        presets.add_row(p["name"], p["workload"], f"{p['gflop']:.3f}",
                        *(f"{p['spaces'][k]['space_size']:,} ({p['spaces'][k]['template']})" for k in KINDS))
    out.print(presets)
    out.print(f"Any other kernel: {TIR_HOW}", markup=False, highlight=False)


class _SearchHelpCommand(TyperCommand):
    """A command whose `--search` help is generated from the search options when its help is shown
    (farm.core.search.search_help), so that no other use of the CLI imports the search (numpy)."""

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        from farm.core.search import search_help

        for param in self.params:
            if param.name == "search":
                param.help = search_help()  # type: ignore[attr-defined]  # an option's, which has help
        super().format_help(ctx, formatter)


@app.command(cls=_SearchHelpCommand, context_settings={"allow_extra_args": False})
def tune(
    kernel: KernelArg,
    target: TargetOpt = "llvm",
    trials: Annotated[int, typer.Option(min=1, help="Number of candidates to measure.")] = 64,
    db: DbOption = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="Devices to measure on (default: every GPU for cuda, 1 for llvm).")] = None,
    search: Annotated[str, typer.Option(
        help="Search strategy and its options (farm.core.search.search_help, when shown).")] = "xgb",
    export: Annotated[Path | None, typer.Option(help="Write the best config (farm.best/1 JSON) here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the search.")] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Candidates per worker per round.")] = 16,
    templates: TemplatesOpt = "best",
    log_dir: Annotated[Path | None, typer.Option(
        help="Keep the logs of the RPC tracker, servers and worker actors (start-up steps, sessions) here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log scheduler details.")] = False,
) -> None:
    """Tune one kernel end to end on this machine: starts an RPC tracker and servers, measures
    TRIALS candidates, stores every result in the database, prints and exports the best."""
    from farm.client import Client
    from farm.core.host import gpu_count
    from farm.core.jobspec import JobRequest
    from farm.core.targets import parse_target
    from farm.core.templates import arch_specific_hint
    from farm.core.tvm_import import import_tvm

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    # Validate everything before anything starts or is written (no TVM needed for that).
    wl = _one_workload(kernel)
    spec = parse_target(target)
    if export is not None:
        writable_file(export)
    if spec.is_gpu:
        gpus = gpu_count()
        if gpus == 0:
            raise FarmError("no GPU visible here (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): "
                            "use --target llvm, or run on a machine with an NVIDIA GPU")
        workers = workers or gpus
    workers = workers or 1
    options = {"search": search, "workers": workers, "seed": seed, "batch_size": batch_size, "templates": templates}
    request = JobRequest.build([wl], target, trials, **options)
    with Client(db, in_process=True, log_dir=log_dir) as client:  # FarmError for a log folder it cannot write
        client.prepare(spec, workers)  # Ray and the workers start while the job is stored
        import_tvm()  # before the job's thread could (its cost model reads kernels): see farm.core.tvm_import
        job = client.submit([wl], target, trials, **options)
        for task in request.tasks:
            console.print(f"job {job.id}: {task} — space of {task.space.size:,} configs ({task.template.name}), "
                          f"{trials} trials on {workers} {spec.kind} worker(s)", markup=False, highlight=False)
        if hint := arch_specific_hint(wl, spec):
            console.print(hint, markup=False, highlight=False)
        try:
            job.wait(progress=True)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: leaving the client's block stops the job (cancelled)
            console.print(f"job {job.id} interrupted: stopping it, its trials kept", markup=False)
            raise
        _report_best(job, export)


WorkloadsArg = Annotated[list[str], typer.Argument(
    help="Workloads or presets; parameters follow each as key=value, e.g. matmul M=512 N=512 K=512 resnet-last-conv")]


@app.command()
def submit(
    workloads: WorkloadsArg,
    target: TargetOpt = "llvm",
    trials: Annotated[int, typer.Option(min=1, help="Measurements in all, spread over the workloads.")] = 64,
    db: DbOption = None,
    workers: Annotated[int, typer.Option(min=1, help="Devices (worker actors) to measure on.")] = 1,
    search: Annotated[str, typer.Option(help="Search strategy and its options (see farm tune --help).")] = "xgb",
    seed: Annotated[int, typer.Option(help="Seed of the search.")] = 0,
    rpc_key: Annotated[list[str] | None, typer.Option(
        help="Measure on a device that runs only a TVM RPC server registered under this key "
        "with the farm's tracker (repeat for several).")] = None,
    name: Annotated[str, typer.Option(help="A name for the job.")] = "",
    templates: TemplatesOpt = "best",
) -> None:
    """Queue a job for the farm's schedulers (`farm scheduler`) and print its id."""
    from farm.client import Client

    parsed = _parse_workloads(workloads)
    with Client(db, in_process=False) as client:
        job = client.submit(parsed, target, trials, search=search, workers=workers, seed=seed,
                            rpc_keys=rpc_key or (), name=name, templates=templates)
    out.print(job.id)
    console.print(f"job {job.id} queued: {len(parsed)} task(s), {trials} trials; "
                  f"follow it with `farm status {job.id}`", markup=False)


def _one_workload(words: list[str]) -> Workload:
    """`name k=v k=v` (one workload) as a Workload; FarmError for anything else."""
    from farm.core.tir import is_script, tir_from_file
    from farm.core.workloads import make_workload, parse_assignments

    name, *params = words
    bad = [word for word in params if "=" not in word]
    if bad:
        raise FarmError(f"parameter {bad[0]!r} must look like key=value (this command takes one workload)")
    if is_script(name):
        if params:
            raise FarmError(f"a TIR kernel ({name}) takes no parameters: its shapes are in its TVMScript")
        return tir_from_file(name)
    return make_workload(name, parse_assignments(params))


def _parse_workloads(words: list[str]) -> list[Any]:
    """`name k=v k=v name2 ...` into [(name, {k: v}), ...]."""
    from farm.core.workloads import parse_assignments

    groups: list[tuple[str, list[str]]] = []
    for word in words:
        if "=" in word:
            if not groups:
                raise FarmError(f"parameter {word!r} comes before any workload name")
            groups[-1][1].append(word)
        else:
            groups.append((word, []))
    from farm.core.tir import is_script, tir_from_file

    out: list[Any] = []
    for name, params in groups:
        if is_script(name):
            if params:
                raise FarmError(f"a TIR kernel ({name}) takes no parameters: its shapes are in its TVMScript")
            out.append(tir_from_file(name))
        else:
            out.append((name, parse_assignments(params)))
    return out


@app.command()
def scheduler(
    db: DbOption = None,
    tracker: Annotated[str | None, typer.Option(
        help="The farm's RPC tracker as HOST:PORT (default: start one on this machine).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Ray cluster to join, e.g. auto or HOST:6379 (default: start Ray on this machine).")] = None,
    poll: Annotated[float, typer.Option(help="Seconds between looks for queued jobs.")] = 0.25,
    once: Annotated[bool, typer.Option("--once", help="Exit when no job is queued.")] = False,
    max_jobs: Annotated[int | None, typer.Option(
        min=1, help="Jobs run at once, each on its own workers (default: as many as the cluster has "
        "GPUs; a job waits while the devices it needs are taken).")] = None,
    keep_warm: Annotated[float, typer.Option(
        min=0, help="Seconds a finished job's workers (actors, RPC servers, sessions) stay up for the "
        "next job of the same shape before their devices are given back.")] = 300.0,
    log_dir: Annotated[Path | None, typer.Option(
        help="Keep the logs of the tracker, servers and worker actors here.")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        min=0, max=65535, help="Serve Prometheus metrics at http://HOST:PORT/metrics (default "
        "$FARM_SCHEDULER_METRICS_PORT, else 9100; 0: any free port). Worker actors serve theirs on "
        "$FARM_WORKER_METRICS_PORT (9101) + their GPU.")] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics listen on (0.0.0.0 in a container).")]
    = "127.0.0.1",
) -> None:
    """Run the scheduler service: claim queued jobs and run them on worker actors, one per device.

    Jobs run at once while the cluster has devices for them (`--max-jobs`); a job's workers stay
    warm for the next job of the same shape (`--keep-warm`)."""
    from farm.core import metrics
    from farm.core.tvm_import import import_tvm
    from scheduler.service import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if log_dir is not None:
        writable_folder(log_dir)
    import_tvm()  # the jobs' tasks need it (see farm.core.tvm_import)
    address = _host_port(tracker) if tracker else None
    store = _open_store(db)
    wanted = metrics.scheduler_port() if metrics_port is None else metrics_port
    try:
        port = metrics.serve(wanted, metrics_host)
    except OSError as e:
        if metrics_port is not None:  # asked for: that port or nothing
            raise FarmError(f"cannot serve metrics on {metrics_host}:{wanted}: {e.strerror}; "
                            "give another --metrics-port") from None
        # The default is taken (another scheduler on this machine): any free port, said in the log.
        port = metrics.serve(0, metrics_host)
        logging.getLogger("farm.scheduler").warning("metrics port %d is taken; serving on %d", wanted, port)
    logging.getLogger("farm.scheduler").info("metrics at http://%s:%d/metrics", metrics_host, port)
    # SIGTERM (docker stop, systemd) stops it like Ctrl-C (main: stop_on_signals): its running
    # jobs are given back, queued.
    with Scheduler(store, tracker=address, ray_address=ray_address, log_dir=log_dir,
                   give_back_on_interrupt=True, max_jobs=max_jobs, keep_warm_seconds=keep_warm) as service:
        try:
            service.serve(poll_seconds=poll, once=once)
        except KeyboardInterrupt:
            console.print("scheduler stopped; a running job was given back")


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise FarmError(f"tracker address {text!r} must look like HOST:PORT")
    return host, int(port)


JobArg = Annotated[int, typer.Argument(help="Job id (see `farm jobs`).")]


WatchOption = Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")]


@app.command()
def status(
    job: JobArg,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Follow the job live: `farm top JOB`.")] = False,
    interval: WatchOption = 2.0,
) -> None:
    """A job's state, its tasks' trial counts by status, best latency and rounds (a model's job: each
    kernel's calls, best latency and share of the model's estimated latency), and its pace:
    throughput (trials stored since a scheduler claimed the job, over the seconds since), the
    rate of the last 60 s, the ETA (trials left of the budget over that rate), and each device's
    busy share (its time inside timed kernel runs over the job's wall time)."""
    from farm.report import pace, rounds_summary, utilisation

    store = _open_store(db, must_exist=True)
    if watch:
        from farm.top import run

        run(store, out, [job], interval=interval)
        return
    doc = store.job(job)
    if doc is None:
        raise FarmError(f"no job {job} in this database")
    for task in doc["tasks"]:
        task["rounds"] = store.rounds(task["id"])
    job_pace = pace(store, doc)
    model = doc["spec"].get("model")
    if as_json:
        if model is not None:
            from farm.core.allocation import model_kernels, model_latency

            doc["model_latency"] = model_latency(model_kernels(doc["tasks"]))
        doc["pace"] = {"throughput": job_pace.throughput, "recent_rate": job_pace.recent_rate,
                       "recent_seconds": job_pace.recent_seconds, "eta_seconds": job_pace.eta_seconds}
        doc["busy_share"] = utilisation(store, job).busy_share
        out.print_json(json.dumps(doc, default=str))
        return
    out.print(f"job {doc['id']} [{doc['status']}] {doc['name']}: {doc['trials']}/{doc['trials_budget']} trials, "
              f"search {doc['search']}", markup=False, highlight=False)
    if doc.get("error"):
        out.print(f"  error: {doc['error']}")
    for task in doc["tasks"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(task["counts"].items())) or "no trials yet"
        out.print(f"  task {task['id']} {workload_label(task['workload'])} ({task['template']}): "
                  f"{task['trials']}/{task['budget']} trials ({counts}), best {format_latency(task['best_latency'])}, "
                  f"{len(task['rounds'])} rounds")
    if model is not None:
        print_breakdown(doc)
    out.print(f"  {job_pace.summary()}", markup=False, highlight=False)
    if doc["trials"]:
        out.print(f"  {utilisation(store, job).summary()}", markup=False, highlight=False)
    if any(task["rounds"] for task in doc["tasks"]):
        out.print(rounds_summary(store, job), markup=False, highlight=False)


@app.command()
def top(
    jobs: Annotated[list[int] | None, typer.Argument(
        metavar="JOB", help="Job ids to watch (default: the newest jobs).")] = None,
    db: DbOption = None,
    once: Annotated[bool, typer.Option("--once", help="Print the tables once and exit.")] = False,
    interval: WatchOption = 2.0,
    limit: Annotated[int, typer.Option(min=1, help="Without job ids: how many of the newest jobs.")] = 10,
) -> None:
    """Live tables of the farm, from its database alone, refreshed in place until Ctrl-C (away
    from a terminal: printed every INTERVAL seconds). Jobs: state, trials of the budget, trials/s
    in the last 60 s and since the job was claimed, best latency per task, ETA (trials left of the
    budget over the last 60 s's trials/s). Workers of the running (or given) jobs: trials and
    their statuses in the last 60 s, and how long ago each stored its newest trial."""
    from farm.top import run

    run(_open_store(db, must_exist=True), out, jobs or [], limit=limit, interval=interval, once=once)


@app.command()
def jobs(
    db: DbOption = None,
    limit: Annotated[int, typer.Option(min=1, help="How many of the newest jobs.")] = 20,
) -> None:
    """The newest jobs with their state and progress."""
    table = Table()
    for col in ("job", "status", "trials", "budget", "search", "created", "name"):
        table.add_column(col, no_wrap=col != "name")
    for job in _open_store(db, must_exist=True).jobs(limit):
        table.add_row(str(job["id"]), job["status"], str(job.get("trials", "")), str(job["trials_budget"]),
                      job["search"], str(job["created_at"])[:19], job["name"])
    out.print(table)


@app.command()
def trials(
    job: JobArg,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one trial each.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV with a header row.")] = False,
) -> None:
    """Every trial of a job: config, status, error, latency, what proposed it (random, explore, plan,
    grid), worker, device."""
    store = _open_store(db, must_exist=True)
    if store.job(job) is None:
        raise FarmError(f"no job {job} in this database")
    frame = store.trials(job_id=job)
    if as_json:
        frame.to_json(sys.stdout, orient="records", lines=True, date_format="iso")
        return
    for column in ("config", "latencies"):  # JSON in CSV cells and the table, not Python reprs
        frame[column] = frame[column].map(lambda v: json.dumps(v, sort_keys=True))
    if as_csv:
        frame.to_csv(sys.stdout, index=False)
    else:
        table = Table()
        for col in ("task", "config", "status", "latency µs", "origin", "worker", "device", "error"):
            table.add_column(col, overflow="fold")
        for row in frame.itertuples():
            latency = "" if row.latency != row.latency or row.latency is None else f"{row.latency * 1e6:.2f}"
            origin = row.origin if isinstance(row.origin, str) else ""
            table.add_row(str(row.task_id), row.config, row.status, latency, origin,
                          row.worker, row.device, (row.error or "")[:80])
        out.print(table)


@app.command()
def cancel(job: JobArg, db: DbOption = None) -> None:
    """Stop a queued or running job; its measured trials stay."""
    store = _open_store(db, must_exist=True)
    if store.job(job) is None:
        raise FarmError(f"no job {job} in this database")
    if store.cancel_job(job):
        out.print(f"job {job} cancelled")
    else:
        out.print(f"job {job} had already ended ({store.job_status(job)})")


@app.command()
def export(
    sources: Annotated[list[str], typer.Argument(help="A job id; with --merge, export files to merge.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="File (farm) or folder (metaschedule) to write.")],
    format: Annotated[str, typer.Option(help="farm: one farm.best/1 JSON file; metaschedule: a folder with "
                                        "database_workload.json and database_tuning_record.json.")] = "farm",
    merge: Annotated[bool, typer.Option("--merge", help="Merge export files, keeping the fastest record per "
                                        "(workload, target, device).")] = False,
    allow_stale: Annotated[bool, typer.Option(help="With --merge: accept records of older template versions.")]
    = False,
    db: DbOption = None,
) -> None:
    """Export a job's best config per task, or merge exports of several jobs or farms."""
    from farm.export import check_output, export_job, load, write
    from farm.export import merge as merge_documents

    check_output(output, format)
    if merge:
        records = merge_documents([load(path, allow_stale) for path in sources])["records"]
        write(records, output, format)
    else:
        if len(sources) != 1 or not sources[0].isdigit():
            raise FarmError("give one job id (or --merge and export files)")
        job = int(sources[0])
        store = _open_store(db, must_exist=True)
        if store.job(job) is None:
            raise FarmError(f"no job {job} in this database")
        records = export_job(store, job, output, format)
    out.print(f"wrote {len(records)} record(s) to {output} ({format})")


@app.command()
def build(
    kernel: KernelArg,
    target: TargetOpt = "llvm",
    best: Annotated[Path | None, typer.Option(help="An export (farm.best/1) holding the tuned config.")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="The shared library to write.")] = Path("kernel.so"),
    allow_stale: Annotated[bool, typer.Option(help="Apply a config tuned against an older template version.")]
    = False,
) -> None:
    """Compile a kernel with its tuned config into a library TVM's runtime loads (C++ or Python).

    The library's function `main` takes the inputs then the output, as TVM tensors."""
    import warnings

    from farm.apply import build as build_kernel

    wl = _one_workload(kernel)
    writable_file(output)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = build_kernel(wl, target, best, allow_stale=allow_stale)
    for w in caught:
        console.print(f"farm: warning: {w.message}")
    with replacing(output, suffix=".so") as tmp:  # the linker's own file: whole or not at all
        lib.export_library(str(tmp))
    out.print(f"wrote {output}: {wl}, inputs {wl.input_shapes()} -> output {wl.output_shape()} ({wl.dtype})")


@app.command()
def predict(
    kernel: KernelArg,
    target: TargetOpt = "llvm",
    top: Annotated[int, typer.Option(min=1, help="How many configs.")] = 5,
    measure: Annotated[bool, typer.Option("--measure", help="Also build and measure them on this machine.")]
    = False,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    log_dir: Annotated[Path | None, typer.Option(help="With --measure: keep the RPC logs here.")] = None,
) -> None:
    """The cost model's best configs for a shape, without tuning it (zero-shot), from the
    model trained on the shapes the farm tuned before with the same template and target kind."""
    from farm.core.targets import parse_target
    from farm.predict import predict as predict_configs
    from farm.predict import render

    wl = _one_workload(kernel)
    spec = parse_target(target)
    if log_dir is not None:
        writable_folder(log_dir)
    predictions = predict_configs(wl, spec, _open_store(db, must_exist=True), top=top, measure=measure,
                                  log_dir=log_dir)
    out.print(render(predictions, as_json), soft_wrap=True)


@app.command()
def report(
    jobs: Annotated[list[int], typer.Argument(help="Job ids; several jobs draw one line each, to compare.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The PNG to write.")] = Path("curve.png"),
    timeline: Annotated[bool, typer.Option("--timeline", help="Draw one job's timeline instead: a lane per "
                                           "device and per build slot, time on x, the devices' busy share.")]
    = False,
    db: DbOption = None,
) -> None:
    """Plot tuning curves (best latency against trials) and print the jobs' rounds; a model's job
    also draws its estimated model latency against trials and lists each kernel's calls, trials,
    best latency and share of the model. With --timeline, draw where one job's time went."""
    from farm.report import plot_timeline, plot_tuning_curves, rounds_summary, utilisation

    writable_file(output)
    store = _open_store(db, must_exist=True)
    if timeline:
        if len(jobs) != 1:
            raise FarmError("--timeline draws one job: give one job id")
        path = plot_timeline(store, jobs[0], output)
        out.print(utilisation(store, jobs[0]).summary(), markup=False, highlight=False)
    else:
        path = plot_tuning_curves(store, list(jobs), output)
        for job in jobs:
            doc = store.job(job)
            if doc is not None and doc["spec"].get("model"):
                print_breakdown(doc)
            out.print(f"job {job}")
            out.print(rounds_summary(store, job), markup=False, highlight=False)
    out.print(f"wrote {path}", markup=False)


db_app = typer.Typer(help="The farm's database: schema migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(cluster_app, name="cluster")  # farm cluster up|down|status: the one-machine cluster


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Create the schema, or migrate it to this farm's version (Alembic); safe to run again."""
    from db.engine import display_url, make_engine
    from db.migrate import current, head, upgrade

    make_engine(db).dispose()  # one clear error for an unreachable database
    before = current(db)
    upgrade(db)
    out.print(f"{display_url(db)}: schema at {head()} (was {before or 'empty'})")


app.command("tune-model", cls=_SearchHelpCommand)(tune_model)
app.command("build-model")(build_model)


def _open_store(db: str | None, must_exist: bool = False) -> ResultStore:
    """The store at `db` (None: the default URL, see db.engine.resolve_url); with `must_exist`
    (commands that only read), a SQLite file that does not exist is an error rather than a new
    empty database."""
    from db.engine import display_url, resolve_url
    from db.store import open_store

    url = resolve_url(db)
    if must_exist and url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:" \
            and not Path(url.database).exists():
        raise FarmError(f"no database at {display_url(url)}: give --db or FARM_DB "
                        "(run `farm tune` or `farm submit` first)")
    return open_store(db)


def _report_best(job: Job, export: Path | None) -> None:
    """Print the best config of each task of a finished `farm tune` job, and export them."""
    records = job.best()
    if not records:
        console.print(f"job {job.id}: no candidate ran correctly; see `farm trials {job.id}`")
        raise typer.Exit(1)
    for rec in records:
        out.print(f"best for {workload_label(rec['workload'], params=False)} on {rec['device']}: "
                  f"{rec['latency_us']:.2f} µs ({rec['gflops']:.1f} GFLOPS)", markup=False)
        out.print(f"  config {json.dumps(rec['config'], sort_keys=True)}", markup=False)
    for t in job.status()["tasks"]:
        by_status = ", ".join(f"{k} {v}" for k, v in sorted(t.get("counts", {}).items()))
        out.print(f"  trials: {by_status}")
    if export is not None:
        job.export(export)
        out.print(f"exported {len(records)} record(s) to {export}", markup=False)


def main() -> NoReturn:
    """Entry point: run the app, turning FarmError into one line on stderr and exit 2; then exit
    without the interpreter's teardown (`_leave`)."""
    _leave(_run())


def _run() -> int:
    """Run the app; its exit status (a user error: one line on stderr first). SIGTERM stops any
    command as Ctrl-C does (scheduler.cluster.stop_on_signals): `farm scheduler` gives its jobs
    back, `farm tune` cancels its job, each closing what it started. SIGUSR1 prints every thread's
    stack and goes on."""
    from scheduler.cluster import stop_on_signals

    stop_on_signals(program=True)
    # `kill -USR1 PID` prints every thread's stack on stderr: what a job that seems stuck waits for.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        # Outside standalone mode typer returns the status of a typer.Exit, its own Ctrl-C (130) included.
        status = app(standalone_mode=False)
    except FarmError as e:
        print(f"farm: error: {e}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("farm: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("farm: interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as e:  # usage errors: bad option, missing argument
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"farm: error: {message} (see farm --help)", file=sys.stderr)
        return 2
    if status == 130:
        print("farm: interrupted", file=sys.stderr)
    return status if isinstance(status, int) else 0


def _leave(status: int) -> NoReturn:
    """Exit with `status` as the interpreter does at the end, less its last step, the teardown of
    every module: after a `farm tune`, which has closed all it opened (its jobs' threads, Ray, the
    database), freeing TVM's, Ray's and XGBoost's modules object by object took 0.6-0.7 s that the
    user waited for (2 cores; TVM alone 0.2 s). What the interpreter does before that step stays:
    the threads' exit hooks and the join of every non-daemon thread (CPython's own
    `threading._shutdown`), then the `atexit` functions (logging's flush among them)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a closed pipe (`farm jobs | head`): nothing more can reach it
            pass
    os._exit(status)

