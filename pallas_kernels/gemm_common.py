"""What the FP8 GEMM kernels share: their tiling, which shapes tile, the shared-memory
transforms of their tiles, and the per-row scales as their bounded TMA copies take them
(used by the single-device stream-K GEMM and the fused GEMM + all-reduce alike)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling of the FP8 GEMM kernels.

    A block computes a (tile_m, 2 * tile_n) output tile with two compute
    warpgroups side by side along N, streaming K in steps of tile_k through
    ``stages`` shared-memory buffers; epilogues write (epi_m, epi_n) sub-tiles.
    grid_minor_n, grid_tile_width: the order in which the fused kernel's persistent
    grid walks the output tiles (``plgpu.planar_snake``; the stream-K schedule deals out
    K steps instead).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 3
    epi_m: int = 64
    epi_n: int = 64
    grid_minor_n: bool = True
    grid_tile_width: int = 4


# Shared memory a Hopper block may take (H100 / H200: 227 KiB, the Mosaic GPU limit).
SMEM_LIMIT_BYTES = 232448
COMPUTE_WGS = 2  # compute warpgroups per block, side by side along N


def smem_bytes(config: Config, out_dtype, row_scales: bool = True, lead: bool = True) -> int:
    """Shared memory of one block of the stream-K GEMM kernel: the operand stages
    (x [tile_m, tile_k], w [2 tile_n, tile_k] e4m3 each), the output sub-tiles (2 per
    compute warpgroup, [epi_m, epi_n] of out_dtype), the barriers (8 bytes each), and the
    row scales of the block's M tile (float32; a second copy for a lead product). The
    upper bound over the options is the default (row scales and a lead)."""
    c = config
    operands = c.stages * (c.tile_m + COMPUTE_WGS * c.tile_n) * c.tile_k
    out = COMPUTE_WGS * 2 * c.epi_m * c.epi_n * jnp.dtype(out_dtype).itemsize
    barriers = 8 * (2 * c.stages + COMPUTE_WGS)
    rows = (4 * c.tile_m * (1 + lead) + 8) if row_scales else 0
    return operands + out + barriers + rows


def fitting_stages(config: Config, out_dtype, limit: int = SMEM_LIMIT_BYTES) -> Config:
    """config with the most stages (at most its own) whose block fits the shared memory:
    a 4-byte output's sub-tiles take the room of one operand stage."""
    while config.stages > 2 and smem_bytes(config, out_dtype) > limit:
        config = dataclasses.replace(config, stages=config.stages - 1)
    return config


def fits(k: int, n: int, config: Config = Config()) -> bool:
    """Whether a [*, K] x [N, K] product tiles with ``config`` (M is padded or bounded)."""
    return k % config.tile_k == 0 and n % (2 * config.tile_n) == 0


def smem_transforms(config: Config, out_dtype):
    """Shared-memory transforms of the GEMM kernels' tiles: (for the FP8 operand tiles
    [*, tile_k], for the output sub-tiles [epi_m, epi_n] of out_dtype), each a tiling to
    the swizzle's width then the swizzle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(config.tile_k * 8)  # FP8: one byte per element
    in_transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_bytes = jnp.dtype(out_dtype).itemsize
    out_swizzle = plgpu.find_swizzle(config.epi_n * out_bytes * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_bytes)),
                      plgpu.SwizzleTransform(out_swizzle))
    return in_transforms, out_transforms


def pad_row_scales(row_scale, rows: int, tile_m: int):
    """Per-row scales [R] (1 <= R <= rows) for x's ``rows`` rows as the kernels' bounded TMA
    copy of tile_m of them takes them: as they are when R >= min(tile_m, rows) (a tile's
    rows past R read zeros), else zero-padded to ``rows`` (a copy larger than its whole
    array is refused). Both GEMM kernels' launchers apply it."""
    if not (row_scale.ndim == 1 and 1 <= row_scale.shape[0] <= rows):
        raise ValueError(f"row_scale must be [R], 1 <= R <= {rows}, got {row_scale.shape}")
    r = row_scale.shape[0]
    row_scale = row_scale.astype(jnp.float32)
    return row_scale if r >= min(tile_m, rows) else jnp.pad(row_scale, (0, rows - r))
