"""CUDA 2D block/thread tiling for depthwise conv2d.

The structure of the depthwise-conv blog post's v1-v4 schedules (../shared/references/
tvm-depthwise-conv2d-gpu-blog.txt), widened into a tuning space like its AutoTVM section:

- (n, c) fused and bound to blockIdx.x; output rows y and columns x each split 3 ways
  [block, thread, inner]; the thread parts go to threadIdx.y / threadIdx.x;
- `fuse_blocks`: 1 fuses the y and x block loops onto blockIdx.y (v4), 0 binds them to
  blockIdx.y and blockIdx.z (v3 with a 2D grid);
- the kernel window ry / rx split 2 ways [outer, inner]; `reduce_inside` places the window's
  outer loops under the per-thread tile loops (1, v4's order) or right under the thread loops
  (0: every step of the window's outer loops sweeps the thread's whole tile);
- `cache_input`: stage the padded input tile, halo included, in shared memory, fetched by all
  threads of the block (coalesced), once per block (reduce_inside=1) or per outer window step
  (reduce_inside=0); `cache_output`: accumulate in registers and write each output once;
- `auto_unroll_max_step` in {0, 256, 1500} and `unroll_explicit` in {0, 1}, as TOPI's schedule.

Unit loops are not created (farm.core.templates.base.split_skipping_units), so the config
tile_y=(1, 16, 1), tile_x=(2, 16, 1), fuse_blocks=1, tile_ry=(7, 1), tile_rx=(7, 1), no caching,
no unrolling produces exactly the blog's v4 module for its 3x4x16x32, 7x7 case.
"""

from __future__ import annotations

from typing import Any

from farm.core.space import ChoiceKnob, Config, ConfigSpace, SplitKnob
from farm.core.targets import TargetSpec
from farm.core.templates.base import (
    CUDA_MAX_GRID_DIM,
    Template,
    annotate_unroll,
    cooperative_fetch,
    dtype_bytes,
    fold_epilogue,
    has_stage,
    new_schedule,
    prod,
    shared_memory_error,
    split_skipping_units,
)
from farm.core.workloads import Workload


class CudaDepthwise(Template, name="cuda.depthwise", kind="cuda", workloads=("depthwise_conv2d_nchw",)):
    def space(self, wl: Workload, target: TargetSpec) -> ConfigSpace:
        _, _, oh, ow, kh, kw = wl.compute_extents()
        return ConfigSpace([
            SplitKnob("tile_y", oh, 3),
            SplitKnob("tile_x", ow, 3),
            ChoiceKnob("fuse_blocks", [0, 1]),
            SplitKnob("tile_ry", kh, 2),
            SplitKnob("tile_rx", kw, 2),
            ChoiceKnob("reduce_inside", [0, 1]),
            ChoiceKnob("cache_input", [0, 1]),
            ChoiceKnob("cache_output", [0, 1]),
            ChoiceKnob("auto_unroll_max_step", [0, 256, 1500]),
            ChoiceKnob("unroll_explicit", [0, 1]),
        ])

    def check(self, wl: Workload, target: TargetSpec, config: Config) -> str | None:
        threads = config["tile_y"][1] * config["tile_x"][1]
        if threads > target.limit("max_threads_per_block"):
            return f"{threads} threads per block > {target.limit('max_threads_per_block')}"
        grid = _grid(wl, config)
        for dim, extent in grid.items():
            if extent > CUDA_MAX_GRID_DIM[dim]:
                return f"blockIdx.{dim} extent {extent} > {CUDA_MAX_GRID_DIM[dim]}"
        return shared_memory_error(_shared_bytes(wl, config), target)

    def schedule(self, wl: Workload, target: TargetSpec, config: Config) -> Any:
        sch = new_schedule(wl)
        block = sch.get_sblock(wl.stage("compute"))
        write_cache = sch.cache_write(block, 0, "local") if config["cache_output"] else None
        n, c, y, x, ry, rx = sch.get_loops(block)
        nc = sch.fuse(n, c)
        # Block and thread parts always exist (they are bound), the inner part only if > 1.
        by, ty, yi = split_skipping_units(sch, y, config["tile_y"], keep=(0, 1))
        bx, tx, xi = split_skipping_units(sch, x, config["tile_x"], keep=(0, 1))
        ryo, ryi = split_skipping_units(sch, ry, config["tile_ry"])
        rxo, rxi = split_skipping_units(sch, rx, config["tile_rx"])
        tile, reduce_outer = [yi, xi], [ryo, rxo]
        middle = tile + reduce_outer if config["reduce_inside"] else reduce_outer + tile
        sch.reorder(*[lp for lp in [nc, by, bx, ty, tx, *middle, ryi, rxi] if lp is not None])

        sch.bind(nc, "blockIdx.x")
        if config["fuse_blocks"]:
            block_loops = [sch.fuse(by, bx)]
            sch.bind(block_loops[0], "blockIdx.y")
        else:
            block_loops = [by, bx]
            sch.bind(by, "blockIdx.y")
            sch.bind(bx, "blockIdx.z")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        if write_cache is not None:
            sch.reverse_compute_at(write_cache, tx)
        fold_epilogue(sch, wl, write_cache, tx)

        if config["cache_input"]:
            # The padded tile is computed straight into shared memory (the padding predicate
            # is evaluated while fetching, not in the inner loop), under the last loop that
            # does not walk over the tile: the block loop, or the last outer window loop.
            if has_stage(sch, wl, "pad"):
                stage = sch.get_sblock(wl.stage("pad"))
                sch.set_scope(stage, 0, "shared")
            else:
                stage = sch.cache_read(block, 0, "shared")
            above = [block_loops[-1]] if config["reduce_inside"] else [tx, *reduce_outer]
            sch.compute_at(stage, [lp for lp in above if lp is not None][-1], preserve_unit_loops=True)
            threads = (config["tile_y"][1], config["tile_x"][1])
            cooperative_fetch(sch, stage, threads, ("y", "x"), threads_outer=False)
        elif has_stage(sch, wl, "pad"):
            sch.compute_inline(sch.get_sblock(wl.stage("pad")))

        annotate_unroll(sch, nc, config["auto_unroll_max_step"], config["unroll_explicit"])
        return sch


def _grid(wl: Workload, config: Config) -> dict[str, int]:
    """Blocks per grid dimension."""
    p = wl.p
    by, bx = config["tile_y"][0], config["tile_x"][0]
    blocks = {"x": p["N"] * p["C"] * p["multiplier"]}
    return {**blocks, "y": by * bx} if config["fuse_blocks"] else {**blocks, "y": by, "z": bx}


def _shared_bytes(wl: Workload, config: Config) -> int:
    """Shared memory of the staged input tile: the block's output tile's receptive field, over
    the whole window (staged once per block) or one inner window step (staged per outer step)."""
    if not config["cache_input"]:
        return 0
    s = wl.p["stride"]
    window_y = wl.p["KH"] if config["reduce_inside"] else config["tile_ry"][1]
    window_x = wl.p["KW"] if config["reduce_inside"] else config["tile_rx"][1]
    rows = (prod(config["tile_y"][1:]) - 1) * s + window_y
    cols = (prod(config["tile_x"][1:]) - 1) * s + window_x
    return rows * cols * dtype_bytes(wl.dtype)
