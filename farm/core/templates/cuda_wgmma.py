"""Hopper's warpgroup tensor cores (`wgmma`) for float16 matmul, float32 accumulators, on targets
whose arch is ``sm_90a``: the arch-specific variant of sm_90 that CUDA requires for wgmma, as the
farm does (``{"kind": "cuda", "arch": "sm_90a"}``; plain sm_90 keeps the portable WMMA template).

TVM 0.27's s_tir schedules cannot express wgmma (its tensor intrinsics stop at WMMA and
``mma.sync``); its TIRx script can: the kernel is written in it, with TIRx's PTX operations
(``T.ptx``: TMA copies, mbarriers, ``wgmma.mma_async``) and matrix descriptors, and lowered by
TVM's ``tirx`` pipeline (`base.TIR_PIPELINE_ATTR`). It has the structure of CUTLASS's Hopper
GEMMs (TMA, an mbarrier pipeline, wgmma; warp-specialised or not, persistent or not, in
clusters of two CTAs or one, as knobs), without their stream-K scheduling or ping-pong consumers:

- a block computes a (64 x warpgroups x slices) x `block_n` tile of C. Each of its `warpgroups`
  warpgroups (128 threads) owns `slices` m64 row slices and issues, per 16-deep step of the
  reduction, one ``wgmma.mma_async.m64n{block_n}k16`` per slice, both operands read from shared
  memory through descriptors (encoded once, then offset), the accumulators (block_n / 2 floats per thread and slice) in
  registers;
- the reduction goes in tiles of K = 64 halves (one 128-byte row of A), `stages` tiles deep:
  one thread loads each tile with TMA (``cp.async.bulk.tensor``; one box of A, one per 64-column
  atom of B), 128-byte swizzled, so the tiles land in exactly the canonical layouts the
  descriptors name (A K-major; B N-major, read transposed), and arrives on the stage's "full"
  mbarrier with the bytes to expect. Every consumer thread waits on that barrier (parity = use
  count mod 2), runs the tile's wgmmas, commits them and waits for the previous tile's group,
  so one group stays in flight;
- the previous tile's stage is then refilled with the tile `stages` ahead, as `producer` says:
  0, thread 0 (a consumer too) does it after a block barrier (every warpgroup is done with that
  tile); 1, a warpgroup of its own (CUTLASS's warp-specialised kernels) waits for the stage's
  "empty" mbarrier, on which every consumer thread arrives once done with it, and no block
  barrier stalls the consumers;
- the tensor maps are encoded on the host at each call (``runtime.cuTensorMapEncodeTiled``, a
  few microseconds of CPU that overlap the previous launch in timed runs);
- with a producer, a block may compute `tiles_per_block` tiles of C one after the other
  (persistent, as CUTLASS's Hopper GEMMs are): the producer runs on into the next tile's loads
  while the consumers write the last one out, so neither the pipeline's fill nor the write-out
  stalls the tensor cores between tiles. The grid is then the tiles / `tiles_per_block`, block b
  taking tiles b, b + grid, ... (at any moment the blocks work on neighbouring tiles, as one
  launch of one tile per block would);
- with `cluster` 2, CTAs go in thread-block clusters of two that compute two tiles of C one
  above the other: each loads its own A rows, but only half of the B tile they share, which TMA
  multicasts into both CTAs' shared memory (half of B's traffic from L2, as CUTLASS's 2x1
  clusters). A stage is refilled once the consumers of both CTAs are done with it: each
  consumer warp arrives on both CTAs' empty barriers (remote arrives through `mapa`);
- the tile order is grouped by `raster` block rows (neighbouring tiles share A and B tiles in
  L2), and the accumulators go from registers to C, as `store` says: 0, as half2 stores (4 bytes,
  half a sector of each of a warp's 8 rows); 1 (a matmul's), as 16-byte stores, each quad of lanes
  first transposing its half2s with shuffles so that a lane holds 8 adjacent columns; 2 (a
  matmul's), those 16 bytes into a staging tile in shared memory (a warpgroup's 64 rows, in
  128-byte swizzled 64-column atoms as TMA's boxes lie), then TMA stores of the atoms by one
  thread of the warpgroup, as cuBLAS's Hopper kernels write C: the stores run while the
  consumers go on to the next tile's wgmmas, and their thread waits for them to have read the
  staging tile only before it is written again.

A conv2d (NCHW, groups 1) is the matrix product C[f, p] = W[f, k] X[k, p] of `cuda.tensorcore`'s
module doc: A is the kernel as it lies in memory (CO x K, K = CI*KH*KW, loaded by TMA as a
matmul's A), and B is the im2col view of the input, which no TMA box describes (a 3x3 window's
shifts leave its rows unaligned). So the producer warpgroup (or two: `producer`) gathers each B
tile itself, element by element from the NCHW input (zeros in the padding and past the last
pixel), into the layout TMA would have written (128-byte swizzled 64-column atoms), fences the
writes for the async proxy that wgmma reads through and arrives on the stage's full barrier with
all its threads (thread 0 also arrives with A's bytes to expect). Column p of C is output pixel
(n, y, x) = (p // (OH*OW), p % (OH*OW) // OW, p % OW), stored one half at a time, and the pixels
need not fill the last tile: the gathers and stores stop at N*OH*OW. A block's gathers (2-byte
loads with their index arithmetic) are issued by 4 or 8 warps and may outlast its wgmmas; cuDNN
transposes the input to NHWC first instead. Each thread loads a batch of elements into registers
from clamped positions, unconditionally, before it stores any: loads under the padding's branch
went to L2 one at a time, and the first kernels run were several times slower than WMMA's
(docs/defaults.md#wgmma-convolutions).

Every tile is whole (`check`): a matmul's M, N and K, a convolution's CO and K, must be
multiples of the block's tile and of 64.
"""

from __future__ import annotations

import math
from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace
from farm.core.targets import TargetSpec
from farm.core.templates.base import CUDA_MAX_GRID_DIM, TIR_PIPELINE_ATTR, Template, shared_memory_error
from farm.core.templates.cuda_tensorcore import gemm_extents
from farm.core.workloads import Workload

ARCH = "sm_90a"  # wgmma exists only in sm_90's arch-specific variant
WARPGROUP = 128  # threads
SLICE = 64  # rows of one wgmma (m64)
TILE_K = 64  # halves of a 128-byte swizzled row: one TMA box of A is (64, rows)
ATOM_N = 64  # columns of B per 128-byte swizzle atom (one TMA box)
STEP_K = 16  # the reduction depth of one wgmma
GATHER_BATCH = 32  # a convolution's producer threads' loads in flight at once (at most; powers of 2)
# A thread holds block_n / 2 float32 accumulators per slice; beyond 128 the registers for
# addresses and descriptors no longer fit under CUDA's 255 per thread.
MAX_ACCUMULATORS = 128
# Each of a block's threads gets at most REGISTER_FILE / threads registers (its launch bounds);
# wgmma's accumulators cannot be spilled. Registers a thread needs besides its accumulators, from
# ptxas (CUDA 13, sm_90a, 8x256x14x14 3x3 conv and 1024^3 matmul, stages=3): a matmul's used 154
# with 128 accumulators. A convolution's gathers (a batch staged in registers, their index
# arithmetic) take more: unbounded (256 threads), 104, 178 and 205 registers for 64, 96 and 128
# accumulators; bounded, 384 threads (at most 168 each) fit 96 accumulators in 167 registers and
# spilled 96 bytes with 128, and 512 threads (128 each) fit 64 accumulators in 95 registers,
# spilled 48 bytes with 96 and failed (ptxas fatal) with 128. The allowance below separates the
# configs that fit from those that did not.
REGISTER_FILE = 65536
MAX_REGISTERS = 255
OTHER_REGISTERS = {"gathered": 64, "tma": 26}
BLOCK_N = (64, 128, 192, 256)  # wgmma's N (multiples of 8 up to 256; whole 64-column atoms here)
STAGES = (2, 3, 4, 5, 6)
RASTER = (1, 4, 8, 16)
TILES_PER_BLOCK = (1, 2, 4, 8)  # 4096^3 at 128x256: 512 tiles, 128 blocks of 4 fill 132 SMs once
CLUSTER = (1, 2)  # CTAs per thread-block cluster (along M: they share B)
# A matmul's write-out: half2 stores; 16-byte stores of quad-transposed half2s; or those into shared
# memory and TMA stores from there.
STORES = (0, 1, 2)
# 128-byte swizzle, in the encodings of CUtensorMapSwizzle and of TVM's descriptor helper.
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
BARRIER_BYTES = 8  # an mbarrier
FULL_WARP = 0xFFFFFFFF  # a shuffle's mask of lanes: all 32
DESCRIPTOR_UNIT = 8  # halves per 16 bytes, the unit of a matrix descriptor's start address


class CudaWgmma(Template, name="cuda.wgmma", kind="cuda", workloads=("matmul", "conv2d_nchw")):
    def applies(self, wl: Workload, target: TargetSpec) -> bool:
        # Its kernels are written in TIRx, not scheduled from the workload's function: a TIR
        # kernel's elementwise stages (farm.core.fused) would be lost.
        if target.arch != ARCH or wl.dtype != "float16" or hasattr(wl, "prepare"):
            return False
        m, n, k = gemm_extents(wl)
        if _gathered(wl):  # any number of pixels (the last tile may be partial), at least one atom's
            return m % SLICE == 0 and k % TILE_K == 0 and n >= ATOM_N
        return m % SLICE == 0 and n % SLICE == 0 and k % SLICE == 0

    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        return ConfigSpace([
            ChoiceKnob("warpgroups", [1, 2]),
            ChoiceKnob("slices", [1, 2]),  # m64 row slices per warpgroup
            ChoiceKnob("block_n", list(BLOCK_N)),
            ChoiceKnob("stages", list(STAGES)),
            ChoiceKnob("raster", list(RASTER)),
            # 1: a warpgroup of its own loads the tiles; a convolution's gathers may take two.
            ChoiceKnob("producer", [1, 2] if _gathered(wl) else [0, 1]),
            # > 1: persistent blocks. Added after the first exports, which meant 1.
            ChoiceKnob("tiles_per_block", list(TILES_PER_BLOCK), default=1),
            # 2: CTA pairs that share their B tiles through TMA multicast. Added later, like the above.
            ChoiceKnob("cluster", list(CLUSTER), default=1),
            # How a matmul's C is written (`_kernel`): 0, 4-byte stores straight from the accumulators;
            # 1, 16-byte stores after a transpose within each quad of lanes; 2, those into shared
            # memory, then TMA stores. Added later, like the above.
            ChoiceKnob("store", [0] if _gathered(wl) else list(STORES), default=0),
        ])

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        if target.arch != ARCH:
            return f"wgmma needs {ARCH}, not {target.arch}"
        threads = WARPGROUP * (config["warpgroups"] + config["producer"])
        if threads > target.limit("max_threads_per_block"):
            return f"{threads} threads per block > {target.limit('max_threads_per_block')}"
        rows, cols = _block_tile(config)
        m, n, k = gemm_extents(wl)
        gathered = _gathered(wl)
        if m % rows or (n % cols and not gathered):
            return f"a {rows}x{cols} block tile does not divide the {m}x{n} output"
        per_block, cluster = config["tiles_per_block"], config["cluster"]
        if gathered and cluster > 1:
            return "a convolution's B tiles are gathered by each CTA, not multicast: cluster=1"
        if gathered and config["slices"] > 1:
            # ptxas serialised the wgmmas (C7514: "non wgmma instructions reading accumulator
            # registers") of every convolution tried with two slices, and of none with one.
            return "a convolution's wgmmas are serialised with slices=2: slices=1"
        if (per_block > 1 or cluster > 1) and not config["producer"]:
            return "tiles_per_block > 1 and clusters need producer=1 (a producer warpgroup paces the loads)"
        if (m // rows) % cluster:
            return f"clusters of {cluster} block rows do not divide the {m // rows} block rows"
        cluster_rows = m // rows // cluster
        tiles = cluster_rows * -(-n // cols)  # of clusters
        if per_block > tiles:
            return f"tiles_per_block={per_block} > the {tiles} tiles of C per CTA of a cluster"
        if (blocks := -(-tiles // per_block) * cluster) > CUDA_MAX_GRID_DIM["x"]:
            return f"blockIdx.x extent {blocks} > {CUDA_MAX_GRID_DIM['x']}"
        if cluster_rows % min(config["raster"], cluster_rows):
            return f"groups of {config['raster']} rows do not divide the {cluster_rows} rows of cluster tiles"
        if (accumulators := config["slices"] * cols // 2) > MAX_ACCUMULATORS:
            return f"{accumulators} accumulators per thread > {MAX_ACCUMULATORS}"
        needed = accumulators + OTHER_REGISTERS["gathered" if gathered else "tma"]
        if needed > (available := min(MAX_REGISTERS, REGISTER_FILE // threads)):
            return (f"{accumulators} accumulators and the rest need about {needed} registers per thread, "
                    f"> the {available} each of {threads} threads gets (ptxas would spill them or fail)")
        if config["stages"] > k // TILE_K:
            return f"{config['stages']} stages > the reduction's {k // TILE_K} tiles of {TILE_K}"
        return shared_memory_error(2 * config["stages"] * BARRIER_BYTES, target, _tile_bytes(config))

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        """The kernel wrapped as a schedule (nothing left to schedule: the TIRx is the kernel)."""
        import tvm
        from tvm import s_tir

        func = _kernel(wl, config)
        return s_tir.Schedule(tvm.IRModule({"main": func}).with_attr(TIR_PIPELINE_ATTR, "tirx"))


def _gathered(wl: Workload) -> bool:
    """Whether B's tiles are gathered by the producer (a convolution) rather than loaded by TMA."""
    return wl.name == "conv2d_nchw"


def _block_tile(config: Config) -> tuple[int, int]:
    """Rows and columns of C one block computes."""
    return SLICE * config["warpgroups"] * config["slices"], config["block_n"]


def _gather_batches(block_n: int, gatherers: int) -> tuple[int, int]:
    """How each of a convolution's `gatherers` threads gathers its share of a B tile (TILE_K x
    `block_n` elements, 16 to 128 each): (elements per batch, batches). A batch is the largest
    power of two up to GATHER_BATCH that divides the share, so the batches cover every element
    (with 256 gatherers and block_n 192, batches of 32 left 16 of each thread's 48 ungathered)."""
    each = TILE_K * block_n // max(1, gatherers)
    batch = math.gcd(GATHER_BATCH, each)
    return batch, each // batch


def _tile_bytes(config: Config) -> int:
    """Shared memory of the staged A and B tiles and, with `store` 2, of each consumer warpgroup's
    staging tile of C (one dynamic buffer)."""
    rows, cols = _block_tile(config)
    return (config["stages"] * (rows + cols) * TILE_K + _staging_halves(config)) * 2


def _staging_halves(config: Config) -> int:
    """Halves of shared memory the consumer warpgroups stage C in before TMA stores it (`store` 2):
    64 rows of the block's columns each."""
    return config["warpgroups"] * SLICE * config["block_n"] if config["store"] == 2 else 0


def _kernel(wl: Workload, config: Config) -> Any:
    """The TIRx PrimFunc of C[M, N] = A[M, K] @ B[K, N] (float16, float32 sums) for `config`: a
    matmul's, or a convolution's (module doc: its B gathered, its C the NCHW output)."""
    from tvm.script import tirx as T

    M, N, K = gemm_extents(wl)
    gathered = _gathered(wl)
    warpgroups, slices, stages, producer = config["warpgroups"], config["slices"], config["stages"], config["producer"]
    bm, bn = _block_tile(config)
    consumers = WARPGROUP * warpgroups
    threads = consumers + WARPGROUP * producer
    acc_n = bn // 2  # accumulators per thread and slice
    atoms = bn // ATOM_N
    k_tiles = K // TILE_K
    cluster, per_block, store = config["cluster"], config["tiles_per_block"], config["store"]
    blocks_m, blocks_n = M // bm, -(-N // bn)  # a convolution's last column of tiles may be partial
    # The unit of work is a cluster's tile: `cluster` tiles of C one above the other, which share
    # their B tiles. Each CTA of the cluster computes one of them (its `rank`-th).
    rows = blocks_m // cluster  # rows of cluster tiles
    total = rows * blocks_n  # cluster tiles
    grid = -(-total // per_block)  # clusters
    group = min(config["raster"], rows)
    width = group * blocks_n  # cluster tiles in one group of `group` rows
    a_tile, b_tile = bm * TILE_K, bn * TILE_K  # halves per stage
    b_base = stages * a_tile  # the B tiles follow the A tiles in the one dynamic buffer
    c_base = stages * (a_tile + b_tile)  # then, with store 2, each consumer warpgroup's staging tile of C
    smem_halves = c_base + _staging_halves(config)
    b_rows = TILE_K // cluster  # rows of each B atom one CTA loads, for every CTA of its cluster
    everyone = (1 << cluster) - 1  # the multicast's CTA mask
    # What TMA lands in each CTA per stage: A and B, or A alone where the producer gathers B, whose
    # threads (128 per producer warpgroup) then arrive on the full barrier too (besides thread 0's
    # arrival with the bytes).
    tile_bytes = (a_tile + (0 if gathered else b_tile)) * 2
    gatherers = WARPGROUP * producer if gathered else 0  # the producer warpgroups' threads
    full_arrivals = 1 + gatherers
    batch, batches = _gather_batches(bn, gatherers)
    # A stage is free once every consumer warp of every CTA of the cluster is done with it (each
    # CTA's producer writes into all of them): lane 0 of each arrives on each CTA's empty barrier.
    releases = consumers // 32 * cluster
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.f16.f16"
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    tma_store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
    # B's loads: plain, or multicast to every CTA of the cluster (with its CTA mask); and the wait
    # for an empty barrier, at cluster scope where the other CTA's consumers arrive on it.
    b_load, b_mask = (tma, []) if cluster == 1 else (tma + ".multicast::cluster", [T.uint16(everyone)])
    wait_empty = T.cuda.mbarrier_wait if cluster == 1 else T.cuda.mbarrier_wait_acquire_cluster
    # Descriptor strides, in the 16-byte units they are encoded in. A (K-major, 128-byte swizzle):
    # 8-row core groups 1024 bytes apart (the leading offset is unused). B (N-major, read
    # transposed): 8-row core groups 1024 bytes apart, 64-column atoms TILE_K rows of 128 bytes apart.
    a_lead, a_stride = 1, 1024 // 16
    b_lead, b_stride = TILE_K * 128 // 16, 1024 // 16

    # A cluster's t-th cluster tile is t * grid + its index; `it` = t * k_tiles + k counts a
    # block's reduction tiles across its tiles of C: the stage (it % stages) and the barriers'
    # phases (it // stages) run on from one tile of C to the next.

    def tile_row(u: Any) -> Any:
        """Cluster tile u's row: tiles go in groups of `group` rows, column by column in a group."""
        return u // width * group + u % width % group

    def tile_col(u: Any) -> Any:
        return u % width // group

    def loads(tx: Any) -> Any:
        """Whether producer thread tx loads: thread 0 issues every TMA load; where B is
        gathered, every thread of the producer warpgroups gathers."""
        return True if gathered else tx == 0

    if gathered:  # the convolution's geometry, for the gathers and the NCHW stores
        _, _, in_h, in_w = wl.input_shapes()[0]
        out_w = wl.output_shape()[3]
        kh, kw = wl.p["KH"], wl.p["KW"]
        stride, pad, dilation = wl.p["stride"], wl.p["pad"], wl.p["dilation"]
        pixels = wl.output_shape()[2] * out_w  # OH * OW, one image's columns of C
        images = wl.p["N"]

    def window(u: Any, k: Any, e: Any) -> tuple[Any, ...]:
        """Element e of B's reduction tile k of cluster tile u: its row and column in the tile
        (e // bn, e % bn), its pixel p (N or more past the last pixel, where the last tile is
        partial), and the input's channel, row and column it reads (rows and columns outside
        the input in the padding)."""
        r, col = e // bn, e % bn
        red, p = k * TILE_K + r, tile_col(u) * bn + col
        return (r, col, p, red // (kh * kw), p % pixels // out_w * stride + red % (kh * kw) // kw * dilation - pad,
                p % out_w * stride + red % kw * dilation - pad)

    def out_row(block_m: Any, s: Any, half: Any, tx: Any, warpgroup: Any) -> Any:
        """The row of C of a consumer thread's accumulators of slice s, half 0 or 1: in the m64nNk16
        accumulator layout, warp w of a warpgroup holds rows 16w + lane / 4 (+ 8), columns
        8j + 2 (lane % 4) (+ 1), as registers 4j + (0, 1) and (2, 3)."""
        return (block_m * bm + (warpgroup * slices + s) * SLICE + tx % WARPGROUP // 32 * 16 + tx % 32 // 4
                + half * 8)

    def half2(low: Any, high: Any) -> Any:
        """Two floats as the halves of a 32-bit word, `low` in its low bits (as half2 stores them)."""
        def bits(x: Any) -> Any:
            return T.Cast("uint32", T.reinterpret("uint16", T.Cast("float16", x)))
        return T.bitwise_or(bits(low), T.shift_left(bits(high), T.uint32(16)))

    def swizzled(rows: int, r: Any, col: Any) -> Any:
        """Element (r, col)'s offset, in halves, in a tile laid out as TMA lays out its boxes with the
        128-byte swizzle: 64-column atoms of `rows` rows one after another, each 1024-byte aligned,
        and in row r the 16-byte chunk col % 64 // 8 swizzled with r % 8."""
        return (col // ATOM_N * rows * ATOM_N + r * ATOM_N + T.bitwise_xor(col % ATOM_N // 8, r % 8) * 8
                + col % 8)

    def moved(descriptor: Any, halves: Any) -> Any:
        """`descriptor` with its start address moved by `halves` (a multiple of 8): its low word plus
        the 16-byte units, in 32 bits (the address stays in its 14-bit field; the high word, the
        layout and stride, is the same), so the compiler adds one 32-bit integer and keeps the
        high word, not a 64-bit sum with its carry."""
        high = T.shift_left(T.shift_right(descriptor, T.uint64(32)), T.uint64(32))
        return T.bitwise_or(high, T.Cast("uint64", T.Cast("uint32", descriptor)
                                         + T.Cast("uint32", halves // DESCRIPTOR_UNIT)))

    # fmt: off
    @T.macro
    def load_a(smem, bars, a_map, u, k, stage, rank):
        # (one thread per CTA) arrive on the stage's full barrier with the bytes to expect (its own
        # A, and all of B from the whole cluster where TMA loads B), and load A's rows of the CTA
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[stage]), T.uint32(tile_bytes))
        T.ptx[tma](T.address_of(smem[stage * a_tile]), T.address_of(a_map), k * TILE_K,
                   (tile_row(u) * cluster + rank) * bm, T.address_of(bars[stage]))

    @T.macro
    def gather(smem, X, u, k, stage, tx):
        # (every producer thread) B's reduction tile k of cluster tile u into `stage`, from the
        # input X: element (r, col) is X's window value for reduction index k * 64 + r (channel,
        # ky, kx) and pixel tile_col(u) * bn + col (image, y, x), zero in the padding and past the
        # last pixel. It goes where TMA's box would put it: atom col // 64, row r, 16-byte chunk
        # col % 64 // 8 swizzled with r % 8 (the 128-byte swizzle of a 1024-byte aligned atom).
        # GATHER_BATCH loads in flight at once per thread: all of a batch's loads first, into
        # registers, then its stores. Each load reads a clamped position, inside X whatever the
        # window, so that no load is conditional: a load under a branch is issued only once the
        # store before it has its value, and the loads then waited for L2 one after another
        # (docs/defaults.md#wgmma-convolutions).
        # The padding's zeros are selected in the second pass.
        staged = T.alloc_buffer((batch,), "float16", scope="local")
        for b in T.serial(batches):
            for i in T.unroll(batch):
                r, col, p, channel, iy, ix = T.meta_var(window(u, k, (b * batch + i) * gatherers + tx))
                staged[i] = X[T.min(p // pixels, images - 1), channel, T.max(T.min(iy, in_h - 1), 0),
                              T.max(T.min(ix, in_w - 1), 0)]
            for i in T.unroll(batch):
                r, col, p, channel, iy, ix = T.meta_var(window(u, k, (b * batch + i) * gatherers + tx))
                smem[b_base + stage * b_tile + swizzled(TILE_K, r, col)] = T.if_then_else(
                    p < N and 0 <= iy and iy < in_h and 0 <= ix and ix < in_w, staged[i], T.float16(0))

    @T.macro
    def load(smem, bars, a_map, b_src, u, k, stage, rank, tx):
        # reduction tile k of cluster tile u into `stage`: by one thread per CTA, A's rows and
        # its share of B's for every CTA of the cluster, through TMA; where B is gathered, by
        # every producer thread (thread 0 loading A), each fencing its writes for wgmma's async
        # proxy before it arrives
        if gathered:
            if tx == 0:
                load_a(smem, bars, a_map, u, k, stage, rank)
            gather(smem, b_src, u, k, stage, tx)
            T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[stage]))
        else:
            load_a(smem, bars, a_map, u, k, stage, rank)
            for atom in T.unroll(atoms):
                T.ptx[b_load](T.address_of(smem[b_base + stage * b_tile + atom * TILE_K * ATOM_N
                                                + rank * b_rows * ATOM_N]),
                              T.address_of(b_src), tile_col(u) * bn + atom * ATOM_N, k * TILE_K + rank * b_rows,
                              T.address_of(bars[stage]), *b_mask)

    @T.macro
    def release(bars, remote, stage, tx, rank):
        # (every consumer thread, its warpgroup past wgmma.wait_group) this warp is done with `stage`
        if tx % 32 == 0:
            if cluster == 1:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[stages + stage]))
            else:  # its own CTA's barrier (a shared::cta address is one of the cluster's), then the other's
                T.ptx.mbarrier.arrive.release.cluster.shared__cluster.b64(T.address_of(bars[stages + stage]))
                T.ptx.mapa.shared__cluster.u32(
                    remote[0], T.cuda.cvta_generic_to_shared(T.address_of(bars[stages + stage])), T.uint32(1 - rank))
                T.ptx.mbarrier.arrive.release.cluster.shared__cluster.b64(remote[0])

    @T.macro
    def produce(smem, bars, a_map, b_src, c, rank, tx):
        # (one thread of the producer warpgroup; all of them where B is gathered) every reduction
        # tile of the block's tiles of C, each once the whole cluster is done with its stage's
        # previous tile
        for t in T.serial(per_block):
            u = T.meta_var(t * grid + c)
            if u < total:
                for k in T.serial(k_tiles):
                    it = T.meta_var(t * k_tiles + k)
                    if it >= stages:
                        wait_empty(T.address_of(bars[stages + it % stages]), (it // stages - 1) % 2)
                    load(smem, bars, a_map, b_src, u, k, it % stages, rank, tx)

    @T.macro
    def quad_transpose(words, exchanged, tx):
        # (every lane of a warp) the 4 x 4 words of each quad of lanes (4q .. 4q + 3), lane r's
        # word c to lane c's word r, in two exchanges: with the lane whose index differs in bit 0,
        # the words whose index differs from it in bit 0 (2 x 2 blocks transposed), then the same
        # for bit 1 (the blocks swapped)
        for bit in T.unroll(2):
            for i in T.unroll(2):
                mask = T.meta_var(1 << bit)
                low = T.meta_var(i * (2 - bit))  # the pairs (0, 1), (2, 3), then (0, 2), (1, 3)
                high = T.meta_var(low + mask)
                mine = T.meta_var(tx & mask != 0)
                exchanged[0] = T.cuda.__shfl_xor_sync(
                    T.uint32(FULL_WARP), T.if_then_else(mine, words[low], words[high]), mask, 32)
                words[low] = T.if_then_else(mine, exchanged[0], words[low])
                words[high] = T.if_then_else(mine, words[high], exchanged[0])

    @T.macro
    def consume(smem, bars, remote, a_map, b_src, c_map, acc, desc, words, exchanged, C, C2, staged, c, rank, tx,
                warpgroup):
        # (every consumer thread) per tile of C, the reduction, tile by tile as the full barriers
        # complete, then the write-out.
        # The descriptors are encoded once, for stage 0's first step (A's of each of this warpgroup's
        # slices, then B's), and offset for each stage and step: a descriptor's start address is
        # its low 14 bits, the shared address / 16, and every tile lies below 256 KB, so adding the
        # offset / 16 moves the descriptor as encoding the moved address would. Encoded anew for
        # every wgmma, the bit fields took several instructions each in the main loop, where
        # cuBLAS's kernel adds offsets (docs/defaults.md#wgmma-matmul).
        for s in T.unroll(slices):
            T.cuda.wgmma.encode_matrix_descriptor(
                T.address_of(desc[2 + s]), T.address_of(smem[(warpgroup * slices + s) * SLICE * TILE_K]),
                a_lead, a_stride, SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc[2 + slices]), T.address_of(smem[b_base]), b_lead, b_stride, SWIZZLE_128B)
        for t in T.serial(per_block):
            u = T.meta_var(t * grid + c)
            if u < total:
                block_m = T.meta_var(tile_row(u) * cluster + rank)
                block_n = T.meta_var(tile_col(u))
                for i in T.unroll(slices * acc_n):
                    acc[i] = T.float32(0)
                for k in T.serial(k_tiles):
                    it = T.meta_var(t * k_tiles + k)
                    stage = T.meta_var(it % stages)
                    T.cuda.mbarrier_wait(T.address_of(bars[stage]), it // stages % 2)
                    T.ptx.wgmma.fence.sync.aligned()
                    for step in T.unroll(TILE_K // STEP_K):
                        desc[1] = moved(desc[2 + slices], stage * b_tile + step * STEP_K * ATOM_N)
                        for s in T.unroll(slices):
                            desc[0] = moved(desc[2 + s], stage * a_tile + step * STEP_K)
                            # D += A * B; scale A and B by 1; A K-major (0), B N-major, transposed (1).
                            T.ptx[wgmma](*[acc[s * acc_n + r] for r in range(acc_n)], desc[0], desc[1],
                                         T.bool(True), 1, 1, 0, 1)
                    T.ptx.wgmma.commit_group.sync.aligned()
                    T.ptx.wgmma.wait_group.sync.aligned(1)  # this warpgroup is done with tile k - 1
                    if producer >= 1:
                        if k >= 1:
                            release(bars, remote, (it - 1) % stages, tx, rank)
                    else:
                        T.cuda.cta_sync()  # ... and so is every warpgroup: thread 0 reloads its stage
                        if tx == 0 and k >= 1 and k - 1 + stages < k_tiles:
                            load(smem, bars, a_map, b_src, u, k - 1 + stages, (k - 1) % stages, rank, tx)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                if producer >= 1:  # the last reduction tile's stage, free for the next tile of C
                    release(bars, remote, (t * k_tiles + k_tiles - 1) % stages, tx, rank)
                for s in T.unroll(slices):
                    if store >= 1:
                        staging = T.meta_var(c_base + warpgroup * SLICE * bn)  # (halves) this warpgroup's
                        if store == 2:  # the staging tile is free once TMA has read the last one out of it
                            if tx % WARPGROUP == 0:
                                T.ptx.cp.async_.bulk.wait_group.read(0)
                            # the warpgroup's own named barrier (barrier 0 is the block's)
                            T.ptx.bar.sync(T.Cast("uint32", 1 + warpgroup), T.uint32(WARPGROUP))
                        # Each group of 4 j: the quad's lanes hold 4 x 4 half2s (lane q has
                        # columns 8j + 2q, + 1 of each j); transposed, lane q has all 8 columns
                        # of j = 4 group + q, 16 contiguous bytes it stores at once. 4-byte stores
                        # covered half a 32-byte sector per row, and a tile's 64 per thread
                        # stalled the load/store queue (docs/defaults.md#wgmma-matmul).
                        for half in T.unroll(2):
                            for group in T.unroll(bn // 32):
                                for q in T.unroll(4):
                                    words[q] = half2(acc[s * acc_n + (group * 4 + q) * 4 + half * 2],
                                                     acc[s * acc_n + (group * 4 + q) * 4 + half * 2 + 1])
                                quad_transpose(words, exchanged, tx)
                                if store == 1:
                                    for w in T.vectorized(4):
                                        C2[out_row(block_m, s, half, tx, warpgroup),
                                           (block_n * bn + (group * 4 + tx % 4) * 8) // 2 + w] = words[w]
                                else:  # row r of the slice, its 8 columns from 8 (4 group + lane % 4),
                                    # where TMA's box of the 128-byte swizzle reads them
                                    r = T.meta_var(tx % WARPGROUP // 32 * 16 + tx % 32 // 4 + half * 8)
                                    for w in T.vectorized(4):
                                        staged[(staging + swizzled(SLICE, r, (group * 4 + tx % 4) * 8)) // 2
                                               + w] = words[w]
                        if store == 2:  # the writes, visible to TMA (the async proxy), then stored by it
                            T.ptx.fence.proxy.async_.shared__cta()
                            T.ptx.bar.sync(T.Cast("uint32", 1 + warpgroup), T.uint32(WARPGROUP))
                            if tx % WARPGROUP == 0:
                                for atom in T.unroll(atoms):
                                    T.ptx[tma_store](T.address_of(c_map), block_n * bn + atom * ATOM_N,
                                                     out_row(block_m, s, 0, 0, warpgroup),
                                                     T.address_of(smem[staging + atom * SLICE * ATOM_N]))
                                T.ptx.cp.async_.bulk.commit_group()
                    else:
                        for j in T.unroll(bn // 8):
                            for half in T.unroll(2):
                                row = T.meta_var(out_row(block_m, s, half, tx, warpgroup))
                                if gathered:  # column p is pixel p % pixels of image p // pixels, if any
                                    for c2 in T.unroll(2):
                                        p = T.meta_var(block_n * bn + j * 8 + tx % 4 * 2 + c2)
                                        if p < N:
                                            C[p // pixels, row, p % pixels // out_w, p % out_w] = T.Cast(
                                                "float16", acc[s * acc_n + j * 4 + half * 2 + c2])
                                else:
                                    for c2 in T.vectorized(2):
                                        C[row, block_n * bn + j * 8 + tx % 4 * 2 + c2] = T.Cast(
                                            "float16", acc[s * acc_n + j * 4 + half * 2 + c2])
        if store == 2:  # no block exits before TMA has written its last tile out of shared memory
            if tx % WARPGROUP == 0:
                T.ptx.cp.async_.bulk.wait_group(0)

    @T.prim_func
    def main(x_handle: T.handle, y_handle: T.handle, c_handle: T.handle) -> None:
        T.func_attr({"global_symbol": "main"})
        # The workload's arguments: a matmul's A, B and C; a convolution's input (B's source),
        # kernel (A: CO x K as it lies in memory) and output.
        if gathered:
            X = T.match_buffer(x_handle, wl.input_shapes()[0], "float16", align=16)
            A = T.match_buffer(y_handle, wl.input_shapes()[1], "float16", align=16)
            C = T.match_buffer(c_handle, wl.output_shape(), "float16", align=16)
            b_src = T.meta_var(X)
        else:
            A = T.match_buffer(x_handle, (M, K), "float16", align=16)
            B = T.match_buffer(y_handle, (K, N), "float16", align=16)
            C = T.match_buffer(c_handle, (M, N), "float16", align=16)
        if store == 1:  # C as pairs of halves, for the 16-byte stores of quad-transposed half2s
            C2 = T.decl_buffer((M, N // 2), "uint32", data=C.data, align=16)
        else:  # (a view of its own typed C's pointer uint* for every store; unused here)
            C2 = T.meta_var(C)
        # Tensor maps: (dims innermost first, row stride in bytes, box, element strides,
        # interleave, swizzle, L2 promotion, out-of-bounds fill).
        a_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", a_map, "float16", 2, A.data, K, M, K * 2,
                      TILE_K, bm, 1, 1, 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)
        if not gathered:
            b_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", b_map, "float16", 2, B.data, N, K, N * 2,
                          ATOM_N, b_rows, 1, 1, 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)
            b_src = T.meta_var(b_map)
        if store == 2:  # C's tensor map for TMA's stores: boxes of 64 rows of one 128-byte swizzled atom
            c_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", c_map, "float16", 2, C.data, N, M, N * 2,
                          ATOM_N, SLICE, 1, 1, 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)
        else:
            c_map = T.meta_var(a_map)  # (unused)

        T.device_entry()
        if cluster > 1:  # a cluster launch: CTAs 2c and 2c + 1 are cluster c's ranks 0 and 1
            T.cta_id_in_cluster([cluster])
        pid = T.cta_id([grid * cluster])
        # The rank in the cluster, as CUDA numbers a 1-D cluster's CTAs (%cluster_ctarank is the same,
        # but read through a volatile asm at each use, which costs registers that spill)
        rank = T.meta_var(pid % cluster)
        tx = T.thread_id([threads])
        smem = T.alloc_buffer((smem_halves,), "float16", scope="shared.dyn", align=1024)
        if store == 2:  # the staging tiles' 16-byte writes, as pairs of halves
            staged = T.decl_buffer((smem_halves // 2,), "uint32", data=smem.data, scope="shared.dyn", align=1024)
        else:
            staged = T.meta_var(smem)  # (unused)
        # A full barrier per stage (TMA's bytes landed), then, with a producer, an empty one (every
        # consumer warp of the cluster is done with the stage).
        bars = T.alloc_buffer((2 * stages,), "uint64", scope="shared", align=8)
        acc = T.alloc_buffer((slices * acc_n,), "float32", scope="local")
        # A's and B's matrix descriptors for the next wgmma, then those of stage 0's first step
        # (A's per slice, then B's) that they are offset from
        desc = T.alloc_buffer((3 + slices,), "uint64", scope="local")
        remote = T.alloc_buffer((1,), "uint32", scope="local")  # an empty barrier in a CTA of the cluster
        words = T.alloc_buffer((4,), "uint32", scope="local")  # a quad's half2s, as they are transposed
        exchanged = T.alloc_buffer((1,), "uint32", scope="local")  # the word a shuffle brought

        if tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(full_arrivals))
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[stages + s]), T.uint32(releases))
        T.ptx.fence.proxy.async_.shared__cta()  # the barriers, initialised, before TMA uses them
        if cluster > 1:  # ... and before the other CTAs of the cluster multicast or arrive on them
            T.ptx.fence.mbarrier_init.release.cluster()
            T.cuda.cluster_sync()
        else:
            T.cuda.cta_sync()
        if producer >= 1:
            # The first `producer` warpgroups produce (thread 0 issues every load, and all their
            # threads gather where B is gathered); the other warpgroups consume.
            if tx < WARPGROUP * producer:
                if loads(tx):
                    produce(smem, bars, a_map, b_src, pid // cluster, rank, tx)
            else:
                consume(smem, bars, remote, a_map, b_src, c_map, acc, desc, words, exchanged, C, C2, staged,
                        pid // cluster, rank, tx, tx // WARPGROUP - producer)
        else:
            if tx == 0:  # one tile of C per block, no cluster (check): its first `stages` reduction tiles
                for s in T.unroll(stages):
                    load(smem, bars, a_map, b_src, pid, s, s, rank, tx)
            consume(smem, bars, remote, a_map, b_src, c_map, acc, desc, words, exchanged, C, C2, staged, pid, rank,
                    tx, tx // WARPGROUP)
        if cluster > 1:  # no CTA leaves while the others may still multicast into it or arrive on it
            T.cuda.cluster_sync()
    # fmt: on

    return main
