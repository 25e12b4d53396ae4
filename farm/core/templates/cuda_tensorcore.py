"""CUDA tensor cores for float16 matmul, conv2d and grouped conv: WMMA 16x16x16 tiles, float32
accumulators.

A conv2d is scheduled as the matrix product it is (implicit GEMM, as cuDNN's and MetaSchedule's
tensor-core convolutions): C[f, p] = sum_k W[f, k] * X[k, p] with f the output channel, p the
output pixel (n, y, x) and k the reduction (c, ky, kx). `_as_matmul` rewrites the ``compute``
stage into that form (TVM's ``reindex``, ``transform_layout`` and ``transform_block_layout``);
W is the kernel as it lies in memory (read through a view of it as a CO x K matrix,
`_weights_as_matrix`), X the im2col view of the padded input, and the output tile is written
back in NCHW order. A grouped conv is one such product per group (f and c within
the group), the groups on ``blockIdx.z``. X is built as `im2col` says:

- 0: never stored. Its tiles are gathered straight from the input into shared memory (the
  ``pad`` and ``reindex`` stages inlined into those copies), element by element: a 3x3 window's
  shifts leave its rows unaligned and padded at the edges, so those 2-byte copies are never
  asynchronous (``cp.async`` moves 4, 8 or 16 aligned bytes) and each waits for its load;
- 1: stored whole in global memory by a first kernel (one thread per element, consecutive
  threads along a row of X: coalesced stores), then copied into shared memory like a matmul's
  B, in aligned vectors, asynchronously where `pipeline` says. It costs one more kernel and
  K x N halves of traffic (7 MB for a ResNet 14x14 stage at batch 8), mostly in L2.

The structure of TVM's tensor-core schedules (MetaSchedule's MultiLevelTilingTensorCore, the
TensorIR tensorize tests): the output is tiled into 16x16 fragments, grouped
[block, warp, fragments per warp, 16] on each spatial axis, and the reduction into
[outer, fragments per step, 16]:

- each block stages a (rows x k-chunk) tile of A and a (k-chunk x columns) tile of B in shared
  memory per outer step, fetched by all its threads with vector loads (`vector`: 1 to 8 halves,
  16 bytes at most), rows padded by `pad` halves so that the fragment loads of neighbouring rows
  fall in different banks;
- each warp loads its fragments (``wmma.matrix_a`` / ``wmma.matrix_b``) from shared memory and
  runs ``wmma::mma_sync`` on float32 accumulators (``wmma.accumulator``), which are then cast to
  float16 and written out through shared memory (the workload's ``epilogue``), as `store` says:
  the block's whole float32 tile stored at once and written out by all its threads (0), or
  each warp's fragments one at a time, each written out by the warp's own 32 threads (1). The
  whole tile costs 4 bytes of shared memory per output: a 128x128 tile takes 64 KiB, more than
  a block gets without opting in (48 KiB), so the larger tiles are only reachable with 1;
- `split_k` cuts the reduction into 1 to 8 slices, each computed by blocks of its own (blockIdx.z,
  with the groups) into a float32 buffer of partial products (TVM's ``rfactor``), which a second
  kernel adds up, one thread per output, and writes out in the workload's layout and dtype. It
  fills the GPU where the output alone gives too few blocks, as a ResNet 14x14 stage at batch 8
  does on an H100 (docs/defaults.md#tensorcore-split-k). The partial sums cost
  slices x M x N floats written and read, mostly in L2;
- `pipeline` keeps 2 to 4 copies of the shared tiles (base.PIPELINE: 1 with ordinary loads, 2 to 4
  with asynchronous copies on sm_80 and later), so the next steps' tiles load while this one
  computes; `auto_unroll_max_step` unrolls.

The input tiles are dynamic shared memory (``shared.dyn``), so a block may use more than 48 KiB
where the GPU allows it (base.shared_memory_error: 227 KiB on Hopper): the larger k-chunks and
the deeper pipelines need it. The accumulators' staging is static and stays within 48 KiB.

Every fragment is a full 16x16x16 tile, so the product's M, N and K (for a conv2d: CO, N*OH*OW
and CI*KH*KW; per group for a grouped conv) must be multiples of 16 (`applies`): other shapes
stay on `cuda.tiled`. The intrinsics are TVM's own
(`tvm.s_tir.tensor_intrin.cuda`, the WMMA_*_16x16x16 family).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace, SplitKnob
from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    CUDA_MAX_GRID_DIM,
    PIPELINE,
    Template,
    annotate_unroll,
    fold_epilogue,
    has_stage,
    new_schedule,
    pipeline_buffers,
    pipeline_error,
    pipeline_loop,
    shared_memory_error,
)
from farm.core.tvm_import import import_tensor_intrinsics
from farm.core.workloads import Workload

FRAGMENT = 16  # WMMA's m = n = k for float16 inputs
WARP = 32
# A warp holds its accumulators in registers: 8 float32 per thread per 16x16 fragment. At most
# 16 fragments (128 registers) leave room for the A and B fragments and addresses under CUDA's
# 255 registers per thread.
MAX_ACCUMULATORS = 16
VECTOR = (1, 2, 4, 8)  # halves per load into shared memory (8: one 128-bit load)
# Shared rows padded to a stride of 8 halves over a multiple of 32 (`_row`), so that the fragment
# loads of neighbouring rows fall in different banks (8 halves: WMMA's 16-byte row alignment).
PAD = (0, 8)
UNROLL = (0, 64, 512)
IM2COL = (0, 1)  # a convolution's X gathered into each tile (0) or stored by a kernel of its own (1)
IM2COL_THREADS = 256  # threads per block of that kernel
SPLIT_K = (1, 2, 3, 4, 8)  # slices of the reduction, each summed by blocks of its own (1: no split)
SUM_THREADS = 256  # threads per block of the kernel that adds up split-K's partial sums
STORE = (0, 1)  # the accumulators go out through the block's whole tile (0) or a fragment at a time (1)
OUT_VECTOR = 4  # floats per thread and load from a fragment's staging area (one 128-bit load)


def groups(wl: Workload) -> int:
    """How many independent matrix products `wl` is: a grouped conv's groups, else 1."""
    return wl.p["groups"] if wl.name == "group_conv2d_nchw" else 1


def gemm_extents(wl: Workload) -> tuple[int, int, int]:
    """M, N and K of the matrix product `wl` computes (module doc), per group: a matmul's own, a
    convolution's output channels, output pixels and reduction length."""
    if wl.name == "matmul":
        return wl.p["M"], wl.p["N"], wl.p["K"]
    n, co, oh, ow, *reduction = wl.compute_extents()
    return co // groups(wl), n * oh * ow, math.prod(reduction)


class CudaTensorCore(Template, name="cuda.tensorcore", kind="cuda",
                     workloads=("matmul", "conv2d_nchw", "group_conv2d_nchw")):
    def applies(self, wl: Workload, target: TargetSpec) -> bool:
        # A convolution is scheduled as a matrix product written anew (_weights_as_matrix), in which
        # a TIR kernel's (farm.core.fused) elementwise stages would be lost; a matmul's own function
        # is its matrix product, so a fused matmul's is scheduled as it is, its stages folded in.
        return wl.dtype == "float16" and all(extent % FRAGMENT == 0 for extent in gemm_extents(wl)) and \
            (wl.name == "matmul" or not hasattr(wl, "prepare"))

    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        m, n, k = gemm_extents(wl)
        return ConfigSpace([
            SplitKnob("tile_i", m // FRAGMENT, 3),  # blocks, warps, fragments per warp
            SplitKnob("tile_j", n // FRAGMENT, 3),
            SplitKnob("tile_k", k // FRAGMENT, 2),  # outer steps, fragments per step
            ChoiceKnob("vector", list(VECTOR)),
            ChoiceKnob("pad", list(PAD)),
            ChoiceKnob("pipeline", list(PIPELINE)),
            ChoiceKnob("auto_unroll_max_step", list(UNROLL)),
            ChoiceKnob("store", list(STORE)),
            ChoiceKnob("im2col", list(IM2COL) if wl.name != "matmul" else [0], default=0),
            ChoiceKnob("split_k", [s for s in SPLIT_K if k // FRAGMENT % s == 0], default=1),
        ])

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        if target.compute_capability < 70:
            return f"tensor cores need sm_70 or later, not {target.arch}"
        (blocks_i, warps_i, frags_i), (_, warps_j, frags_j) = config["tile_i"], config["tile_j"]
        threads = warps_i * warps_j * WARP
        if threads > target.limit("max_threads_per_block"):
            return f"{threads} threads per block > {target.limit('max_threads_per_block')}"
        if frags_i * frags_j > MAX_ACCUMULATORS:
            return f"{frags_i}x{frags_j} accumulator fragments per warp > {MAX_ACCUMULATORS}"
        if blocks_i > CUDA_MAX_GRID_DIM["y"]:
            return f"blockIdx.y extent {blocks_i} > {CUDA_MAX_GRID_DIM['y']}"
        split, steps = config["split_k"], config["tile_k"][0]
        if steps % split:
            return f"split_k={split} does not divide the {steps} outer steps of k"
        if groups(wl) * split > CUDA_MAX_GRID_DIM["z"]:
            return f"blockIdx.z extent {groups(wl) * split} > {CUDA_MAX_GRID_DIM['z']}"
        rows, cols, depth = _tile(config)
        vector = config["vector"]
        # Every thread copies whole vectors, and each of a tile's rows holds whole vectors.
        for what, size in (("the A tile", rows * depth), ("the B tile", depth * cols)):
            if size % (threads * vector):
                return f"{what}'s {size} halves do not split into {threads} threads x {vector}"
        if (reason := pipeline_error(config["pipeline"], steps // split, target)) is not None:
            return reason
        return shared_memory_error(_staging_bytes(config), target, _input_bytes(config))

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        intrin = import_tensor_intrinsics()

        sch = new_schedule(wl, None if wl.name == "matmul" else _weights_as_matrix(wl))
        block = sch.get_sblock(wl.stage("compute"))
        gathers, scatter = _as_matmul(sch, block, wl)
        split = config["split_k"]
        if split > 1:  # `block` becomes the slices' partial products, added up by a kernel of their own
            summed, block = block, _split_k(sch, block, split, scatter)
            *outputs, _ = sch.get_loops(summed)
            threads = min(SUM_THREADS, target.limit("max_threads_per_block"))
            sum_blocks, sum_thread = sch.split(sch.fuse(*outputs), [None, threads])
            sch.bind(sum_blocks, "blockIdx.x")
            sch.bind(sum_thread, "threadIdx.x")
            if scatter is None:
                fold_epilogue(sch, wl, None, sum_thread)
            else:  # each thread's output written out in NCHW, cast, from a register
                fold_epilogue(sch, wl, scatter, None)
                sch.reverse_compute_at(scatter, sum_thread)
                sch.set_scope(summed, 0, "local")
                scatter = None
            *group, i, j, k_slice, k = sch.get_loops(block)
            group.append(k_slice)
        else:
            *group, i, j, k = sch.get_loops(block)
        i_block, i_warp, i_frag, i_16 = sch.split(i, [*config["tile_i"], FRAGMENT])
        j_block, j_warp, j_frag, j_16 = sch.split(j, [*config["tile_j"], FRAGMENT])
        steps, frags = config["tile_k"]
        k_outer, k_frag, k_16 = sch.split(k, [steps // split, frags, FRAGMENT])
        sch.reorder(*group, i_block, j_block, i_warp, j_warp, k_outer, k_frag, i_frag, j_frag, i_16, j_16, k_16)
        if group:  # a grouped conv's groups and split-K's slices side by side, each a product of its own
            sch.bind(sch.fuse(*group) if len(group) > 1 else group[0], "blockIdx.z")
        sch.bind(i_block, "blockIdx.y")
        sch.bind(j_block, "blockIdx.x")
        warp = sch.fuse(i_warp, j_warp)
        sch.bind(warp, "threadIdx.y")
        warps = config["tile_i"][1] * config["tile_j"][1]

        # Accumulators: fragments per warp, stored into shared memory, cast and written out.
        out_shared = sch.cache_write(block, 0, "shared")
        accumulator = sch.cache_write(block, 0, "wmma.accumulator")
        sch.reverse_compute_at(accumulator, warp)
        if scatter is not None:  # the product's C back into the output's NCHW layout
            sch.reverse_compute_inline(scatter)
        row_16 = _fragments(sch, accumulator)
        # Each fragment as soon as it is stored, by its warp's lanes (`store` 1), or the block's
        # whole tile, by all its threads (0).
        sch.reverse_compute_at(out_shared, sch.get_loops(accumulator)[-3] if config["store"] else j_block)
        if split == 1:  # with split-K, the sum's kernel computes the epilogue
            fold_epilogue(sch, wl, out_shared, None)
        if config["store"]:
            rows, lane, vector = sch.split(sch.fuse(*sch.get_loops(out_shared)[-2:]), [None, WARP, OUT_VECTOR])
            sch.bind(lane, "threadIdx.x")
            sch.vectorize(vector)
            # Left a loop for nvcc to unroll (`#pragma unroll`), not copied out by TVM: every
            # fragment is staged at the same address, and in straight-line code TVM 0.27's CUDA
            # printer reuses the first fragment's vector load for all the others (it caches a
            # cast's operand by its text, across the stores and barriers between them), so
            # every fragment but the first was written out with the first one's values.
            sch.annotate(rows, "pragma_unroll_explicit", 0)
        else:
            _spread(sch, out_shared, warps, 1)
        sch.tensorize(row_16, intrin.WMMA_STORE_16x16x16_F32_SHARED_INTRIN)

        # Inputs: shared tiles per outer step, fragments per inner step.
        for index, scope, load in ((0, "wmma.matrix_a", intrin.WMMA_LOAD_16x16x16_F16_A_DYN_INTRIN),
                                   (1, "wmma.matrix_b", intrin.WMMA_LOAD_16x16x16_F16_B_DYN_INTRIN)):
            shared = sch.cache_read(block, index, "shared.dyn")
            sch.compute_at(shared, k_outer)
            if config["pad"]:
                sch.storage_align(shared, 0, axis=-2, factor=32, offset=config["pad"])
            _spread(sch, shared, warps, config["vector"])
            fragment = sch.cache_read(block, index, scope)
            sch.compute_at(fragment, k_frag)
            sch.tensorize(_fragments(sch, fragment), load)

        for index, gather in enumerate(gathers):  # W's and X's reads from the inputs
            if index == 1 and config["im2col"]:  # X stored whole by a kernel of its own
                _iterate_as(sch, gather, "write")
                blocks, threads = sch.split(sch.fuse(*sch.get_loops(gather)), [None, IM2COL_THREADS])
                sch.bind(blocks, "blockIdx.x")
                sch.bind(threads, "threadIdx.x")
            else:  # into the shared copies
                sch.compute_inline(gather)
        init = sch.decompose_reduction(block, k_outer)
        sch.tensorize(sch.get_loops(init)[-2], intrin.WMMA_FILL_16x16x16_F32_INTRIN)
        sch.tensorize(i_16, intrin.WMMA_SYNC_16x16x16_f16f16f32_INTRIN)

        # The loop's body: the two shared copies, then the fragment loads and the mma.
        pipeline_loop(sch, k_outer, config["pipeline"])
        annotate_unroll(sch, i_block, config["auto_unroll_max_step"], 1)
        return sch


# A convolution's kernel access as TVM prints it: kernel[f, c, ky, kx], each index free of
# brackets and commas (block iteration variables, or 0 for an axis of extent 1).
_KERNEL_ACCESS = re.compile(r"\bkernel\[([^\[\],]+), ([^\[\],]+), ([^\[\],]+), ([^\[\],]+)\]")
_FUNC_ATTR = '    T.func_attr({"tirx.noalias": True})\n'


def _weights_as_matrix(wl: Workload) -> Any:
    """The convolution `wl` as a PrimFunc whose ``compute`` stage reads the kernel through
    ``kernel_flat``, a view of the kernel's own memory as the matrix W[f, k] (CO x K, k = (c *
    KH + ky) * KW + kx), where the workload reads kernel[f, c, ky, kx]. Same computation, same
    arguments.

    Why: W's tiles are copied along k. Read through the 4-D kernel, a copy computes (k // (KH *
    KW), k // KW % KH, k % KW), and TVM 0.27 folds that back into k only where its simplifier
    sees the whole pattern. In a software-pipelined loop the next step's k is shifted by the
    tile's depth, and TVM normalises each term's shift on its own. For 7 of 11 depths tried on
    a 3x3 kernel (16 to 384 halves; 5 of 7 on 5x5, 4 of 6 on 7x7), the copy then became a
    gather of single halves, with vector index arithmetic and no ``cp.async``. With 8 lanes it
    printed code that nvcc rejects. Through the view the index is k itself.

    TVM's Python API has no IR mutator, so the view is made in TVMScript. The function is
    printed, its two kernel accesses (the block's read region and its load) are rewritten, a
    buffer sharing the kernel's data is declared, and the text is parsed again. The assertion
    stops a TVM whose printer writes them another way."""
    import tvm

    co, ci, kh, kw = wl.input_shapes()[1]
    script, accesses = _KERNEL_ACCESS.subn(
        lambda m: f"kernel_flat[{m[1]}, ({m[2]} * {kh} + {m[3]}) * {kw} + {m[4]}]", wl.prim_func().script())
    assert accesses == 2 and _FUNC_ATTR in script, f"TVM printed {wl}'s kernel accesses in an unexpected form"
    view = f'    kernel_flat = T.decl_buffer(({co}, {ci * kh * kw}), "{wl.dtype}", data=kernel.data)\n'
    return tvm.script.from_source(script.replace(_FUNC_ATTR, _FUNC_ATTR + view))


def _as_matmul(sch: Any, block: Any, wl: Workload) -> tuple[list[Any], Any | None]:
    """Rewrite `block` (the ``compute`` stage) as C[i, j] += A[i, k] * B[k, j] over three loops,
    after one loop over the groups of a grouped conv; A is the block's read 0 and B its read 1,
    as every workload's definition lists them (farm.core.workloads).

    A convolution's `block` must read its kernel through the matrix view of
    `_weights_as_matrix`: A is then that view's W[f, k] (for a grouped conv, W[group * CO /
    groups + f, k]).

    Returns the blocks that produce A and B from the inputs, to be inlined into the shared
    copies once those exist, and the block that copies C into the output's layout (none of
    these for a matmul).
    """
    if wl.name == "matmul":
        return [], None
    from tvm.tirx import IndexMap

    # A convolution iterates (n, f, y, x, c, ky, kx), reads (kernel, padded input) and writes
    # compute[n, f, y, x] (farm.core.workloads); a grouped one reads input channel
    # f // (CO / groups) * (CI / groups) + c. Its output channel is split first into (group, f
    # within the group), so that every access below is a function of the group, not of f.
    _, co, oh, ow, _, kh, kw = wl.compute_extents()
    per_group = co // groups(wl)
    if groups(wl) > 1:
        sch.transform_block_layout(block, lambda n, f, y, x, c, ky, kx: (
            f // per_group, n, f % per_group, y, x, c, ky, kx))

    def gemm(v: Sequence[Any]) -> tuple[Any, ...]:
        """(group, f, pixel, k) of the block's iteration `v`, without the group for a conv2d."""
        *group, n, f, y, x, c, ky, kx = v
        return (*group, f, (n * oh + y) * ow + x, (c * kh + ky) * kw + kx)

    batch = 1 if groups(wl) > 1 else 0  # positions in gemm(v) of (f, pixel, k) start here
    f, p, k = batch, batch + 1, batch + 2
    assert sch.get(block).reads[0].source.name == "kernel_flat", "read the kernel through _weights_as_matrix"
    layouts = {("read", 1): (k, p), ("write", 0): (f, p)}  # X[k, p], C[f, p]
    gather_x = sch.reindex(block, ("read", 1))
    scatter = sch.reindex(block, ("write", 0))
    variables = len(sch.get(block).iter_vars)
    for (kind, index), axes in layouts.items():
        # A reindexed buffer has one axis per iteration variable its indices use, in the block's
        # order; TVM leaves out those it simplified away (ky and kx of a 1x1 kernel).
        stmt = sch.get(block)
        used = [next(pos for pos, iv in enumerate(stmt.iter_vars) if iv.var.same_as(r.min))
                for r in (stmt.reads if kind == "read" else stmt.writes)[index].region]
        keep = (*range(batch), *axes)
        sch.transform_layout(block, (kind, index), IndexMap.from_func(
            _axes_to(used, variables, lambda v, keep=keep: tuple(gemm(v)[a] for a in keep)),
            ndim=len(used), index_dtype="int32"))
    sch.transform_block_layout(block, IndexMap.from_func(lambda *v: gemm(v), ndim=variables, index_dtype="int32"))
    # W's copy, made now that the block reads W[f, k] (per group: the group's rows) with k a
    # variable of its own: its indices are the block's, and stay so when it is inlined into the
    # shared copy. (The shared copy cannot read the view itself: TVM's cache_read then rewrites
    # the view's declaration into the cache's.)
    gather_w = sch.reindex(block, ("read", 0))
    if has_stage(sch, wl, "pad"):
        sch.compute_inline(sch.get_sblock(wl.stage("pad")))  # into the im2col gather
    return [gather_w, gather_x], scatter


def _split_k(sch: Any, block: Any, split: int, scatter: Any | None) -> Any:
    """Cut the reduction of `block` (the product as `_as_matmul` leaves it, its loops ending in
    k) into `split` slices: returns the block that computes each slice's partial products into a
    float32 buffer P[slice, (group,) i, j], its loops (group, i, j, slice, k within the slice).
    `block` itself becomes the sum of the slices into C, its loops C's and then the slices'.

    A convolution's `scatter` (C[f, pixel] into the output's NCHW layout) is made to iterate as
    it reads C, so that it can follow the sum one output at a time (`compute_at`: its iteration
    is then solved from the one element of C, where the NCHW order would need (n * OH + y) * OW
    + x inverted, which TVM cannot do)."""
    *_, k = sch.get_loops(block)
    slices, _ = sch.split(k, [split, None])
    partial = sch.rfactor(slices, factor_axis=0)
    if scatter is not None:
        _iterate_as(sch, scatter, "read")
    return partial


def _iterate_as(sch: Any, block: Any, access: str) -> None:
    """Make `block` iterate over the buffer it writes (`access` "write") or its one read
    ("read"), in that buffer's order: its innermost loop then runs along the buffer's last axis,
    so that consecutive threads access consecutive elements. (A reindex block iterates as the
    computation it came from: for X, kx innermost, a row of X apart.)"""
    from tvm.tirx import IndexMap

    stmt = sch.get(block)
    region = (stmt.writes if access == "write" else stmt.reads)[0].region
    sch.transform_block_layout(block, IndexMap([iv.var for iv in stmt.iter_vars], [r.min for r in region], None))


def _axes_to(used: list[int], variables: int, to: Any) -> Any:
    """A function of a reindexed buffer's axes (the iteration variables at `used`) returning
    `to` of all `variables` of them, those left out as 0."""

    from tvm import tirx

    def mapping(*axes: Any) -> Any:
        v: list[Any] = [tirx.IntImm("int32", 0)] * variables  # expressions, so every index is one
        for pos, axis in zip(used, axes, strict=True):
            v[pos] = axis
        return to(v)

    return mapping


def _tile(config: Config) -> tuple[int, int, int]:
    """A block's output rows, output columns and k-chunk, in elements."""
    _, warps_i, frags_i = config["tile_i"]
    _, warps_j, frags_j = config["tile_j"]
    return warps_i * frags_i * FRAGMENT, warps_j * frags_j * FRAGMENT, config["tile_k"][1] * FRAGMENT


def _input_bytes(config: Config) -> int:
    """The A and B tiles in float16, rows padded, one copy per pipeline buffer: the block's
    dynamic shared memory."""
    rows, cols, depth = _tile(config)
    return (rows * _row(depth, config["pad"]) + depth * _row(cols, config["pad"])) * 2 * pipeline_buffers(
        config["pipeline"])


def _row(length: int, pad: int) -> int:
    """Halves a shared row of `length` takes with `pad`: `storage_align` (factor 32, offset pad)
    rounds its stride up to the next one that leaves `pad` over a multiple of 32 (a row of 16
    halves padded by 8 takes 40)."""
    return length + (pad - length) % 32 if pad else length


def _staging_bytes(config: Config) -> int:
    """The block's static shared memory: the float32 staging of the accumulators. (In the one
    dynamic buffer TVM 0.27 would reuse the inputs' bytes for it, but its merge pass then types
    the float32 pointers as float16 and fails, `tvm_access_ptr element type must match the
    source buffer`, whenever the inputs' tiles are the larger.) The whole output tile (`store` 0), or one
    fragment per warp (1), which TVM allocates as the box that holds every warp's fragment at
    the same position: (warps - 1) x fragments per warp + 1 fragments along each axis."""
    rows, cols, _ = _tile(config)
    if config["store"]:
        (_, warps_i, frags_i), (_, warps_j, frags_j) = config["tile_i"], config["tile_j"]
        rows = ((warps_i - 1) * frags_i + 1) * FRAGMENT
        cols = ((warps_j - 1) * frags_j + 1) * FRAGMENT
    return rows * cols * 4


def _spread(sch: Any, block: Any, warps: int, vector: int) -> None:
    """All the block's threads copy `block`'s 2-D tile (of A, B or C, whatever the layout of
    the buffer it reads or writes): its two loops fused, split over ``threadIdx.y`` (warps) and
    ``threadIdx.x`` (lanes), `vector` consecutive elements each."""
    fused = sch.fuse(*sch.get_loops(block)[-2:])
    _, ty, tx, lanes = sch.split(fused, [None, warps, WARP, vector])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if vector > 1:
        sch.vectorize(lanes)


def _fragments(sch: Any, block: Any) -> Any:
    """Cut `block`'s last two loops (whole numbers of 16x16 fragments) into a loop over fragments
    (rows, columns) and a 16x16 nest; returns the nest's outer loop, for `tensorize`."""
    rows, cols = sch.get_loops(block)[-2:]
    row_frag, row_16 = sch.split(rows, [None, FRAGMENT])
    col_frag, col_16 = sch.split(cols, [None, FRAGMENT])
    sch.reorder(row_frag, col_frag, row_16, col_16)
    return row_16
