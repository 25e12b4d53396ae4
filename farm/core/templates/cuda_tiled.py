"""CUDA multi-level tiling for conv2d, grouped conv2d, matmul and batch matmul.

The structure of the AutoTVM conv2d tutorial ("Tuning High Performance Convolution on NVIDIA
GPUs", ../shared/references/): every spatial axis is split 4 ways into block / vthread /
thread / inner, every reduction axis 3 ways into outer / middle / inner; the inputs are staged
through shared memory at the outer reduction loop with cooperative fetching by all threads of
the block, then through registers at the middle loop; the output accumulates in a local write
cache; `auto_unroll_max_step` in {0, 512, 1500} and `unroll_explicit` in {0, 1} tune unrolling.
Four knobs go beyond the tutorial: `split_k` (the first reduction axis cut into slices whose
partial sums a second kernel adds up), `fetch` (coalesced and vector loads into shared memory)
and, for matmul, `pipeline` (2 to 4 shared buffers per tile, with cp.async or without:
base.PIPELINE) and `a_kmajor` (A's shared tile stored transposed). Their first values (1, 0, 0,
0) give the tutorial's kernel: for its ResNet last layer that slice of the
space has exactly the tutorial's 10,454,400 configs.

Spatial axes are grouped onto the z / y / x grid and thread dimensions (conv: batch and
output channel on z, rows on y, columns on x; matmul: rows on y, columns on x; batch matmul: the
batch on z too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from farm.core.space import ChoiceKnob, Columns, Config, ConfigSpace, SplitKnob
from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    CUDA_MAX_BLOCK_DIM,
    CUDA_MAX_GRID_DIM,
    PIPELINE,
    Rules,
    Template,
    annotate_unroll,
    axis_extents,
    cooperative_fetch,
    dtype_bytes,
    first_error,
    fold_epilogue,
    has_stage,
    new_schedule,
    passing,
    pipeline_buffers,
    pipeline_loop,
    pipeline_rules,
    prod,
    shared_memory_rules,
)
from farm.core.workloads import Workload

# Loop names of the `compute` block, spatial then reduction (see farm.core.workloads).
_CONV_AXES = ("n", "f", "y", "x"), ("rc", "ry", "rx")
_AXES = {
    "conv2d_nchw": _CONV_AXES,
    "group_conv2d_nchw": _CONV_AXES,
    "matmul": (("i", "j"), ("k",)),
    "batch_matmul": (("b", "i", "j"), ("k",)),
}
# Which spatial axes share each grid dimension, z then y then x.
_GROUPS = {
    "conv2d_nchw": (("n", "f"), ("y",), ("x",)),
    "group_conv2d_nchw": (("n", "f"), ("y",), ("x",)),
    "matmul": ((), ("i",), ("j",)),
    "batch_matmul": (("b",), ("i",), ("j",)),
}
_DIMS = ("z", "y", "x")


# Split-K: the first reduction axis cut into this many slices, each summed by its own blocks
# (blockIdx.z) into a buffer of partial sums, which a second kernel adds up. It fills the GPU
# when the output alone gives too few blocks (resnet-last-conv: 7x7x512 outputs, a 4,608-long
# reduction). 1: no split, the tutorial's kernel.
SPLIT_K = (1, 2, 4, 8, 16, 32, 64)
# How the threads copy a tile into shared memory: 0, the tutorial's way (each thread a contiguous
# run); v >= 1, coalesced (consecutive threads, consecutive elements), v elements per load.
# Vector loads only where every row of a tile is contiguous in the input: matmul.
FETCH = {"matmul": (0, 1, 2, 4)}
FETCH_DEFAULT = (0, 1)
# Software pipelining of the outer reduction loop (base.PIPELINE): matmul only.
PIPELINE_OF = {"matmul": PIPELINE}
# A's shared tile stored k-major (1) rather than as A is, row-major (0): matmul only. A thread's rows of
# A at one k are then contiguous, so that they load as vectors (LDS.64/128, which nvcc forms from
# the unrolled scalar loads) when the register copies are refilled one k at a time (tile_k's inner
# factor 1) for large register tiles, the SIMT SGEMM structure of cuBLAS's kernels; row-major, they
# are `tile_i`'s inner factor scalar loads (docs/defaults.md#tiled-a-k-major). The copy into it still reads A
# coalesced along k and stores down its columns (with asynchronous copies, one element per 4-byte
# cp.async). Unpadded, consecutive k of a column are a whole row of the tile apart, a multiple of
# 32 banks for 32 rows or more: the stores of neighbouring threads hit one bank (4 ways with
# float4 loads, up to 16 with cp.async; docs/defaults.md#tiled-a-k-major). So the tile's rows are padded to
# a stride of KMAJOR_PAD floats over a multiple of 32 banks (at most 2 ways), which keeps each
# thread's rows 16-byte aligned for LDS.128.
A_KMAJOR_OF = {"matmul": (0, 1)}
KMAJOR_PAD = 4
# Threads per block of the kernel that adds up split-K's partial sums.
SUM_THREADS = 256


class CudaTiled(Template, name="cuda.tiled", kind="cuda", workloads=tuple(_AXES)):
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        spatial, reduce = _AXES[wl.name]
        extents = axis_extents(wl, spatial + reduce)
        return ConfigSpace(
            [SplitKnob(f"tile_{a}", extents[a], 4) for a in spatial]
            + [SplitKnob(f"tile_{a}", extents[a], 3) for a in reduce]
            + [ChoiceKnob("auto_unroll_max_step", [0, 512, 1500]), ChoiceKnob("unroll_explicit", [0, 1]),
               ChoiceKnob("split_k", [k for k in SPLIT_K if extents[reduce[0]] % k == 0]),
               ChoiceKnob("fetch", list(FETCH.get(wl.name, FETCH_DEFAULT))),
               ChoiceKnob("pipeline", list(PIPELINE_OF.get(wl.name, (0,)))),
               ChoiceKnob("a_kmajor", list(A_KMAJOR_OF.get(wl.name, (0,))), default=0)]
        )

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        return first_error(_rules(wl, target, Columns.of_config(config)))

    def precheck_columns(self, wl: Workload, target: TargetSpec, configs: Columns) -> np.ndarray:
        return passing(_rules(wl, target, configs), len(configs))

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        spatial, reduce = _AXES[wl.name]
        sch = new_schedule(wl)
        block = sch.get_sblock(wl.stage("compute"))
        factors = {a: list(config[f"tile_{a}"]) for a in spatial + reduce}
        split = config["split_k"]
        k_slice = None  # split-K's slice loop, bound to blockIdx.z with the grid's z axes
        if split > 1:
            sliced, _ = sch.split(sch.get_loops(block)[len(spatial)], [split, None])
            partial = sch.rfactor(sliced, factor_axis=0)  # `block` now adds up the partial sums
            _schedule_sum(sch, wl, block, len(spatial), min(SUM_THREADS, target.limit("max_threads_per_block")))
            block = partial
            factors[reduce[0]][0] //= split
        write_cache = sch.cache_write(block, 0, "local")
        loops = sch.get_loops(block)
        if split > 1:  # the partial sums' own loop nest: spatial, slice, reduction
            k_slice = loops[len(spatial)]
            loops = [*loops[:len(spatial)], *loops[len(spatial) + 1:]]
        loops = dict(zip(spatial + reduce, loops, strict=True))
        tiles = {a: sch.split(loops[a], factors[a]) for a in spatial + reduce}

        # Each grid dimension's axes at each level: (dimension, loops), z then y then x.
        levels: list[list[tuple[str, list[Any]]]] = []
        for level in range(4):
            dims = []
            for dim, group in zip(_DIMS, _GROUPS[wl.name], strict=True):
                parts = [tiles[a][level] for a in group]
                if level == 0 and dim == "z" and k_slice is not None:
                    parts = [k_slice, *parts]
                if parts:
                    dims.append((dim, parts))
            levels.append(dims)
        reduce_outer = [tiles[a][0] for a in reduce]
        reduce_mid = [tiles[a][1] for a in reduce]
        reduce_inner = [tiles[a][2] for a in reduce]
        order = [lp for level in levels[:3] for _, parts in level for lp in parts]
        order += reduce_outer + reduce_mid + reduce_inner
        order += [lp for _, parts in levels[3] for lp in parts]
        sch.reorder(*order)

        bound: dict[str, list[Any]] = {}
        for level, prefix in enumerate(("blockIdx", "vthread", "threadIdx")):
            bound[prefix] = []
            for dim, parts in levels[level]:
                fused = sch.fuse(*parts) if len(parts) > 1 else parts[0]
                sch.bind(fused, f"{prefix}.{dim}")
                bound[prefix].append(fused)
        sch.reverse_compute_at(write_cache, bound["threadIdx"][-1])
        if split == 1:  # with split-K, the partial sums' adder computes the epilogue
            fold_epilogue(sch, wl, write_cache, None)

        # Shared memory at the outer reduction loop, registers at the middle one.
        thread_dims = [dim for dim, _ in levels[2]]
        thread_extents = [
            prod(config[f"tile_{a}"][2] for a in group) for group in _GROUPS[wl.name] if group
        ]
        fetch = config["fetch"]
        for i in range(2):
            shared = sch.cache_read(block, i, "shared")
            sch.compute_at(shared, reduce_outer[-1], preserve_unit_loops=True)
            vector = max(fetch, 1)
            if i == 0 and config["a_kmajor"]:
                sch.transform_layout(shared, ("write", 0), lambda row, k: (k, row))
                sch.storage_align(shared, 0, axis=0, factor=32, offset=KMAJOR_PAD)
                if config["pipeline"] >= 2:
                    # A vector read along k lands down a column of the transposed tile: a strided
                    # vector, which cp.async cannot copy (verify._strided_async_copy). Element by
                    # element, each is a 4-byte cp.async.
                    vector = 1
            cooperative_fetch(sch, shared, thread_extents, thread_dims, threads_outer=fetch == 0, vector=vector)
        if has_stage(sch, wl, "pad"):
            # Padding goes into the shared copy, which then fills exactly the padded tile that
            # _shared_bytes counts. Inlined into `compute` instead, the copy reads `data` under
            # the padding predicate and TVM's buffer compaction often over-allocates the tile
            # (up to the whole padded image), so `check` passed configs that could not run.
            sch.compute_inline(sch.get_sblock(wl.stage("pad")))
        for i in range(2):
            local = sch.cache_read(block, i, "local")
            sch.compute_at(local, reduce_mid[-1])

        # The accumulators zeroed once, before the reduction, not by a select in every step of it
        # (64 FSEL per 512 FFMA in an 8x8-tile matmul's SASS, nvcc 13.0).
        sch.decompose_reduction(block, reduce_outer[0])
        # The loop's body: the two shared copies, then the register tiles and the multiply-adds.
        pipeline_loop(sch, reduce_outer[-1], config["pipeline"])
        annotate_unroll(sch, bound["blockIdx"][0], config["auto_unroll_max_step"],
                        config["unroll_explicit"])
        return sch


def _schedule_sum(sch: Any, wl: Workload, block: Any, spatial: int, threads: int) -> None:
    """Split-K's second kernel: one thread per output adds up the slices' partial sums (and
    computes the epilogue, if any, from them)."""
    loops = sch.get_loops(block)
    blocks, thread = sch.split(sch.fuse(*loops[:spatial]), [None, threads])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    fold_epilogue(sch, wl, None, thread)


def _rules(wl: Workload, target: TargetSpec, c: Columns) -> Rules:
    """What makes configs invalid: the block's threads and virtual threads, the grid's z, split-K's
    slices, vector loads, pipelining and shared memory (base.Rules)."""
    spatial, reduce = _AXES[wl.name]
    threads = _factors(c, spatial, 2)
    limit = target.limit("max_threads_per_block")
    yield threads > limit, lambda i: f"{threads[i]} threads per block > {limit}"
    for dim, group in zip(_DIMS, _GROUPS[wl.name], strict=True):
        extent = _factors(c, group, 2)
        yield extent > CUDA_MAX_BLOCK_DIM[dim], \
            lambda i, dim=dim, extent=extent: f"threadIdx.{dim} extent {extent[i]} > {CUDA_MAX_BLOCK_DIM[dim]}"
    vthreads = _factors(c, spatial, 1)
    yield vthreads > target.max_vthreads, lambda i: f"{vthreads[i]} vthreads > {target.max_vthreads}"
    split, outer = c["split_k"], c[f"tile_{reduce[0]}"][:, 0]
    yield outer % split != 0, \
        lambda i: f"split_k={split[i]} does not divide the {outer[i]} outer steps of {reduce[0]}"
    grid_z = split * _factors(c, _GROUPS[wl.name][0], 0)
    yield grid_z > CUDA_MAX_GRID_DIM["z"], lambda i: f"blockIdx.z extent {grid_z[i]} > {CUDA_MAX_GRID_DIM['z']}"
    yield from _vector_rules(wl, c)
    pipeline = c["pipeline"]
    implicit_unroll = (c["auto_unroll_max_step"] != 0) & (c["unroll_explicit"] == 0)
    yield from pipeline_rules(pipeline, outer // split, target, implicit_unroll)
    # One thread's contiguous run is a loop that TVM's async lowering turns into a DMA call CUDA
    # cannot compile (base.compile_scheduled).
    yield (pipeline >= 2) & (c["fetch"] == 0), \
        lambda i: "asynchronous copies (pipeline >= 2) need coalesced fetching (fetch >= 1)"
    yield from shared_memory_rules(_shared_bytes(wl, c) * pipeline_buffers(pipeline), target)


def _factors(c: Columns, axes: tuple[str, ...], part: int) -> np.ndarray:
    """The product of part `part` of the tiles of `axes` (1 for none), per config."""
    out = np.ones(len(c), dtype=np.int64)
    for a in axes:
        out = out * c[f"tile_{a}"][:, part]
    return out


def _vector_rules(wl: Workload, c: Columns) -> Rules:
    """Vector loads that could be misaligned (a misaligned vector load kills the CUDA context):
    every vector of both matmul tiles must start on a multiple of its width."""
    vector = c["fetch"]
    if wl.name != "matmul":  # only matmul loads vectors (FETCH)
        return
    p, wide = wl.p, vector > 1
    sizes = (("K", p["K"] * np.ones(len(c), dtype=np.int64)), ("N", p["N"] * np.ones(len(c), dtype=np.int64)),
             ("the k tile", c["tile_k"][:, 1:].prod(axis=1)), ("the j tile", c["tile_j"][:, 1:].prod(axis=1)))
    for what, size in sizes:
        yield wide & (size % np.maximum(vector, 1) != 0), lambda i, what=what, size=size: \
            f"vector loads of {vector[i]} need {what} ({size[i]}) to be a multiple of {vector[i]}"


def _shared_bytes(wl: Workload, c: Columns) -> np.ndarray:
    """Shared memory one block stages per outer reduction step (inputs' tile footprints)."""
    p = wl.p
    tile = {a: c[f"tile_{a}"][:, 1:].prod(axis=1) for a in _AXES[wl.name][0]}
    chunk = {a: c[f"tile_{a}"][:, 1:].prod(axis=1) for a in _AXES[wl.name][1]}
    if wl.name in ("matmul", "batch_matmul"):
        rows = np.where(c["a_kmajor"] != 0, tile["i"] + (KMAJOR_PAD - tile["i"]) % 32, tile["i"])  # its stride
        elements = tile.get("b", 1) * (rows * chunk["k"] + chunk["k"] * tile["j"])
    else:
        s, d = p["stride"], p.get("dilation", 1)
        channels = chunk["rc"]
        if wl.name == "group_conv2d_nchw":
            cig, cog = p["CI"] // p["groups"], p["CO"] // p["groups"]
            spanned = -(-tile["f"] // cog) + np.where((tile["f"] % cog == 0) | (cog % tile["f"] == 0), 0, 1)
            channels = (spanned - 1) * cig + chunk["rc"]
        rows = (tile["y"] - 1) * s + (chunk["ry"] - 1) * d + 1
        cols = (tile["x"] - 1) * s + (chunk["rx"] - 1) * d + 1
        elements = tile["n"] * channels * rows * cols + tile["f"] * chunk["rc"] * chunk["ry"] * chunk["rx"]
    return elements * dtype_bytes(wl.dtype)
