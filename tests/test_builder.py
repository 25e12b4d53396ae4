"""The build stage's slots: a hung or crashing compile costs only its own candidate."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from farm.core.measure import Status
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload
from tests.build_faults import CRASH, HANG, SLOW, SLOW_SECONDS, SPIN_SECONDS, faulty_build, paced_build, spinning_build
from workers import builder, compiler
from workers.builder import STRAGGLER_SAMPLES, ProcessPoolBuilder
from workers.compiler import BuildResult

TASK = Task(make_workload("matmul", {"M": 32, "N": 32, "K": 32}), parse_target("llvm"))


def test_hang_and_crash_are_recorded_and_the_rest_builds() -> None:
    indices = list(range(10))
    with ProcessPoolBuilder(workers=2, timeout=8, build=faulty_build) as builder:
        results = builder.build(TASK, indices)
        by_index = {r.config_index: r for r in results}
        assert [r.config_index for r in results] == indices  # one result per index, in order
        assert by_index[HANG].status is Status.TIMEOUT
        assert by_index[CRASH].status is Status.BUILD_ERROR and "crashed" in by_index[CRASH].error
        others = [r for i, r in by_index.items() if i not in (HANG, CRASH)]
        assert all(r.status in (None, Status.INVALID) for r in others), [r.error for r in others]
        assert any(r.ok and r.library for r in others)
        # The replaced processes serve later candidates.
        again = builder.build(TASK, [11, 12])
        assert all(r.status in (None, Status.INVALID) for r in again)


def test_timeout_counts_from_the_start_of_the_build_not_the_queue() -> None:
    """Twelve candidates queued behind one slot: waiting is not building, none times out."""
    with ProcessPoolBuilder(workers=1, timeout=6) as builder:
        builder.warm("llvm")
        results = builder.build(TASK, list(range(20, 32)))
    assert not [r for r in results if r.status is Status.TIMEOUT]


def test_results_arrive_as_each_candidate_is_built() -> None:
    with ProcessPoolBuilder(workers=2, timeout=20, build=faulty_build) as builder:
        futures = builder.start(TASK, [HANG, 0, 1])
        start = time.monotonic()
        done, _ = cf.wait(futures[1:], timeout=18)
        assert len(done) == 2 and time.monotonic() - start < 18  # not held back by the hung one
        assert futures[0].result(timeout=40).status is Status.TIMEOUT


def test_a_straggler_is_stopped_at_ten_times_its_tasks_median_build() -> None:
    """Until 16 candidates of a task have built, a slow one has the whole timeout; after them, a
    build past 10x their median, and past the floor, is stopped and recorded as a timeout."""
    with ProcessPoolBuilder(workers=2, timeout=30, build=paced_build, floor=2) as builder:
        assert builder.build(TASK, [SLOW])[0].ok  # SLOW_SECONDS < 30 s: no median yet
        assert all(r.ok for r in builder.build(TASK, list(range(20, 20 + STRAGGLER_SAMPLES))))
        limit, why = builder.deadline(json.dumps(TASK.to_json(), sort_keys=True))
        assert limit == 2 and "median build" in why  # 10x a few milliseconds is below the floor
        start = time.monotonic()
        late = builder.build(TASK, [SLOW])[0]
        assert late.status is Status.TIMEOUT and "median build" in late.error, late.error
        assert time.monotonic() - start < SLOW_SECONDS
        assert builder.build(TASK, [40])[0].ok  # its slot's new process builds the next one
        other = Task(make_workload("matmul", {"M": 16, "N": 16, "K": 16}), parse_target("llvm"))
        assert builder.deadline(json.dumps(other.to_json(), sort_keys=True))[0] == 30  # per task


CUDA_TASK = Task(make_workload("matmul", {"M": 64, "N": 64, "K": 64}), parse_target("cuda"))


def _valid_cuda_schedule() -> Any:
    for index in range(CUDA_TASK.space.size):
        config = CUDA_TASK.space.get(index)
        if not CUDA_TASK.check(config):
            return CUDA_TASK.schedule(config)
    raise AssertionError("no valid config")


def _count_nvcc(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sources nvcc is run on from here on."""
    sources: list[str] = []
    real = compiler._nvcc

    def counted(source: str, arch: str, stem: Path) -> Any:
        sources.append(source)
        return real(source, arch, stem)

    monkeypatch.setattr(compiler, "_nvcc", counted)
    return sources


def _compile_as_a_gpu_node(monkeypatch: pytest.MonkeyPatch, source_of: Any = None) -> None:
    """tvm.compile as it runs where TVM's CUDA runtime is loaded: it asks the global function
    tvm_callback_cuda_compile for the device code (this machine's TVM only emits the source)."""
    import tvm
    import tvm_ffi

    real = tvm.compile

    def compile_like_a_gpu_node(mod: Any, target: Any, tir_pipeline: str = "default") -> Any:
        lib = real(mod, target=target, tir_pipeline=tir_pipeline)
        source = compiler._cuda_source(lib)
        code = tvm_ffi.get_global_func("tvm_callback_cuda_compile")(source_of(source) if source_of else source, target)
        assert bytes(code)[:4] == b"\x7fELF"  # a cubin, which TVM's module then holds
        return lib

    monkeypatch.setattr(tvm, "compile", compile_like_a_gpu_node)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
def test_paused_builds_stop_and_their_time_limits_wait() -> None:
    """`paused` stops every build process (its state is T, stopped) and continues them after;
    a build stopped past its time limit is not a timeout: the pause does not count."""
    pause = 5.0  # past the time limit: without the pause left out, the build would time out stopped
    with ProcessPoolBuilder(workers=1, timeout=SPIN_SECONDS + 3, build=spinning_build) as builder:
        assert builder.build(TASK, [0])[0].ok  # the slot's process is up
        (pid,) = [proc.pid for proc in builder._procs.values()]
        (future,) = builder.start(TASK, [1])
        time.sleep(0.2)  # the build is computing
        with builder.paused():
            time.sleep(0.2)
            assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T"
            time.sleep(pause - 0.2)
        result = future.result(timeout=30)
        assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "T"
    assert result.ok, result.error
    assert result.info["wall_seconds"] >= SPIN_SECONDS + pause - 0.2  # it was stopped for the pause


def test_device_code_is_compiled_once_where_tvm_compiles_it_and_where_it_does_not(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sch = _valid_cuda_schedule()
    sources = _count_nvcc(monkeypatch)
    cpu_node = BuildResult(0, {})
    compiler.compile_into(sch.mod, CUDA_TASK.target, tmp_path / "cpu", cpu_node)
    # A CPU-only build node: nvcc on the module's source, the cubin shipped beside the library.
    assert cpu_node.ok and len(sources) == 1 and Path(cpu_node.cubin).exists()
    assert cpu_node.info["registers"] > 0

    _compile_as_a_gpu_node(monkeypatch)
    gpu_node = BuildResult(0, {})
    compiler.compile_into(sch.mod, CUDA_TASK.target, tmp_path / "gpu", gpu_node)
    # A GPU node: TVM's request was answered by nvcc, and that run's report is the one checked.
    assert gpu_node.ok and len(sources) == 2 and gpu_node.cubin == "" and Path(gpu_node.library).exists()
    assert gpu_node.info == cpu_node.info and gpu_node.source_sha == cpu_node.source_sha


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
def test_source_nvcc_refuses_inside_tvms_compile_is_the_candidates_build_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _compile_as_a_gpu_node(monkeypatch, source_of=lambda source: source + "\nthis is not C++;\n")
    result = BuildResult(0, {})
    compiler.compile_into(_valid_cuda_schedule().mod, CUDA_TASK.target, tmp_path / "c", result)
    assert result.status == Status.BUILD_ERROR and result.error.startswith("nvcc: ")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
def test_farm_build_compiles_the_device_code_as_the_measured_candidate(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On a GPU node `farm.build` gets its device code from the builder's nvcc run, on the same
    source as the candidate's build: the kernel a user builds from an export is the code the
    farm measured, not TVM's own compile of it (NVRTC, fast math)."""
    from farm.apply import build

    sources = _count_nvcc(monkeypatch)
    _compile_as_a_gpu_node(monkeypatch)
    measured = BuildResult(0, {})
    compiler.compile_into(CUDA_TASK.schedule(CUDA_TASK.default_config()).mod, CUDA_TASK.target, tmp_path / "c",
                          measured)
    with pytest.warns(UserWarning, match="building with the default config"):
        build(CUDA_TASK.workload, CUDA_TASK.target)
    assert measured.ok and len(sources) == 2 and sources[0] == sources[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
@pytest.mark.parametrize("kind", ["llvm", "cuda"])
def test_a_tasks_baseline_is_the_schedule_a_models_build_gives_an_untuned_kernel(kind: str, tmp_path: Path) -> None:
    """The baseline config builds TVM's own schedule of the kernel: DLight's on cuda (threads bound,
    as Relax's GPU build schedules a kernel it has no record of), the function as written on llvm;
    MetaSchedule replays its record's trace on the workload, as a model's build applies it."""
    from farm.export import metaschedule_schedule

    task = Task(make_workload("matmul", {"M": 64, "N": 64, "K": 64}), parse_target(kind))
    result = builder.build_one(json.dumps(task.to_json(), sort_keys=True), task.baseline_index, str(tmp_path))
    assert result.status is None and result.library and result.config == {"schedule": "tvm-default"}, result.error
    sch = task.schedule(task.config(task.baseline_index))
    assert ("threadIdx.x" in sch.mod.script()) == (kind == "cuda")
    rec = {"workload": task.workload.to_json(), "target": task.target.to_json(), "template": task.template.name,
           "config": result.config, "latency_us": 1.0}
    assert str(metaschedule_schedule(rec)[2].trace) == str(sch.trace)  # FarmError where it would not replay


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
def test_warm_build_builds_a_small_kernel_of_each_kind() -> None:
    for kind in ("llvm", "cuda"):
        result = builder.warm_build(kind)
        assert result.ok, (kind, result.error)


_SLOT_STATE = """
import json, sys
from tests.build_faults import warm_build_state
from tests.test_builder import TASK
from workers.builder import ProcessPoolBuilder
with ProcessPoolBuilder(workers=1, build=warm_build_state) as b:
    b.warm(sys.argv[1])
    print(json.dumps(b.build(TASK, [0])[0].info))
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
@pytest.mark.parametrize(("kind", "warm_build"), [("cuda", "ok"), ("llvm", None)])
def test_a_cuda_builders_slots_fork_from_a_server_that_built_a_cuda_kernel(kind: str, warm_build: str | None) -> None:
    """A process's first cuda build costs seconds when 32 start at once (workers/build_preload_cuda):
    a cuda builder's fork server builds one first, so its slots start past it; an llvm builder's
    does not. Each builder in a fresh process, as each process has one fork server."""
    proc = subprocess.run([sys.executable, "-c", _SLOT_STATE, kind], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"warm_build": warm_build}


def test_farm_build_warns_where_its_cuda_code_cannot_be_the_measured_one() -> None:
    """Without TVM's CUDA runtime (no GPU here) the library holds source that TVM compiles where
    it is loaded: the user is told that this may not be the kernel the export's latency is of."""
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present: TVM's runtime asks for the device code here")
    with pytest.warns(UserWarning, match="not by the nvcc -O3 run the farm measured"):
        compiler.compile_module(_valid_cuda_schedule().mod, CUDA_TASK.target)
