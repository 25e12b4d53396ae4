"""Hopper's warpgroup tensor cores (`wgmma`) for float16 matmul, float32 accumulators, on targets
whose arch is ``sm_90a``: the arch-specific variant of sm_90 that CUDA requires for wgmma, as the
farm does (``{"kind": "cuda", "arch": "sm_90a"}``; plain sm_90 keeps the portable WMMA template).

TVM 0.27's s_tir schedules cannot express wgmma (its tensor intrinsics stop at WMMA and
``mma.sync``); its TIRx script can: the kernel is written in it, with TIRx's PTX operations
(``T.ptx``: TMA copies, mbarriers, ``wgmma.mma_async``) and matrix descriptors, and lowered by
TVM's ``tirx`` pipeline (`base.TIR_PIPELINE_ATTR`). It has the structure of CUTLASS's Hopper
GEMMs (TMA, an mbarrier pipeline, wgmma; warp-specialised or not, as a knob), without their
persistent tile scheduling or thread-block clusters:

- a block computes a (64 x warpgroups x slices) x `block_n` tile of C. Each of its `warpgroups`
  warpgroups (128 threads) owns `slices` m64 row slices and issues, per 16-deep step of the
  reduction, one ``wgmma.mma_async.m64n{block_n}k16`` per slice, both operands read from shared
  memory through descriptors, the accumulators (block_n / 2 floats per thread and slice) in
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
- the tile order is grouped by `raster` block rows (neighbouring tiles share A and B tiles in
  L2), and the accumulators go straight from registers to C as half2 stores.

Every tile is whole (`check`): M, N and K must be multiples of the block's tile and of 64.
"""

from __future__ import annotations

from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace
from farm.core.targets import TargetSpec
from farm.core.templates.base import CUDA_MAX_GRID_DIM, TIR_PIPELINE_ATTR, Template, shared_memory_error
from farm.core.workloads import Workload

ARCH = "sm_90a"  # wgmma exists only in sm_90's arch-specific variant
WARPGROUP = 128  # threads
SLICE = 64  # rows of one wgmma (m64)
TILE_K = 64  # halves of a 128-byte swizzled row: one TMA box of A is (64, rows)
ATOM_N = 64  # columns of B per 128-byte swizzle atom (one TMA box)
STEP_K = 16  # the reduction depth of one wgmma
# A thread holds block_n / 2 float32 accumulators per slice; beyond 128 the registers for
# addresses and descriptors no longer fit under CUDA's 255 per thread.
MAX_ACCUMULATORS = 128
BLOCK_N = (64, 128, 192, 256)  # wgmma's N (multiples of 8 up to 256; whole 64-column atoms here)
STAGES = (2, 3, 4, 5, 6)
RASTER = (1, 4, 8, 16)
TILES_PER_BLOCK = (1, 2, 4, 8)  # 4096^3 at 128x256: 512 tiles, 128 blocks of 4 fill 132 SMs once
# 128-byte swizzle, in the encodings of CUtensorMapSwizzle and of TVM's descriptor helper.
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
BARRIER_BYTES = 8  # an mbarrier


class CudaWgmma(Template, name="cuda.wgmma", kind="cuda", workloads=("matmul",)):
    def applies(self, wl: Workload, target: TargetSpec) -> bool:
        return (target.arch == ARCH and wl.dtype == "float16"
                and all(wl.p[axis] % SLICE == 0 for axis in ("M", "N", "K")))

    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        return ConfigSpace([
            ChoiceKnob("warpgroups", [1, 2]),
            ChoiceKnob("slices", [1, 2]),  # m64 row slices per warpgroup
            ChoiceKnob("block_n", list(BLOCK_N)),
            ChoiceKnob("stages", list(STAGES)),
            ChoiceKnob("raster", list(RASTER)),
            ChoiceKnob("producer", [0, 1]),  # a warpgroup of its own loads the tiles (1)
            # > 1: persistent blocks. Added after the first exports, which meant 1.
            ChoiceKnob("tiles_per_block", list(TILES_PER_BLOCK), default=1),
        ])

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        if target.arch != ARCH:
            return f"wgmma needs {ARCH}, not {target.arch}"
        threads = WARPGROUP * (config["warpgroups"] + config["producer"])
        if threads > target.limit("max_threads_per_block"):
            return f"{threads} threads per block > {target.limit('max_threads_per_block')}"
        rows, cols = _block_tile(config)
        m, n, k = wl.p["M"], wl.p["N"], wl.p["K"]
        if m % rows or n % cols:
            return f"a {rows}x{cols} block tile does not divide the {m}x{n} output"
        tiles, per_block = m // rows * (n // cols), config["tiles_per_block"]
        if per_block > 1 and not config["producer"]:
            return "tiles_per_block > 1 needs producer=1 (the producer runs on into the next tile)"
        if per_block > tiles:
            return f"tiles_per_block={per_block} > the {tiles} tiles of C"
        if (blocks := -(-tiles // per_block)) > CUDA_MAX_GRID_DIM["x"]:
            return f"blockIdx.x extent {blocks} > {CUDA_MAX_GRID_DIM['x']}"
        if (m // rows) % min(config["raster"], m // rows):
            return f"groups of {config['raster']} block rows do not divide the {m // rows} block rows"
        if (accumulators := config["slices"] * cols // 2) > MAX_ACCUMULATORS:
            return f"{accumulators} accumulators per thread > {MAX_ACCUMULATORS}"
        if config["stages"] > k // TILE_K:
            return f"{config['stages']} stages > the reduction's {k // TILE_K} tiles of {TILE_K}"
        return shared_memory_error(2 * config["stages"] * BARRIER_BYTES, target, _tile_bytes(config))

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        """The kernel wrapped as a schedule (nothing left to schedule: the TIRx is the kernel)."""
        import tvm
        from tvm import s_tir

        func = _kernel(wl.p["M"], wl.p["N"], wl.p["K"], config)
        return s_tir.Schedule(tvm.IRModule({"main": func}).with_attr(TIR_PIPELINE_ATTR, "tirx"))


def _block_tile(config: Config) -> tuple[int, int]:
    """Rows and columns of C one block computes."""
    return SLICE * config["warpgroups"] * config["slices"], config["block_n"]


def _tile_bytes(config: Config) -> int:
    """Shared memory of the staged A and B tiles (one dynamic buffer)."""
    rows, cols = _block_tile(config)
    return config["stages"] * (rows + cols) * TILE_K * 2


def _kernel(M: int, N: int, K: int, config: Config) -> Any:
    """The TIRx PrimFunc of C[M, N] = A[M, K] @ B[K, N] (float16, float32 sums) for `config`."""
    from tvm.script import tirx as T

    warpgroups, slices, stages, producer = config["warpgroups"], config["slices"], config["stages"], config["producer"]
    bm, bn = _block_tile(config)
    consumers = WARPGROUP * warpgroups
    threads = consumers + WARPGROUP * producer
    acc_n = bn // 2  # accumulators per thread and slice
    atoms = bn // ATOM_N
    k_tiles = K // TILE_K
    blocks_m, blocks_n = M // bm, N // bn
    total = blocks_m * blocks_n  # tiles of C
    per_block = config["tiles_per_block"]
    grid = -(-total // per_block)
    group = min(config["raster"], blocks_m)
    width = group * blocks_n  # tiles in one group of `group` tile rows
    a_tile, b_tile = bm * TILE_K, bn * TILE_K  # halves per stage
    b_base = stages * a_tile  # the B tiles follow the A tiles in the one dynamic buffer
    tile_bytes = (a_tile + b_tile) * 2
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.f16.f16"
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    # Descriptor strides, in the 16-byte units they are encoded in. A (K-major, 128-byte swizzle):
    # 8-row core groups 1024 bytes apart (the leading offset is unused). B (N-major, read
    # transposed): 8-row core groups 1024 bytes apart, 64-column atoms TILE_K rows of 128 bytes apart.
    a_lead, a_stride = 1, 1024 // 16
    b_lead, b_stride = TILE_K * 128 // 16, 1024 // 16

    # A block's t-th tile of C is tile t * grid + pid; `it` = t * k_tiles + k counts a block's
    # reduction tiles across its tiles of C: the stage (it % stages) and the barriers' phases
    # (it // stages) run on from one tile of C to the next.

    # fmt: off
    @T.macro
    def load(smem, bars, a_map, b_map, block_m, block_n, k, stage):
        # (one thread) reduction tile k of A and B into `stage`, arriving on its full barrier with
        # the bytes to expect
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[stage]), T.uint32(tile_bytes))
        T.ptx[tma](T.address_of(smem[stage * a_tile]), T.address_of(a_map), k * TILE_K, block_m * bm,
                   T.address_of(bars[stage]))
        for atom in T.unroll(atoms):
            T.ptx[tma](T.address_of(smem[b_base + stage * b_tile + atom * TILE_K * ATOM_N]),
                       T.address_of(b_map), block_n * bn + atom * ATOM_N, k * TILE_K,
                       T.address_of(bars[stage]))

    @T.macro
    def produce(smem, bars, a_map, b_map, pid):
        # (one thread of the producer warpgroup) every reduction tile of the block's tiles of C,
        # each once every consumer is done with its stage's previous tile
        for t in T.serial(per_block):
            u = T.meta_var(t * grid + pid)
            if u < total:
                for k in T.serial(k_tiles):
                    it = T.meta_var(t * k_tiles + k)
                    if it >= stages:
                        T.cuda.mbarrier_wait(T.address_of(bars[stages + it % stages]), (it // stages - 1) % 2)
                    load(smem, bars, a_map, b_map, u // width * group + u % width % group, u % width // group,
                         k, it % stages)

    @T.macro
    def consume(smem, bars, a_map, b_map, acc, desc, C, pid, tx, warpgroup):
        # (every consumer thread) per tile of C, the reduction, tile by tile as the full barriers
        # complete, then the write-out
        for t in T.serial(per_block):
            u = T.meta_var(t * grid + pid)
            if u < total:
                block_m = T.meta_var(u // width * group + u % width % group)
                block_n = T.meta_var(u % width // group)
                for i in T.unroll(slices * acc_n):
                    acc[i] = T.float32(0)
                for k in T.serial(k_tiles):
                    it = T.meta_var(t * k_tiles + k)
                    stage = T.meta_var(it % stages)
                    T.cuda.mbarrier_wait(T.address_of(bars[stage]), it // stages % 2)
                    T.ptx.wgmma.fence.sync.aligned()
                    for step in T.unroll(TILE_K // STEP_K):
                        T.cuda.wgmma.encode_matrix_descriptor(
                            T.address_of(desc[1]), T.address_of(smem[b_base + stage * b_tile + step * STEP_K * ATOM_N]),
                            b_lead, b_stride, SWIZZLE_128B)
                        for s in T.unroll(slices):
                            T.cuda.wgmma.encode_matrix_descriptor(
                                T.address_of(desc[0]),
                                T.address_of(smem[stage * a_tile + (warpgroup * slices + s) * SLICE * TILE_K
                                                  + step * STEP_K]),
                                a_lead, a_stride, SWIZZLE_128B)
                            # D += A * B; scale A and B by 1; A K-major (0), B N-major, transposed (1).
                            T.ptx[wgmma](*[acc[s * acc_n + r] for r in range(acc_n)], desc[0], desc[1],
                                         T.bool(True), 1, 1, 0, 1)
                    T.ptx.wgmma.commit_group.sync.aligned()
                    T.ptx.wgmma.wait_group.sync.aligned(1)  # this warpgroup is done with tile k - 1
                    if producer == 1:
                        if k >= 1:  # tell the producer (the empty barrier counts every consumer thread)
                            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[stages + (it - 1) % stages]))
                    else:
                        T.cuda.cta_sync()  # ... and so is every warpgroup: thread 0 reloads its stage
                        if tx == 0 and k >= 1 and k - 1 + stages < k_tiles:
                            load(smem, bars, a_map, b_map, block_m, block_n, k - 1 + stages, (k - 1) % stages)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                if producer == 1:  # the last reduction tile's stage, free for the next tile of C
                    T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[stages + (t * k_tiles + k_tiles - 1) % stages]))
                # The m64nNk16 accumulator layout: warp w of a warpgroup holds rows 16w + lane / 4
                # (+ 8), columns 8j + 2 (lane % 4) (+ 1), as registers 4j + (0, 1) and (2, 3).
                for s in T.unroll(slices):
                    for j in T.unroll(bn // 8):
                        for half in T.unroll(2):
                            for c in T.vectorized(2):
                                C[block_m * bm + (warpgroup * slices + s) * SLICE + tx % WARPGROUP // 32 * 16
                                  + tx % 32 // 4 + half * 8,
                                  block_n * bn + j * 8 + tx % 4 * 2 + c] = T.Cast(
                                    "float16", acc[s * acc_n + j * 4 + half * 2 + c])

    @T.prim_func
    def main(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        T.func_attr({"global_symbol": "main"})
        A = T.match_buffer(a_handle, (M, K), "float16", align=16)
        B = T.match_buffer(b_handle, (K, N), "float16", align=16)
        C = T.match_buffer(c_handle, (M, N), "float16", align=16)
        # Tensor maps: (dims innermost first, row stride in bytes, box, element strides,
        # interleave, swizzle, L2 promotion, out-of-bounds fill).
        a_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", a_map, "float16", 2, A.data, K, M, K * 2,
                      TILE_K, bm, 1, 1, 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)
        b_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", b_map, "float16", 2, B.data, N, K, N * 2,
                      ATOM_N, TILE_K, 1, 1, 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)

        T.device_entry()
        pid = T.cta_id([grid])
        tx = T.thread_id([threads])
        smem = T.alloc_buffer((stages * (a_tile + b_tile),), "float16", scope="shared.dyn", align=1024)
        # A full barrier per stage (TMA's bytes landed), then, with a producer, an empty one (every
        # consumer is done with the stage).
        bars = T.alloc_buffer((2 * stages,), "uint64", scope="shared", align=8)
        acc = T.alloc_buffer((slices * acc_n,), "float32", scope="local")
        desc = T.alloc_buffer((2,), "uint64", scope="local")  # A's and B's matrix descriptors

        if tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[stages + s]), T.uint32(consumers))
        T.ptx.fence.proxy.async_.shared__cta()  # the barriers, initialised, before TMA uses them
        T.cuda.cta_sync()
        if producer == 1:
            # Warpgroup 0 produces (its thread 0 issues every load); the other warpgroups consume.
            if tx < WARPGROUP:
                if tx == 0:
                    produce(smem, bars, a_map, b_map, pid)
            else:
                consume(smem, bars, a_map, b_map, acc, desc, C, pid, tx, tx // WARPGROUP - 1)
        else:
            if tx == 0:  # one tile of C per block (check): its first `stages` reduction tiles
                for s in T.unroll(stages):
                    load(smem, bars, a_map, b_map, pid // width * group + pid % width % group, pid % width // group,
                         s, s)
            consume(smem, bars, a_map, b_map, acc, desc, C, pid, tx, tx // WARPGROUP)
    # fmt: on

    return main
