"""Schedule templates: llvm kernels compute the NumPy reference; cuda schedules compile and pass
TVM's GPU-code verification; `check` and `verify_gpu` reject what cannot run; the reference
schedules (the depthwise blog's v4, d2ltvm's pooling) are points of the spaces.

Runs without a GPU: cuda targets are compiled to CUDA source and verified, not run.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tvm

from farm.core.space import Config
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.templates import TEMPLATES, Template, arch_specific_hint, get_template
from farm.core.templates.base import (
    compile_scheduled,
    cooperative_fetch,
    new_schedule,
    pipeline_loop,
    tir_pipeline,
)
from farm.core.templates.verify import verify_gpu
from farm.core.workloads import PRESETS, Workload, make_workload

LLVM = parse_target("llvm")
CUDA = parse_target("cuda")
HOPPER = parse_target({"kind": "cuda", "arch": "sm_90a"})  # sm_90's arch-specific variant: wgmma
# A small GPU, so that every cuda template has configs with too many threads for it, and every
# one that stages data in shared memory, configs with too much (a Hopper's arch, so that every
# cuda template applies to it).
SMALL_GPU = parse_target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 128,
                          "max_shared_memory_per_block": 2048})

LLVM_CASES = {
    "conv2d": ("conv2d_nchw", dict(N=1, CI=8, H=10, W=10, CO=16, KH=3, KW=3, pad=1)),
    "conv2d-stride2": ("conv2d_nchw", dict(N=2, CI=4, H=11, W=9, CO=6, KH=3, KW=3, stride=2, pad=1)),
    "conv2d-dilation2": ("conv2d_nchw", dict(N=1, CI=4, H=12, W=12, CO=8, KH=3, KW=3, pad=2, dilation=2)),
    "conv2d-fp16": ("conv2d_nchw", dict(N=1, CI=8, H=10, W=10, CO=16, KH=3, KW=3, pad=1, dtype="float16")),
    "depthwise-mult2-stride2": (
        "depthwise_conv2d_nchw", dict(N=1, C=4, H=9, W=10, KH=3, KW=3, stride=2, pad=1, multiplier=2)
    ),
    "group-conv": ("group_conv2d_nchw", dict(N=1, CI=8, H=8, W=8, CO=12, KH=3, KW=3, groups=4, pad=1)),
    "maxpool": ("pool2d", dict(N=1, C=3, H=9, W=11, KH=3, KW=3, stride=2, pad=1, kind="max")),
    "avgpool": ("pool2d", dict(N=2, C=3, H=9, W=11, KH=3, KW=3, stride=2, pad=1, kind="avg")),
    "avgpool-fp16": ("pool2d", dict(N=1, C=4, H=10, W=10, KH=2, KW=2, stride=2, kind="avg", dtype="float16")),
    "matmul": ("matmul", dict(M=33, N=17, K=20)),
    "matmul-fp16": ("matmul", dict(M=33, N=17, K=20, dtype="float16")),
    "batch-matmul": ("batch_matmul", dict(B=3, M=17, N=12, K=20)),
}

CUDA_CASES = {
    **{preset: (preset, {}) for preset in PRESETS},
    "matmul-1024": ("matmul", dict(M=1024, N=1024, K=1024)),
    "attention-scores": ("batch_matmul", dict(B=12, M=128, N=128, K=64)),
    # Shapes the presets miss: stride, multiplier, sizes that no thread count divides.
    "depthwise-mult2-stride2": (
        "depthwise_conv2d_nchw", dict(N=2, C=8, H=15, W=17, KH=3, KW=3, stride=2, pad=1, multiplier=2)
    ),
    "avgpool-odd": ("pool2d", dict(N=2, C=3, H=15, W=17, KH=3, KW=3, stride=2, pad=1, kind="avg")),
    # float16 accumulates in float32 registers, whether or not the output is cached (cache_output).
    "depthwise-fp16-stride2": (
        "depthwise_conv2d_nchw", dict(N=2, C=8, H=15, W=17, KH=3, KW=3, stride=2, pad=1, dtype="float16")
    ),
    "matmul-fp16-tensorcore": ("matmul", dict(M=256, N=128, K=64, dtype="float16")),
    # The same workload on sm_90a: Hopper's wgmma, eight tiles of the reduction for its pipeline.
    "matmul-fp16-wgmma": ("matmul", dict(M=512, N=256, K=512, dtype="float16"), HOPPER),
    # A convolution on wgmma: K = 64 x 9; 2 x 7 x 7 = 98 pixels, so the last tile of columns is partial.
    "conv2d-fp16-wgmma": (
        "conv2d_nchw", dict(N=2, CI=64, H=7, W=7, CO=64, KH=3, KW=3, pad=1, dtype="float16"), HOPPER
    ),
    "conv2d-fp16-tensorcore": ("conv2d_nchw", dict(N=2, CI=16, H=8, W=8, CO=32, KH=3, KW=3, pad=1, dtype="float16")),
    "conv2d-fp16-tensorcore-stride2": (
        "conv2d_nchw", dict(N=4, CI=32, H=16, W=16, CO=16, KH=3, KW=3, stride=2, pad=1, dtype="float16")
    ),
    "conv2d-fp16-tensorcore-1x1": (
        "conv2d_nchw", dict(N=2, CI=32, H=12, W=12, CO=32, KH=1, KW=1, dtype="float16")
    ),
    "group-conv-fp16-tensorcore": (
        "group_conv2d_nchw", dict(N=2, CI=64, H=8, W=8, CO=64, KH=3, KW=3, groups=2, pad=1, dtype="float16")
    ),
}


def _workload(case: tuple[Any, ...]) -> Workload:
    """A case's workload: (name, params) or (name, params, target)."""
    return make_workload(case[0], case[1])


def _target(case: tuple[Any, ...]) -> TargetSpec:
    """A case's target: its third element, else the default cuda target."""
    return case[2] if len(case) > 2 else CUDA


def valid_configs(template: Template, wl: Workload, target: TargetSpec, count: int) -> list[Config]:
    """`count` distinct random configs that pass `check`, the same ones on every run."""
    space = template.space(wl, target)
    rng = random.Random(f"{template.name}/{wl.key}")
    found: dict[int, Config] = {}
    for _ in range(100_000):
        config = space.get(rng.randrange(space.size))
        if template.check(wl, target, config) is None:
            found[config.index] = config
            if len(found) == min(count, space.size):
                return list(found.values())
    raise AssertionError(f"only {len(found)} valid configs of {template.name} for {wl} in 100000 draws")


def rejected_config(template: Template, wl: Workload, target: TargetSpec, reason: str) -> Config:
    """A random config that `check` rejects with a message containing `reason`, without
    unrolling (so lowering the huge tiles such configs have stays fast) and without split-K
    (whose slices must divide the outer reduction steps for the schedule to exist)."""
    space = template.space(wl, target)
    rng = random.Random(f"{template.name}/{wl.key}/{reason}")
    for _ in range(100_000):
        config = space.get(rng.randrange(space.size))
        why = template.check(wl, target, config)
        if why is not None and reason in why:
            plain = {k: v for k, v in {"auto_unroll_max_step": 0, "split_k": 1}.items() if k in config.to_json()}
            return space.from_json({**config.to_json(), **plain})
    raise AssertionError(f"no config of {template.name} for {wl} is rejected for {reason!r}")


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64))


@pytest.mark.parametrize("case", LLVM_CASES.values(), ids=LLVM_CASES.keys())
def test_llvm_template_computes_the_reference(case: tuple[str, dict[str, Any]]) -> None:
    wl = _workload(case)
    template = get_template(wl, "llvm")
    inputs = wl.random_inputs(seed=1)
    ref = wl.reference(inputs)
    dev = tvm.cpu(0)
    for config in valid_configs(template, wl, LLVM, count=6):
        lib = tvm.compile(template.schedule(wl, LLVM, config).mod, target=LLVM.tvm())
        # NaN in the output buffer: an element the kernel never writes fails the comparison.
        out = tvm.runtime.tensor(np.full(wl.output_shape(), np.nan, dtype=wl.dtype), dev)
        lib["main"](*[tvm.runtime.tensor(x, dev) for x in inputs], out)
        err = relative_error(out.numpy(), ref)
        assert err <= wl.tolerance(), f"{wl} {config.dumps()}: relative error {err:.2e}"


@pytest.mark.parametrize("case", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_cuda_template_compiles_and_passes_gpu_verification(case: tuple[Any, ...]) -> None:
    wl, target = _workload(case), _target(case)
    template = get_template(wl, target)
    for config in valid_configs(template, wl, target, count=10):
        mod = template.schedule(wl, target, config).mod
        reason = verify_gpu(mod, target)
        assert reason is None, f"{wl} {config.dumps()}: {reason}"
        source = _cuda_source(mod, target)
        assert "__global__" in source, f"{wl} {config.dumps()}: no CUDA kernel in the compiled module"


def _exported(lib: Any, tmp_path: Path) -> bytes:
    """The bytes of `lib` exported as a shared library (the device module with its launch tags)."""
    path = tmp_path / "exported.so"
    lib.export_library(str(path))
    return path.read_bytes()


def _cuda_templates() -> list[tuple[Template, Workload]]:
    """Each hand-written cuda template with the first case it schedules (the design-space template's
    checks are MetaSchedule's postprocessors: tests/test_tir_workloads.py)."""
    out = []
    for template in (t for t in TEMPLATES if t.kind == "cuda" and "tir" not in t.workloads):
        wl = next(_workload(c) for c in CUDA_CASES.values() if get_template(_workload(c), _target(c)) is template)
        out.append((template, wl))
    return out


@pytest.mark.parametrize(("template", "wl"), _cuda_templates(), ids=lambda x: getattr(x, "name", ""))
def test_check_rejects_too_many_threads_and_verify_agrees(template: Template, wl: Workload) -> None:
    config = rejected_config(template, wl, SMALL_GPU, "threads per block")
    reason = verify_gpu(template.schedule(wl, SMALL_GPU, config).mod, SMALL_GPU)
    assert reason is not None and "threads" in reason, reason


@pytest.mark.parametrize(
    ("template", "wl"),
    [(t, w) for t, w in _cuda_templates() if t.name != "cuda.pool"],  # pooling uses no shared memory
    ids=lambda x: getattr(x, "name", ""),
)
def test_verify_gpu_rejects_too_much_shared_memory(template: Template, wl: Workload) -> None:
    config = rejected_config(template, wl, SMALL_GPU, "shared memory")
    reason = verify_gpu(template.schedule(wl, SMALL_GPU, config).mod, SMALL_GPU)
    assert reason is not None and "shared memory" in reason, reason


def test_verify_gpu_rejects_a_grid_too_tall() -> None:
    # One row of outputs per block on blockIdx.y: 70000 rows > CUDA's 65535 blocks.
    wl = make_workload("depthwise_conv2d_nchw", dict(N=1, C=1, H=70000, W=1, KH=1, KW=1))
    template = get_template(wl, "cuda")
    config = template.space(wl, CUDA).from_json(dict(
        tile_y=[70000, 1, 1], tile_x=[1, 1, 1], fuse_blocks=1, tile_ry=[1, 1], tile_rx=[1, 1],
        reduce_inside=1, cache_input=0, cache_output=0, auto_unroll_max_step=0, unroll_explicit=0,
    ))
    assert "blockIdx.y" in (template.check(wl, CUDA, config) or "")
    assert "blockIdx.y" in (verify_gpu(template.schedule(wl, CUDA, config).mod, CUDA) or "")


def test_resnet_last_conv_space_is_autotvm_tutorial_size() -> None:
    """The tutorial's space is the slice without split-K (split_k=1) fetched its way (fetch=0)."""
    wl = make_workload("resnet-last-conv")
    space = get_template(wl, "cuda").space(wl, CUDA)
    extra = len(space.knob("split_k")) * len(space.knob("fetch"))
    assert space.knob("split_k").values[0] == 1 and space.knob("fetch").values[0] == 0
    assert space.size == 10_454_400 * extra


@pytest.mark.parametrize(("case", "split_k", "fetch", "pipeline"), [
    ("resnet-last-conv", 8, 0, 0), ("resnet-last-conv", 64, 1, 0), ("matmul-1024", 16, 4, 0),
    ("matmul-1024", 2, 2, 1), ("matmul-1024", 1, 4, 2), ("matmul-1024", 4, 1, 2), ("matmul-1024", 1, 4, 4),
    ("spio-grouped", 2, 1, 0),
])
def test_cuda_tiled_split_k_vector_loads_and_pipelining_compile_to_what_they_say(
        case: str, split_k: int, fetch: int, pipeline: int) -> None:
    """Split-K adds a second kernel that sums the slices' partials (grid z = slices x z blocks);
    vector fetches load float2/float4; pipelining from 2 buffers on copies with cp.async; each
    passes GPU verification (which lowers the pipeline, its shared buffers multiplied)."""
    wl = _workload(CUDA_CASES[case])
    template = get_template(wl, "cuda")
    space, rng = template.space(wl, CUDA), random.Random(case)
    knobs = {"split_k": split_k, "fetch": fetch, "pipeline": pipeline}
    config = next(c for _ in range(100_000)
                  if template.check(wl, CUDA, c := space.from_json(
                      {**space.get(rng.randrange(space.size)).to_json(), **knobs})) is None)
    mod = template.schedule(wl, CUDA, config).mod
    assert verify_gpu(mod, CUDA) is None
    source = _cuda_source(mod)
    assert source.count("__global__") == (2 if split_k > 1 else 1) * 2  # declared, then defined
    copies = _async_copies(source)
    if pipeline >= 2:  # both tiles' copies asynchronous, no plain load of them left
        assert {"A_shared", "B_shared"} <= set(copies)
        assert not re.search(r"[(\[]\s*[AB]_ptr\s*[+\[]|[AB]_ptr\[", source), "a synchronous load of A or B"
    else:
        assert not copies
        if fetch > 1:
            assert f"*(float{fetch}*)(A_ptr" in source and f"*(float{fetch}*)(B_ptr" in source


def test_async_pipelines_copy_a_k_major_tile_element_by_element_and_never_stride() -> None:
    """Asynchronous copies of A's k-major tile go element by element (4-byte cp.async), since a
    vector read along k lands down a column; fetch 0 (a thread's contiguous run) cannot pipeline
    asynchronously. A hand-made schedule with the strided vector copy is rejected by
    verify_gpu: TVM's cp.async injection would copy it contiguously."""
    wl = make_workload("matmul", dict(M=256, N=128, K=64))
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    knobs = dict(tile_i=[2, 1, 16, 8], tile_j=[2, 1, 8, 8], tile_k=[8, 8, 1], auto_unroll_max_step=1500,
                 unroll_explicit=1, split_k=1, fetch=4, pipeline=3, a_kmajor=1)
    config = space.from_json(knobs)
    assert template.check(wl, CUDA, config) is None
    mod = template.schedule(wl, CUDA, config).mod
    assert verify_gpu(mod, CUDA) is None
    copies = _async_copies(_cuda_source(mod))
    assert copies["A_shared"] == {4} and copies["B_shared"] == {16}
    assert "coalesced fetching" in template.check(wl, CUDA, space.from_json({**knobs, "fetch": 0}))

    def transposed_tile(vector: int) -> Any:
        sch = new_schedule(wl)
        block = sch.get_sblock("compute")
        i, j, k = sch.get_loops(block)
        (bi, ti), (bj, tj), (ko, ki) = sch.split(i, [None, 16]), sch.split(j, [None, 16]), sch.split(k, [None, 16])
        sch.reorder(bi, bj, ko, ti, tj, ki)
        for loop, tag in ((bi, "blockIdx.y"), (bj, "blockIdx.x"), (ti, "threadIdx.y"), (tj, "threadIdx.x")):
            sch.bind(loop, tag)
        for index in (0, 1):
            shared = sch.cache_read(block, index, "shared")
            sch.compute_at(shared, ko)
            if index == 0:
                sch.transform_layout(shared, ("write", 0), lambda row, kk: (kk, row))
            cooperative_fetch(sch, shared, [16, 16], ["y", "x"], threads_outer=False,
                              vector=vector if index == 0 else 4)
        pipeline_loop(sch, ko, 2)
        return sch.mod

    assert "stride" in (verify_gpu(transposed_tile(4), CUDA) or "")
    assert verify_gpu(transposed_tile(1), CUDA) is None


def _cuda_source(mod: Any, target: TargetSpec = CUDA) -> str:
    """The CUDA source the farm compiles the scheduled `mod` to (`compile_scheduled`)."""
    return compile_scheduled(mod, target).mod.imports[0].inspect_source("")


def _async_copies(source: str) -> dict[str, set[int]]:
    """Shared buffer -> the byte sizes of the cp.async copies into it, in CUDA `source` (TVM's
    ptx_cp_async helpers take the buffer first and are named by their sizes)."""
    copies: dict[str, set[int]] = {}
    for size, buffer in re.findall(r"ptx_cp_async\w*?_c[ag]_(\d+)\w*\((\w+?)(?:_ptr)?,", source):
        copies.setdefault(buffer, set()).add(int(size))
    return copies


def test_cuda_tiled_a_kmajor_transposes_a_in_shared_memory_and_zeroes_once() -> None:
    """`a_kmajor` stores A's shared tile k-major, so that an 8x8 register tile refilled one k at a
    time reads its 8 rows of A from consecutive addresses (which nvcc merges into LDS.128), its
    rows padded to a stride of 4 over a multiple of 32 floats (the copies down its columns then
    spread over the banks); the accumulators are zeroed before the reduction loop, not inside it."""
    wl = make_workload("matmul", dict(M=256, N=128, K=64))
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    assert space.knob("a_kmajor").values == [0, 1]
    knobs = dict(tile_i=[2, 1, 16, 8], tile_j=[2, 1, 8, 8], tile_k=[8, 8, 1], auto_unroll_max_step=1500,
                 unroll_explicit=1, split_k=1, fetch=4, pipeline=0)
    shapes = {}
    for kmajor in (0, 1):
        config = space.from_json({**knobs, "a_kmajor": kmajor})
        assert template.check(wl, CUDA, config) is None
        sch = template.schedule(wl, CUDA, config)
        shapes[kmajor] = tuple(int(x) for x in sch.get(sch.get_sblock("A_shared")).writes[0].source.shape)
        assert verify_gpu(sch.mod, CUDA) is None
        source = _cuda_source(sch.mod)
        loop = source.index("for (int k_0")
        assert "compute_local_ptr[63] = 0x0p+0f" in source[:loop] and "0x0p+0f" not in source[loop:]
    assert shapes == {0: (256, 64), 1: (64, 256)}
    # A block's 8 k of its 128 rows, each row of the tile 132 floats apart: 1,056 floats.
    assert "float A_shared_ptr[1056];" in source and "A_shared_ptr[v_.x]" in source
    # The 8 rows of A one thread reads at one k: consecutive in the k-major tile.
    rows = [f"A_shared_ptr[((((int)threadIdx.y) * 8) + {r})]" for r in range(1, 8)]
    assert all(row in source for row in rows)
    # Old exports, made before the knob, still name their configs: a_kmajor defaults to 0.
    assert space.index({**knobs}) == space.index({**knobs, "a_kmajor": 0})


def test_cuda_tiled_refuses_what_could_not_run() -> None:
    wl = make_workload("matmul", dict(M=64, N=66, K=64))
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    config = space.from_json(dict(tile_i=[4, 1, 16, 1], tile_j=[1, 3, 22, 1], tile_k=[4, 4, 4],
                                  auto_unroll_max_step=0, unroll_explicit=0, split_k=1, fetch=4, pipeline=0))
    assert "N (66) to be a multiple of 4" in (template.check(wl, CUDA, config) or "")
    config = space.from_json({**config.to_json(), "split_k": 8})
    assert "split_k=8 does not divide the 4 outer steps of k" in (template.check(wl, CUDA, config) or "")
    config = space.from_json({**config.to_json(), "split_k": 4, "fetch": 1, "pipeline": 1})
    assert "2 pipeline buffers need as many outer steps of the reduction, not 1" in (
        template.check(wl, CUDA, config) or "")
    turing = parse_target({"kind": "cuda", "arch": "sm_75"})
    config = space.from_json({**config.to_json(), "split_k": 1, "pipeline": 2})
    assert template.check(wl, CUDA, config) is None
    assert "asynchronous copies need sm_80 or later, not sm_75" in (template.check(wl, turing, config) or "")
    config = space.from_json({**config.to_json(), "pipeline": 3, "auto_unroll_max_step": 512})
    assert "3 or more pipeline buffers need explicit unrolling" in (template.check(wl, CUDA, config) or "")
    config = space.from_json({**config.to_json(), "unroll_explicit": 1})
    assert template.check(wl, CUDA, config) is None
    _cuda_source(template.schedule(wl, CUDA, config).mod)


@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
@pytest.mark.parametrize("name, params", [
    ("conv2d_nchw", dict(N=8, CI=64, H=28, W=28, CO=128, KH=3, KW=3, pad=1, stride=2)),
    ("group_conv2d_nchw", dict(N=1, CI=64, H=14, W=14, CO=96, KH=3, KW=3, pad=1, groups=4)),
    ("matmul", dict(M=96, N=40, K=72)), ("matmul", dict(M=1024, N=1024, K=1024)),
    ("batch_matmul", dict(B=12, M=128, N=64, K=128))])
def test_cuda_tiled_prechecks_a_batch_of_codes_exactly_as_it_checks_each(name: str, params: dict[str, Any],
                                                                          arch: str) -> None:
    """The search's annealing prechecks thousands of moves a step in one call
    (Template.precheck_columns on the featurizer's codes): the same verdict as `check`, config by
    config, valid ones and each reason to refuse among them."""
    from farm.core.features import featurizer

    task = Task(make_workload(name, params), parse_target({"kind": "cuda", "arch": arch}), "cuda.tiled")
    indices = np.random.default_rng(0).integers(0, task.space.size, 3000)
    passes = task.precheck_codes(featurizer(task).codes(indices))
    assert passes is not None
    verdicts = [task.check(task.space.get(int(i))) for i in indices]
    assert passes.tolist() == [v is None for v in verdicts]
    assert 0 < passes.sum() < len(indices)


@pytest.mark.parametrize("preset", [*PRESETS, "matmul-1024"])
def test_llvm_spaces_are_thousands_to_hundreds_of_thousands(preset: str) -> None:
    wl = _workload(CUDA_CASES[preset])
    assert 1_000 <= get_template(wl, "llvm").space(wl, LLVM).size <= 500_000


def test_every_workload_has_a_template_per_kind() -> None:
    """Tensor cores for float16 matmul whose sizes are multiples of 16; CUDA cores otherwise."""
    from farm.core.workloads import WORKLOADS

    cases = [_workload(case) for case in LLVM_CASES.values()]
    assert {wl.name for wl in cases} == set(WORKLOADS)
    for wl in cases:
        assert get_template(wl, "llvm").name == "llvm.tiled"
        assert get_template(wl, "cuda").name in {"cuda.tiled", "cuda.depthwise", "cuda.pool"}
    assert get_template(make_workload("matmul", dict(M=64, N=32, K=16, dtype="float16")), "cuda").name \
        == "cuda.tensorcore"
    assert get_template(make_workload("matmul", dict(M=64, N=32, K=16)), "cuda").name == "cuda.tiled"
    # conv2d as a matrix product: CO=32, N*OH*OW=2*8*8 and CI*KH*KW=16*3*3 are multiples of 16.
    conv = dict(N=2, CI=16, H=8, W=8, CO=32, KH=3, KW=3, pad=1, dtype="float16")
    assert get_template(make_workload("conv2d_nchw", conv), "cuda").name == "cuda.tensorcore"
    assert get_template(make_workload("conv2d_nchw", {**conv, "N": 1, "H": 7}), "cuda").name == "cuda.tiled"
    # A grouped conv per group: 32 output channels of a group; spio-grouped's 8 are too few.
    group = dict(N=2, CI=64, H=8, W=8, CO=64, KH=3, KW=3, groups=2, pad=1, dtype="float16")
    assert get_template(make_workload("group_conv2d_nchw", group), "cuda").name == "cuda.tensorcore"
    assert get_template(make_workload("spio-grouped"), "cuda").name == "cuda.tiled"
    assert get_template(make_workload("matmul", dict(M=64, N=32, K=24, dtype="float16")), "cuda").name \
        == "cuda.tiled"
    # Hopper's wgmma where the target is sm_90a and every size is a multiple of 64; WMMA otherwise.
    hopper = make_workload("matmul", dict(M=128, N=64, K=64, dtype="float16"))
    assert get_template(hopper, HOPPER).name == "cuda.wgmma"
    assert get_template(hopper, CUDA).name == "cuda.tensorcore"
    assert get_template(make_workload("matmul", dict(M=128, N=32, K=64, dtype="float16")), HOPPER).name \
        == "cuda.tensorcore"
    assert get_template(make_workload("matmul", dict(M=128, N=64, K=64)), HOPPER).name == "cuda.tiled"
    # A convolution on wgmma where CO and CI x KH x KW are multiples of 64, whatever its pixels
    # (2 x 7 x 7 = 98 here: too few for WMMA's 16-pixel fragments, so CUDA cores on sm_90).
    conv = dict(N=2, CI=64, H=7, W=7, CO=64, KH=3, KW=3, pad=1, dtype="float16")
    assert get_template(make_workload("conv2d_nchw", conv), HOPPER).name == "cuda.wgmma"
    assert get_template(make_workload("conv2d_nchw", conv), CUDA).name == "cuda.tiled"
    whole = {**conv, "H": 8, "W": 8}  # 128 pixels
    assert get_template(make_workload("conv2d_nchw", whole), CUDA).name == "cuda.tensorcore"
    assert get_template(make_workload("conv2d_nchw", {**whole, "CI": 16}), HOPPER).name == "cuda.tensorcore"
    assert get_template(make_workload("conv2d_nchw", {**whole, "CO": 48}), HOPPER).name == "cuda.tensorcore"


def test_a_hint_names_the_arch_specific_target_where_it_changes_the_template() -> None:
    """`farm tune` of a float16 matmul on plain cuda (sm_90, WMMA) says which target puts it on
    wgmma; nothing where the template would not change, or the target is sm_90a already, nor for
    a float16 convolution, which wgmma would take but was measured slower there (HINTED)."""
    fp16 = make_workload("matmul", dict(M=4096, N=4096, K=4096, dtype="float16"))
    hint = arch_specific_hint(fp16, CUDA) or ""
    assert "--target '{\"kind\": \"cuda\", \"arch\": \"sm_90a\"}'" in hint
    assert "cuda.wgmma instead of cuda.tensorcore" in hint
    assert parse_target(json.loads(hint.split("'")[1])) == HOPPER  # the hint's target is a valid one
    assert arch_specific_hint(make_workload("matmul", dict(M=4096, N=4096, K=4096)), CUDA) is None
    assert arch_specific_hint(fp16, HOPPER) is None and arch_specific_hint(fp16, "llvm") is None
    conv = make_workload("conv2d_nchw", dict(N=8, CI=256, H=14, W=14, CO=256, KH=3, KW=3, pad=1, dtype="float16"))
    assert get_template(conv, HOPPER).name == "cuda.wgmma" and arch_specific_hint(conv, CUDA) is None


def test_cuda_wgmma_persistent_blocks_and_clusters_need_a_producer_and_enough_tiles() -> None:
    """tiles_per_block > 1 (a block computing several tiles of C) and clusters only with the
    producer warpgroup, never more tiles per block than C has, and clusters only of whole block
    rows."""
    task = Task(make_workload("matmul", dict(M=256, N=256, K=256, dtype="float16")), HOPPER)
    base = dict(warpgroups=2, slices=1, block_n=128, stages=2, raster=1, producer=1, tiles_per_block=4, cluster=1)
    assert task.check(task.space.from_json(base)) is None  # 2 x 2 tiles of 128 x 128: one block
    assert "need producer=1" in (task.check(task.space.from_json({**base, "producer": 0})) or "")
    assert "> the 4 tiles of C" in (task.check(task.space.from_json({**base, "tiles_per_block": 8})) or "")
    pairs = {**base, "cluster": 2, "tiles_per_block": 2}  # 1 x 2 cluster tiles of 256 x 128: one cluster
    assert task.check(task.space.from_json(pairs)) is None
    assert "need producer=1" in (task.check(task.space.from_json({**pairs, "producer": 0, "tiles_per_block": 1}))
                                 or "")
    assert "clusters of 2 block rows do not divide the 1" in (
        task.check(task.space.from_json({**pairs, "slices": 2, "tiles_per_block": 1})) or "")


def test_cuda_wgmma_store_2_counts_its_staging_tiles_in_shared_memory() -> None:
    """With `store` 2 each consumer warpgroup stages 64 rows of C in shared memory beside the
    pipeline's stages: 4 stages of 128 x 256 tiles (192 KB) fit alone, not with 64 KB of staging;
    3 stages do. A convolution's C (NCHW) has no `store` but 0."""
    task = Task(make_workload("matmul", dict(M=4096, N=4096, K=4096, dtype="float16")), HOPPER)
    base = dict(warpgroups=2, slices=1, block_n=256, stages=4, raster=4, producer=1, tiles_per_block=4, cluster=1)
    assert task.check(task.space.from_json({**base, "store": 1})) is None
    assert "shared memory" in (task.check(task.space.from_json({**base, "store": 2})) or "")
    assert task.check(task.space.from_json({**base, "store": 2, "stages": 3})) is None
    conv = Task(make_workload("conv2d_nchw", dict(N=8, CI=256, H=14, W=14, CO=256, KH=3, KW=3, pad=1,
                                                  dtype="float16")), HOPPER)
    assert next(k for k in conv.space.knobs if k.name == "store").values == [0]


def test_cuda_wgmma_convolutions_gather_with_a_producer_and_no_cluster() -> None:
    """A convolution's B tiles are gathered by one or two producer warpgroups (never none),
    cluster=1, and one slice per warpgroup (ptxas serialises its wgmmas with two); its pixels need
    not fill the last tile of columns."""
    task = Task(make_workload("conv2d_nchw", dict(N=2, CI=64, H=7, W=7, CO=128, KH=3, KW=3, pad=1,
                                                  dtype="float16")), HOPPER)
    base = dict(warpgroups=1, slices=1, block_n=64, stages=4, raster=1, producer=1, tiles_per_block=2, cluster=1)
    assert task.check(task.space.from_json(base)) is None  # 2 x 2 tiles, the second column of 34 pixels
    assert list(task.space.knob("producer").values) == [1, 2]
    assert task.check(task.space.from_json({**base, "producer": 2, "warpgroups": 2})) is None  # 512 threads
    assert "cluster=1" in (task.check(task.space.from_json({**base, "cluster": 2})) or "")
    assert "slices=1" in (task.check(task.space.from_json({**base, "slices": 2})) or "")
    assert "> the 4 tiles of C" in (task.check(task.space.from_json({**base, "tiles_per_block": 8})) or "")
    # 512 threads get 128 registers each: 96 accumulators and the gathers' registers do not fit
    # (ptxas spilled them), 128 failed to assemble; 384 threads (168 each) fit 96, not 128.
    for warpgroups, producer, block_n in ((2, 2, 192), (2, 2, 256), (1, 2, 256), (2, 1, 256)):
        config = {**base, "warpgroups": warpgroups, "producer": producer, "block_n": block_n, "tiles_per_block": 1}
        assert "registers per thread" in (task.check(task.space.from_json(config)) or ""), config
    assert task.check(task.space.from_json({**base, "producer": 2, "block_n": 192, "tiles_per_block": 1})) is None


def test_cuda_wgmma_gathers_cover_every_element_of_a_tile() -> None:
    """Each producer thread's batches of loads cover its share of a B tile exactly, for every
    block_n and number of producer warpgroups: batches of a fixed 32 left a third of each share
    ungathered with two producer warpgroups and block_n 192 (wrong results on an H100)."""
    from farm.core.templates.cuda_wgmma import BLOCK_N, GATHER_BATCH, TILE_K, WARPGROUP, _gather_batches

    for producer in (1, 2):
        for block_n in BLOCK_N:
            batch, batches = _gather_batches(block_n, WARPGROUP * producer)
            assert batch * batches * WARPGROUP * producer == TILE_K * block_n, (producer, block_n)
            assert batch <= GATHER_BATCH and batch & (batch - 1) == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
@pytest.mark.parametrize(("warpgroups", "slices", "block_n", "tiles_per_block", "producer"),
                         [(1, 1, 64, 1, 1), (2, 1, 128, 1, 1), (1, 1, 256, 4, 1), (2, 1, 192, 2, 1),
                          (2, 1, 64, 1, 2), (1, 1, 128, 2, 2), (1, 1, 192, 1, 2)])
def test_cuda_wgmma_convolution_builds_as_the_farm_builds_it(tmp_path: Path, warpgroups: int, slices: int,
                                                              block_n: int, tiles_per_block: int,
                                                              producer: int) -> None:
    """The fp16 conv2d 8x256x14x14 3x3 on wgmma, built as every candidate is: no spills, wgmmas kept
    asynchronous, A by TMA and B gathered by all of the producer's threads into the 128-byte
    swizzle (the XOR of a chunk with its row), which each fences for the async proxy before
    arriving on a full barrier that expects them all, and the stores stopped at the last pixel.
    Every load of the input is unconditional, into the registers of a batch (a load under a
    branch waited for the store before it: the loads went to L2 one at a time)."""
    from workers import builder, compiler

    task = Task(make_workload("conv2d_nchw", dict(N=8, CI=256, H=14, W=14, CO=256, KH=3, KW=3, pad=1,
                                                  dtype="float16")), HOPPER)
    assert task.template.name == "cuda.wgmma"
    config = task.space.from_json(dict(warpgroups=warpgroups, slices=slices, block_n=block_n, stages=4, raster=1,
                                       producer=producer, tiles_per_block=tiles_per_block, cluster=1))
    assert task.check(config) is None
    result = builder.build_one(json.dumps(task.to_json()), config.index, str(tmp_path))
    assert result.ok, result.error
    assert result.info["spill_bytes"] == 0 and result.info["threads"] == 128 * (warpgroups + producer)
    source = tvm.compile(task.schedule(config).mod, target=HOPPER.tvm(), tir_pipeline="tirx").mod.imports[0] \
        .inspect_source("")
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.f16.f16" in source
    assert "cp.async.bulk.tensor.2d" in source and "multicast" not in source
    assert f"(uint){1 + 128 * producer})" in source  # the full barriers: thread 0's bytes, then the gatherers
    assert "fence_proxy_proxy_async_shared__cta" in source and " ^ " in source
    assert "< 1568" in str(task.schedule(config).mod)  # 8 x 14 x 14 pixels: the gathers and the stores stop there
    staged = re.findall(r"(\w+)\[\d+\] = X_ptr\[", source)
    # 64 x block_n elements per tile over the gatherers, in batches of at most 32 that divide them
    assert set(staged) == {"staged_ptr"}
    assert source.count("X_ptr[") == len(staged) == math.gcd(32, 64 * block_n // (128 * producer))
    ptxas = compiler._nvcc(source, HOPPER.arch, tmp_path / "again").stderr
    assert "0 bytes stack frame" in ptxas and "serialized" not in ptxas, ptxas


def test_blog_v4_depthwise_schedule_is_a_point_of_the_space() -> None:
    """make_dwsp_conv2d_gpu_scheduler_v4 of the blog post, ported literally to s_tir."""
    wl = make_workload("seed-depthwise")
    sch = new_schedule(wl)
    out = sch.get_sblock("compute")
    b, c, h, w, _, _ = sch.get_loops(out)
    bc = sch.fuse(b, c)
    h_outer, h_inner = sch.split(h, [None, 16])
    w_outer, w_inner = sch.split(w, [None, 16])
    sch.reorder(bc, h_outer, w_outer, h_inner, w_inner)
    hw_outer = sch.fuse(h_outer, w_outer)
    sch.bind(bc, "blockIdx.x")
    sch.bind(hw_outer, "blockIdx.y")
    sch.bind(h_inner, "threadIdx.y")
    sch.bind(w_inner, "threadIdx.x")
    sch.compute_inline(sch.get_sblock("pad"))

    template = get_template(wl, "cuda")
    v4 = template.space(wl, CUDA).from_json(dict(
        tile_y=[1, 16, 1], tile_x=[2, 16, 1], fuse_blocks=1, tile_ry=[7, 1], tile_rx=[7, 1],
        reduce_inside=1, cache_input=0, cache_output=0, auto_unroll_max_step=0, unroll_explicit=0,
    ))
    assert template.check(wl, CUDA, v4) is None
    tvm.ir.assert_structural_equal(template.schedule(wl, CUDA, v4).mod, sch.mod)


@pytest.mark.parametrize("preset", ["seed-maxpool", "seed-avgpool"])
def test_d2ltvm_pooling_schedule_is_a_point_of_the_space(preset: str) -> None:
    """schedule_max / schedule_avg of d2ltvm's GPU pooling chapter, ported to s_tir."""
    wl = make_workload(preset)
    sch = new_schedule(wl)
    sch.compute_inline(sch.get_sblock("pad"))
    out = sch.get_sblock("epilogue" if wl.p["kind"] == "avg" else "compute")
    fused = sch.fuse(*sch.get_loops(out)[:4])  # sch[Y].op.axis: the output's four axes
    bx, tx = sch.split(fused, [None, 1024])  # nt = the target's max_num_threads
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if wl.p["kind"] == "avg":
        pool_sum = sch.get_sblock("compute")
        sch.set_scope(pool_sum, 0, "local")  # implicit in TE, explicit in s_tir
        sch.compute_at(pool_sum, tx)

    template = get_template(wl, "cuda")
    knobs: dict[str, Any] = dict(threads=1024, per_thread=1, auto_unroll_max_step=0, unroll_explicit=0)
    if wl.p["kind"] == "max":
        knobs["cache_output"] = 0
    config = template.space(wl, CUDA).from_json(knobs)
    tvm.ir.assert_structural_equal(template.schedule(wl, CUDA, config).mod, sch.mod)


def test_float16_sums_accumulate_in_float32() -> None:
    """4096 ones added up in float16 stop at 2048 (2049 is not a float16); in float32 they reach
    4096, which float16 holds exactly: the kernel's output says which accumulator it used."""
    wl = make_workload("matmul", dict(M=2, N=3, K=4096, dtype="float16"))
    template = get_template(wl, "llvm")
    dev = tvm.cpu(0)
    ones = [np.ones(shape, dtype="float16") for shape in wl.input_shapes()]
    for config in valid_configs(template, wl, LLVM, count=3):
        lib = tvm.compile(template.schedule(wl, LLVM, config).mod, target=LLVM.tvm())
        out = tvm.runtime.tensor(np.zeros(wl.output_shape(), dtype=wl.dtype), dev)
        lib["main"](*[tvm.runtime.tensor(x, dev) for x in ones], out)
        assert (out.numpy() == 4096).all(), f"{config.dumps()}: {out.numpy()}"


@pytest.mark.parametrize("pipeline", [0, 1, 2, 4])
@pytest.mark.parametrize("store", [0, 1])
def test_cuda_tensorcore_compiles_to_wmma_with_float32_accumulators(pipeline: int, store: int) -> None:
    """Fragments loaded, multiplied and stored by WMMA on float32 accumulators, the float16 output
    written from shared memory; pipelines from 2 buffers on load with cp.async, waiting for all
    but the buffers - 2 newest groups of copies."""
    wl = _workload(CUDA_CASES["matmul-fp16-tensorcore"])
    template = get_template(wl, "cuda")
    config = template.space(wl, CUDA).from_json(dict(
        tile_i=[4, 2, 2], tile_j=[2, 2, 2], tile_k=[4, 1], vector=8, pad=8, pipeline=pipeline,
        auto_unroll_max_step=64, store=store))
    assert template.check(wl, CUDA, config) is None
    mod = template.schedule(wl, CUDA, config).mod
    assert verify_gpu(mod, CUDA) is None
    source = _cuda_source(mod)
    for call in ("load_matrix_sync", "mma_sync", "store_matrix_sync", "fill_fragment"):
        assert f"nvcuda::wmma::{call}" in source, call
    assert "wmma::accumulator, 16, 16, 16, float>" in source
    # Both tiles' 8-half vectors copied by 16-byte cp.async into the (merged) dynamic shared memory.
    assert _async_copies(source) == ({"buf_dyn_shmem": {16}} if pipeline >= 2 else {})
    if pipeline >= 2:
        assert f"cp.async.wait_group {pipeline - 2};" in source


@pytest.mark.parametrize("name, params", [
    ("conv2d_nchw", dict(N=2, CI=3, H=7, W=6, CO=5, KH=3, KW=3, pad=1)),
    ("conv2d_nchw", dict(N=1, CI=4, H=11, W=9, CO=6, KH=3, KW=2, stride=2, pad=1)),
    ("conv2d_nchw", dict(N=1, CI=2, H=12, W=12, CO=4, KH=3, KW=3, pad=2, dilation=2)),
    ("conv2d_nchw", dict(N=1, CI=4, H=5, W=5, CO=3, KH=1, KW=1)),
    ("group_conv2d_nchw", dict(N=2, CI=8, H=6, W=5, CO=6, KH=3, KW=3, groups=2, pad=1)),
    ("group_conv2d_nchw", dict(N=1, CI=8, H=9, W=9, CO=4, KH=3, KW=2, groups=4, stride=2, pad=1)),
], ids=["pad", "stride2", "dilation2", "1x1", "groups2", "groups4-stride2"])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "split-k"])
def test_conv_rewritten_as_a_matrix_product_computes_the_reference(name: str, params: dict[str, Any],
                                                                   sliced: bool) -> None:
    """The implicit GEMM of cuda.tensorcore (the kernel as W[f, k], the input's im2col view as
    X[k, pixel], the output as C[f, pixel], one such product per group of a grouped conv), left
    unscheduled and compiled for the CPU, computes the convolution: every index of the rewrite
    is checked here, where no GPU is needed. So does its split-K form: the product's reduction
    cut into 2 or 3 slices of partial products, added up by a second stage, and the scatter into
    the output made to iterate over C."""
    from farm.core.templates.cuda_tensorcore import _as_matmul, _split_k, _weights_as_matrix, gemm_extents, groups

    wl = make_workload(name, params)
    sch = new_schedule(wl, _weights_as_matrix(wl))
    block = sch.get_sblock("compute")
    _, scatter = _as_matmul(sch, block, wl)
    # A (read 0) is the kernel's W[f, k], B (read 1) the input's im2col X[k, pixel].
    assert [r.source.name for r in sch.get(block).reads] == ["kernel_flat_reindex", "pad_reindex"]
    extents = tuple(int(loop.extent) for loop in map(sch.get, sch.get_loops(block)))
    assert extents == ((groups(wl),) if groups(wl) > 1 else ()) + gemm_extents(wl)
    if sliced:
        split = 2 if extents[-1] % 2 == 0 else 3
        partial = _split_k(sch, block, split, scatter)
        *outputs, slices, k = (int(loop.extent) for loop in map(sch.get, sch.get_loops(partial)))
        assert (tuple(outputs), slices, k) == (extents[:-1], split, extents[-1] // split)
        assert [int(x) for x in sch.get(partial).writes[0].source.shape] == [split, *extents[:-1]]
    inputs = wl.random_inputs(seed=2)
    dev = tvm.cpu(0)
    out = tvm.runtime.tensor(np.full(wl.output_shape(), np.nan, dtype=wl.dtype), dev)
    tvm.compile(sch.mod, target=LLVM.tvm())["main"](*[tvm.runtime.tensor(x, dev) for x in inputs], out)
    assert relative_error(out.numpy(), wl.reference(inputs)) <= wl.tolerance()


@pytest.mark.parametrize("case", ["conv2d-fp16-tensorcore", "group-conv-fp16-tensorcore"])
def test_cuda_tensorcore_convolutions_gather_their_tiles_or_store_the_im2col_matrix(case: str) -> None:
    """`im2col` 0: no im2col buffer, the kernel's and the input's tiles are read from `kernel`
    and `data` straight into shared memory, and the output is written from the shared tile into
    `epilogue`. 1: a first kernel stores X[k, pixel] (one global buffer of K x N halves per
    group), which the product's kernel reads in aligned vectors, by 16-byte cp.async where it
    pipelines, and never `data` itself."""
    from farm.core.templates.cuda_tensorcore import gemm_extents, groups

    wl = _workload(CUDA_CASES[case])
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    # Whole reductions: split-K's partial sums are a global buffer too (tested below).
    configs = [space.from_json({**c.to_json(), "split_k": 1}) for c in valid_configs(template, wl, CUDA, count=3)]
    for config in configs + [space.from_json({**c.to_json(), "im2col": 1 - c["im2col"]}) for c in configs]:
        assert template.check(wl, CUDA, config) is None
        mod = template.schedule(wl, CUDA, config).mod
        func = mod["main"]
        script = func.script()
        assert "pad = T.sblock_alloc_buffer" not in script
        allocated = [(buf.scope(), [int(x) for x in buf.shape]) for buf in func.body.block.alloc_buffers]
        stored = [shape for scope, shape in allocated if scope == "global"]
        if not config["im2col"]:
            assert "reindex_reindex" not in script and not stored, allocated
            continue
        g = groups(wl)
        assert stored == [([g] if g > 1 else []) + list(gemm_extents(wl)[2:0:-1])], allocated
        source = _cuda_source(mod)
        product = source[source.rindex('extern "C" __global__'):]
        assert source.count('extern "C" __global__') == 4 and "data_ptr" not in product
        if config["pipeline"] >= 2 and config["vector"] >= 2:
            assert _async_copies(product) == {"buf_dyn_shmem": {2 * config["vector"]}}


@pytest.mark.parametrize("case", ["matmul-fp16-tensorcore", "conv2d-fp16-tensorcore", "group-conv-fp16-tensorcore"])
def test_cuda_tensorcore_split_k_sums_float32_slices_in_a_second_kernel(case: str) -> None:
    """`split_k` s > 1: the product's kernel writes s float32 slices of partial products, one
    global buffer [s, (groups,) M, N], and never the output; a second kernel adds the slices up
    and writes each output, cast to float16, in the workload's layout. Slices that do not divide
    the outer steps of k are refused."""
    from farm.core.templates.cuda_tensorcore import gemm_extents, groups

    wl = _workload(CUDA_CASES[case])
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    config = next(c for c in valid_configs(template, wl, CUDA, count=50) if c["split_k"] > 1 and not c["im2col"])
    split = config["split_k"]
    mod = template.schedule(wl, CUDA, config).mod
    assert verify_gpu(mod, CUDA) is None
    allocated = [(buf.scope(), buf.dtype, [int(x) for x in buf.shape]) for buf in mod["main"].body.block.alloc_buffers]
    extents = [groups(wl)] if groups(wl) > 1 else []
    partial_sums = ("global", "float32", [split, *extents, *gemm_extents(wl)[:2]])
    assert [a for a in allocated if a[0] == "global"] == [partial_sums]
    source = _cuda_source(mod)
    product, summed = re.split(r'extern "C" __global__', source)[-2:]  # the definitions follow the declarations
    assert "mma_sync" in product and "epilogue_ptr" not in product.split(")")[0]
    assert "mma_sync" not in summed and "epilogue_ptr[" in summed and "((half)" in summed
    whole = space.from_json({**config.to_json(), "tile_k": [1, gemm_extents(wl)[2] // 16]})  # one outer step
    assert f"split_k={split} does not divide the 1 outer steps" in (template.check(wl, CUDA, whole) or "")


def test_cuda_tensorcore_im2col_copies_8_half_vectors_of_the_stored_matrix() -> None:
    """With `im2col` 1 the product's kernel copies both tiles in 16-byte cp.async: W from the
    kernel, X from the stored im2col matrix."""
    wl = _workload(CUDA_CASES["conv2d-fp16-tensorcore"])
    template = get_template(wl, "cuda")
    knobs = dict(tile_i=[1, 1, 2], tile_j=[1, 2, 4], tile_k=[9, 1], vector=8, pad=8, pipeline=2,
                 auto_unroll_max_step=0, store=1)
    space = template.space(wl, CUDA)
    # Exports made before the knob name their configs without it: im2col defaults to 0, same index.
    assert space.index(knobs) == space.index({**knobs, "im2col": 0})
    config = space.from_json({**knobs, "im2col": 1})
    assert template.check(wl, CUDA, config) is None
    mod = template.schedule(wl, CUDA, config).mod
    assert verify_gpu(mod, CUDA) is None
    source = _cuda_source(mod)
    assert _async_copies(source[source.rindex('extern "C" __global__'):]) == {"buf_dyn_shmem": {16}}


@pytest.mark.parametrize("depth", [32, 64, 96, 128, 192, 256, 384])
def test_cuda_tensorcore_pipelined_convolutions_copy_the_kernel_in_vectors_at_every_depth(depth: int) -> None:
    """However deep the k-chunk, a pipelined conv2d copies W's tile in 16-byte cp.async straight
    from the kernel: read through its 4-D shape, the next step's tile became a gather of single
    halves for 5 of these 7 depths (`_weights_as_matrix`), and with 8-half vectors a kernel nvcc
    rejects."""
    wl = make_workload("conv2d_nchw", dict(N=8, CI=256, H=14, W=14, CO=256, KH=3, KW=3, pad=1, dtype="float16"))
    template = get_template(wl, "cuda")
    config = template.space(wl, CUDA).from_json(dict(
        tile_i=[4, 2, 2], tile_j=[98, 1, 1], tile_k=[2304 // depth, depth // 16], vector=8, pad=8, pipeline=2,
        auto_unroll_max_step=0, store=1, im2col=1))
    assert template.check(wl, CUDA, config) is None
    source = _cuda_source(template.schedule(wl, CUDA, config).mod)
    product = source[source.rindex('extern "C" __global__'):]
    assert "kernel_flat_ptr[" not in product  # no element-wise loads of W
    assert _async_copies(product) == {"buf_dyn_shmem": {16}}
    copies = re.findall(r"ptx_cp_async\w*_16\w*\(buf_dyn_shmem_ptr, [^;]*?, (\w+)_ptr,", product)
    assert set(copies) == {"kernel_flat", "pad_reindex"}


@pytest.mark.parametrize("case", ["matmul-fp16-tensorcore", "conv2d-fp16-tensorcore"])
def test_cuda_tensorcore_counts_the_staging_tvm_allocates(case: str) -> None:
    """`check` counts the float32 staging of the accumulators (static shared memory) and the
    input tiles (dynamic) as the kernel allocates them, for either way of storing the former."""
    from tvm.s_tir.analysis import calculate_allocated_bytes

    from farm.core.templates.cuda_tensorcore import _input_bytes, _staging_bytes
    from farm.core.templates.verify import lower

    wl = _workload(CUDA_CASES[case])
    template = get_template(wl, "cuda")
    configs = valid_configs(template, wl, CUDA, count=12)
    assert {config["store"] for config in configs} == {0, 1} and {config["pad"] for config in configs} == {0, 8}
    for config in configs:
        plain = template.space(wl, CUDA).from_json({**config.to_json(), "auto_unroll_max_step": 0})
        # With `im2col` 1 the product is the second kernel, after the one storing X.
        lowered = lower(template.schedule(wl, CUDA, plain).mod, CUDA)
        kernel = lowered["main_kernel_1" if plain["im2col"] else "main_kernel"]
        allocated = calculate_allocated_bytes(kernel)["main"]
        assert int(allocated["shared"]) == _staging_bytes(plain), plain.dumps()
        assert int(allocated["shared.dyn"]) == _input_bytes(plain), plain.dumps()


@pytest.mark.parametrize(("case", "knobs"), [
    ("matmul-fp16-tensorcore", dict(tile_i=[4, 2, 2], tile_j=[4, 1, 2], tile_k=[4, 1], vector=2, pad=0, pipeline=1,
                                    auto_unroll_max_step=64)),
    ("matmul-fp16-tensorcore", dict(tile_i=[2, 4, 2], tile_j=[4, 2, 1], tile_k=[4, 1], vector=1, pad=8, pipeline=0,
                                    auto_unroll_max_step=512)),
    ("conv2d-fp16-tensorcore-1x1", dict(tile_i=[1, 1, 2], tile_j=[18, 1, 1], tile_k=[1, 2], vector=4, pad=8,
                                        pipeline=0, auto_unroll_max_step=64)),
])
def test_cuda_tensorcore_reads_each_stored_fragment_back(case: str, knobs: dict[str, Any]) -> None:
    """With `store` 1 a warp stages each of its fragments at the same shared address; once TVM
    had unrolled the write-out, its CUDA printer reused the first fragment's load for the others
    (the H100 check of 2026-11-25: relative errors of 1 in these configs). Every store of a
    fragment must be followed by a load of it before the next one is stored."""
    wl = _workload(CUDA_CASES[case])
    template = get_template(wl, "cuda")
    config = template.space(wl, CUDA).from_json({**knobs, "store": 1})
    source = _cuda_source(template.schedule(wl, CUDA, config).mod)
    staging = re.search(r"store_matrix_sync\(\(&\((\w+)\[", source).group(1)  # type: ignore[union-attr]
    stored = source.split(f"store_matrix_sync((&({staging}")[1:]
    assert len(stored) == config["tile_i"][2] * config["tile_j"][2] > 1
    assert all(f"*(float4*)({staging}" in after for after in stored)


def test_cuda_tensorcore_reaches_large_tiles_by_storing_a_fragment_at_a_time() -> None:
    """A 128x128 tile of 4 warps: its float32 staging (64 KiB) does not fit a block's 48 KiB, one
    fragment per warp at a time (80x80 floats, 25 KiB) does."""
    wl = make_workload("matmul", dict(M=4096, N=4096, K=4096, dtype="float16"))
    template = get_template(wl, "cuda")
    knobs = dict(tile_i=[32, 2, 4], tile_j=[32, 2, 4], tile_k=[128, 2], vector=8, pad=8, pipeline=0,
                 auto_unroll_max_step=64)
    space = template.space(wl, CUDA)
    assert "> 49152" in (template.check(wl, CUDA, space.from_json({**knobs, "store": 0})) or "")
    assert template.check(wl, CUDA, space.from_json({**knobs, "store": 1})) is None


def test_cuda_tensorcore_tiles_reach_the_opt_in_shared_memory_as_tvm_allocates_it() -> None:
    """The input tiles are dynamic shared memory: from 48 KiB of them on, TVM's runtime opts the
    kernel in, and a block may hold up to the GPU's opt-in limit (227 KiB on sm_90, 99 KiB on
    sm_86). Below 48 KiB of them, static and dynamic together must fit 48 KiB. `check` and
    `verify_gpu` (from the lowered kernel's allocations) agree on each case."""
    from tvm.s_tir.analysis import calculate_allocated_bytes

    from farm.core.templates.cuda_tensorcore import _input_bytes, _staging_bytes
    from farm.core.templates.verify import lower

    wl = make_workload("matmul", dict(M=4096, N=4096, K=4096, dtype="float16"))
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    ampere_rtx = parse_target({"kind": "cuda", "arch": "sm_86"})
    deep = space.from_json(dict(tile_i=[32, 2, 4], tile_j=[32, 2, 4], tile_k=[64, 4], vector=8, pad=8, pipeline=3,
                                auto_unroll_max_step=0, store=1))  # 105 KiB of tiles, 25 KiB of staging
    mod = template.schedule(wl, CUDA, deep).mod
    allocated = calculate_allocated_bytes(lower(mod, CUDA)["main_kernel"])["main"]
    assert (int(allocated["shared.dyn"]), int(allocated["shared"])) == (_input_bytes(deep), _staging_bytes(deep))
    assert _input_bytes(deep) + _staging_bytes(deep) > 99 * 1024
    assert template.check(wl, CUDA, deep) is None and verify_gpu(mod, CUDA) is None
    assert "(sm_86's opt-in limit)" in (template.check(wl, ampere_rtx, deep) or "")
    assert "shared memory" in (verify_gpu(mod, ampere_rtx) or "")
    # 40 KiB of tiles and 25 KiB of staging: no opt-in, so over 48 KiB.
    between = space.from_json({**deep.to_json(), "tile_k": [128, 2], "pipeline": 2})
    assert _input_bytes(between) < 48 * 1024 < _input_bytes(between) + _staging_bytes(between)
    assert "bytes of shared memory > 49152" in (template.check(wl, CUDA, between) or "")
    assert "bytes of shared memory > 49152" in (verify_gpu(template.schedule(wl, CUDA, between).mod, CUDA) or "")


def test_cuda_tensorcore_refuses_what_could_not_run() -> None:
    wl = _workload(CUDA_CASES["matmul-fp16-tensorcore"])
    template = get_template(wl, "cuda")
    space = template.space(wl, CUDA)
    good = dict(tile_i=[4, 2, 2], tile_j=[2, 2, 2], tile_k=[2, 2], vector=8, pad=0, pipeline=1,
                auto_unroll_max_step=0, store=0)
    assert template.check(wl, CUDA, space.from_json(good)) is None

    def why(**knobs: Any) -> str:
        return template.check(wl, CUDA, space.from_json({**good, **knobs})) or ""

    assert "tensor cores need sm_70 or later, not sm_61" in (
        template.check(wl, parse_target({"kind": "cuda", "arch": "sm_61"}), space.from_json(good)) or "")
    assert "asynchronous copies need sm_80 or later, not sm_75" in (
        template.check(wl, parse_target({"kind": "cuda", "arch": "sm_75"}), space.from_json({**good, "pipeline": 2}))
        or "")
    assert "16x2 accumulator fragments per warp > 16" in why(tile_i=[1, 1, 16], tile_j=[2, 2, 2])
    assert "2 pipeline buffers need as many outer steps of the reduction, not 1" in why(tile_k=[1, 4])
    assert "3 pipeline buffers need as many outer steps of the reduction, not 2" in why(pipeline=3)
    assert "do not split into 128 threads x 8" in why(tile_i=[16, 1, 1], tile_j=[1, 4, 2], tile_k=[4, 1])
    conv = _workload(CUDA_CASES["conv2d-fp16-tensorcore"])
    conv_space = template.space(conv, CUDA)
    conv_good = dict(tile_i=[1, 2, 1], tile_j=[2, 1, 4], tile_k=[3, 3], vector=4, pad=0, pipeline=1,
                     auto_unroll_max_step=64, store=0)
    assert template.check(conv, CUDA, conv_space.from_json(conv_good)) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler) on this machine")
@pytest.mark.parametrize(("warpgroups", "slices", "block_n", "producer", "tiles_per_block", "cluster", "store"),
                         [(1, 1, 64, 0, 1, 1, 0), (2, 1, 256, 0, 1, 1, 1), (1, 2, 128, 1, 2, 1, 0),
                          (2, 1, 256, 1, 4, 1, 0), (2, 2, 64, 1, 8, 1, 1), (2, 1, 256, 1, 1, 1, 0),
                          (2, 1, 256, 1, 4, 2, 0), (1, 2, 128, 1, 1, 2, 1), (2, 2, 128, 1, 4, 1, 1),
                          (2, 1, 256, 1, 4, 1, 2), (1, 2, 128, 1, 1, 2, 2), (2, 1, 128, 0, 1, 1, 2)])
def test_cuda_wgmma_kernel_builds_as_the_farm_builds_it(tmp_path: Path, warpgroups: int, slices: int, block_n: int,
                                                         producer: int, tiles_per_block: int, cluster: int,
                                                         store: int) -> None:
    """A 4096^3 float16 matmul on Hopper's wgmma, built as every candidate is (workers.builder:
    TVM's tirx pipeline, then nvcc -arch=sm_90a): it compiles, its accumulators stay in registers
    (no spills, no local memory: every index into them is a constant), ptxas keeps the wgmmas
    asynchronous (it serialises them where it cannot), and the kernel issues
    ``wgmma.mma_async`` of the config's N on tiles that TMA loads, with the block's threads (one more
    warpgroup with a producer), with tiles_per_block > 1 a loop over the block's tiles of C, and with
    clusters a cluster launch whose CTAs multicast B and release stages in both CTAs; with store 1,
    C written in 16-byte stores after the quads' shuffles, 4-byte ones without; with store 2, the
    shuffled words written to shared memory and TMA storing them, one store per 64-column atom,
    its thread waiting for them before the staging tile is reused and before the block exits."""
    from workers import builder, compiler

    wl = make_workload("matmul", dict(M=4096, N=4096, K=4096, dtype="float16"))
    task = Task(wl, HOPPER)
    assert task.template.name == "cuda.wgmma"
    config = task.space.from_json(dict(warpgroups=warpgroups, slices=slices, block_n=block_n, stages=3, raster=8,
                                       producer=producer, tiles_per_block=tiles_per_block, cluster=cluster,
                                       store=store))
    assert task.check(config) is None and tir_pipeline(task.schedule(config).mod) == "tirx"
    result = builder.build_one(json.dumps(task.to_json()), config.index, str(tmp_path))
    assert result.ok, result.error
    assert result.info["spill_bytes"] == 0 and result.info["threads"] == 128 * (warpgroups + producer)
    assert 0 < result.info["registers"] <= 255
    lib = tvm.compile(task.schedule(config).mod, target=HOPPER.tvm(), tir_pipeline="tirx")
    source = lib.mod.imports[0].inspect_source("")
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.f16.f16" in source
    assert "cp.async.bulk.tensor.2d" in source
    assert ("__shfl_xor_sync" in source) == (store >= 1)
    assert ("*(uint4*)(C2_ptr" in source) == (store == 1)
    tma_stores = source.count("cp_async_bulk_tensor_s2g_async_bulk_tensor_2d_global_shared__cta_bulk_group((")
    assert tma_stores == (block_n // 64 * slices if store == 2 else 0)
    assert ("*(uint4*)(((uint*)smem_ptr)" in source) == ("cp.async.bulk.wait_group.read 0;" in source) == (store == 2)
    # The descriptors are encoded once per thread (A's of each slice, B's), not per wgmma: the main
    # loop offsets them (ncu: encoded per wgmma, twice cuBLAS's instructions, kernels-2026-11-26h).
    assert source.count("ptx_wgmma_encode_matrix_descriptor((&") == slices + 1
    # A persistent block loops over its tiles of C (the loop TVM keeps as the script's `t`).
    assert ("for (int t = 0; t < " in source) == (tiles_per_block > 1)
    # A cluster: B arrives by multicast, the consumers arrive on the other CTA's barriers too, and the
    # module launches clusters (TVM's launch tag for them).
    assert ("multicast::cluster" in source) == ("mapa.shared::cluster" in source) == (cluster > 1)
    assert (b"clusterCtaIdx" in _exported(lib, tmp_path)) == (cluster > 1)
    ptxas = compiler._nvcc(source, HOPPER.arch, tmp_path / "again").stderr
    assert "0 bytes stack frame" in ptxas, ptxas
    # ptxas serialises the wgmmas (a wait after each) where it cannot prove their accumulators
    # untouched in flight, and says so: "Potential Performance Loss: wgmma.mma_async instructions
    # are serialized ...".
    assert "serialized" not in ptxas, ptxas
