"""FP8 GEMM on one layer of a stacked weight, read in place (Pallas Mosaic GPU), reference.

The generator runs its blocks under ``lax.scan`` with the FP8 weights stacked as
[L, N, K] float8_e4m3fn (K-major).  ``fp8_dot(x, w_stacked[layer])`` makes XLA slice
the layer out first, and since cuBLASLt (and any custom call) wants its operands as
buffers of their own, that slice is a device copy of the whole [N, K] weight per block
and pass.

Here the stack itself is the kernel's operand.  The layer index enters the kernel as a
[1] int32 array; the kernel reads it (clamped to [0, L), as ``lax.dynamic_slice``
does) and indexes the GMEM ref with it, ``w_ref.at[layer]``, before the TMA copies: the
TMA descriptor spans the whole stack and the layer becomes a coordinate of each copy.
Nothing of the weight is sliced or copied by XLA.

The kernel is ``fp8_gemm_stream_k``: a persistent grid (one block per SM) on the
stream-K schedule, two compute warpgroups side by side along N and one TMA warpgroup,
FP8 wgmma with the (N, K) weight tile transposed in shared memory, the scale applied to
the f32 accumulator in the epilogue, 64x64 sub-tiles stored by TMA.

M: the TMA tiling of the FP8 operand needs the row count to be a multiple of 8
(Mosaic GPU tiles the whole GMEM array in (8, 128) tiles and refuses 757 rows).  Rows
are padded to the next multiple of 8 (757 -> 760; in the model the pad fuses into the
fusion that quantizes x), and the last M tile's rows past that are handled by TMA
bounds (zero on load, dropped on store), not by padding to the tile (768).  The output
is [M, N]: the kernel writes 760 rows and ``[:M]`` fuses into the consumer.

Addend: ``addend`` [M, N] (optional) is added to the scaled product in the epilogue, in
float32, before the single rounding to out_dtype: the kernel loads each 64x64 sub-tile of
it by TMA into the sub-tile's output buffer in shared memory.  The kernel takes the
addend in out_dtype (it is cast); the reference adds it in float32.

Row scales: ``row_scale`` [R] float32, R <= M (optional; x quantized per row) multiplies
row m of the product with ``scale`` in the epilogue, before the addend; rows from R on
are scaled by 0 (a caller that padded x's rows passes the scales of the real rows: the
kernel's copy is bounded there, so no pad of the scales is needed).

Leading product: ``lead`` (a ``Product``: x_fp8 [M, K1], w_stacked [L, N, K1], scale,
row_scale, as below) is summed with x @ w.T in the same accumulator, in one kernel: the
attention-out and MLP-down projections of a block in one call.

Shapes: x_fp8 [M, K] e4m3, w_stacked [L, N, K] e4m3, layer [] int32 (may be traced),
scale [] float32 (x scale * w scale, or w scale with row_scale), row_scale None or [R]
float32 (R <= M), addend None or [M, N].  K % 128 == 0 and N % 256 == 0 (N % 128 == 0
with ``NARROW_CONFIG``): every characters-57b projection fits, at every tp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import device
from pallas_kernels import fp8_gemm_stream_k as _sk
from pallas_kernels.gemm_common import Config, fitting_stages
from pallas_kernels.gemm_common import fits as _tiles
from pallas_kernels.numerics import FP8

Product = _sk.Product
# 128 x 256 output tiles with 4 stages (the scale as a scalar leaves room for them), and
# 128 x 128 with 6 where N does not tile by 256 (the MLP-up projection at tp=4: N = 8064).
STREAM_K_CONFIG = Config(stages=4)
NARROW_CONFIG = Config(tile_n=64, stages=6)
IMPLS = ("auto", "pallas", "reference", "interpret")
INTERPRET_NUM_SMS = 2  # persistent blocks under the CPU interpreter (keeps tests fast)


def is_supported() -> bool:
    """The kernel needs NVIDIA Hopper (wgmma, TMA): sm_90."""
    return device.is_hopper()


def fits(n: int, k: int, config: Config | None = None) -> bool:
    """Whether a [*, K] x [N, K] product tiles with ``config`` (default: ``pick_config``), any M."""
    return _tiles(k, n, config or pick_config(n, k))


def pick_config(n: int, k: int, out_dtype=jnp.bfloat16) -> Config:
    """The tiling for an [M, K] x [N, K] product: ``STREAM_K_CONFIG``, or ``NARROW_CONFIG``
    where N does not tile by 256 (the stream-K schedule balances any tile count, so M does
    not matter), with as many of its stages as fit the shared memory beside out_dtype's
    output sub-tiles (a float32 output takes one stage's room)."""
    return fitting_stages(STREAM_K_CONFIG if _tiles(k, n, STREAM_K_CONFIG) else NARROW_CONFIG, out_dtype)


def _reference_product(x_fp8, w_stacked, layer, scale, row_scale=None):
    """(x @ w_stacked[layer].T) * scale (* row_scale[:, None]): [M, N] float32."""
    w = lax.dynamic_index_in_dim(w_stacked, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    if jnp.ndim(scale):
        scale = lax.dynamic_index_in_dim(scale, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    y = jnp.matmul(x_fp8.astype(jnp.float32), w.astype(jnp.float32).T,
                   precision=lax.Precision.HIGHEST)
    y = y * jnp.asarray(scale, jnp.float32)
    if row_scale is not None:
        rows = row_scale.astype(jnp.float32)
        y = y * jnp.pad(rows, (0, y.shape[0] - rows.shape[0]))[:, None]
    return y


def reference(x_fp8, w_stacked, layer, scale, *, out_dtype=jnp.bfloat16, addend=None,
              row_scale=None, lead: Product | None = None):
    """Plain jnp: (x @ w_stacked[layer].T) * scale (* row_scale[:, None]) (+ lead's product)
    (+ addend) in float32, then out_dtype.

    The layer is taken like ``lax.dynamic_index_in_dim`` (clamped), i.e. XLA slices it.
    """
    y = _reference_product(x_fp8, w_stacked, layer, scale, row_scale)
    if lead is not None:
        y = _reference_product(lead.x, lead.w, layer, lead.scale, lead.row_scale) + y
    if addend is not None:
        y = y + addend.astype(jnp.float32)
    return y.astype(out_dtype)


def uses_kernel(x_fp8, w_stacked, impl="auto", config: Config | None = None) -> bool:
    """Whether ``stacked_fp8_matmul(x_fp8, w_stacked, ..., impl=impl)`` runs the Pallas kernel
    (so that a caller can pick the dtype of an addend it passes: the kernel's out_dtype)."""
    if impl in ("pallas", "interpret"):
        return True
    if impl != "auto":
        return False
    n, k = w_stacked.shape[-2:]
    return (x_fp8.dtype == FP8 and w_stacked.dtype == FP8 and fits(n, k, config)
            and is_supported())


def _check_lead(x_fp8, w_stacked, row_scale, lead: Product | None):
    if lead is None:
        return
    _check(lead.x, lead.w, jnp.int32(0), lead.scale, row_scale=lead.row_scale)
    if (lead.x.shape[0] != x_fp8.shape[0] or lead.w.shape[:2] != w_stacked.shape[:2]):
        raise ValueError(f"lead product x {lead.x.shape}, w {lead.w.shape} must have x's rows "
                         f"and the stack's [L, N] = {w_stacked.shape[:2]}")
    if (lead.row_scale is None) != (row_scale is None):
        raise ValueError("lead has per-row scales exactly when x has")


def _check(x_fp8, w_stacked, layer, scale, addend=None, row_scale=None):
    if x_fp8.ndim != 2 or w_stacked.ndim != 3:
        raise ValueError(f"want x [M, K] and w_stacked [L, N, K], got {x_fp8.shape} and "
                         f"{w_stacked.shape}")
    if x_fp8.shape[1] != w_stacked.shape[2]:
        raise ValueError(f"K mismatch: x {x_fp8.shape} vs w_stacked {w_stacked.shape}")
    if jnp.ndim(layer) != 0:
        raise ValueError("layer must be a scalar")
    if jnp.ndim(scale) != 0 and jnp.shape(scale) != (w_stacked.shape[0],):
        raise ValueError(f"scale must be a scalar or the stack's [L] = [{w_stacked.shape[0]}], "
                         f"got {jnp.shape(scale)}")
    if row_scale is not None and not (row_scale.ndim == 1
                                      and 1 <= row_scale.shape[0] <= x_fp8.shape[0]):
        raise ValueError(f"row_scale must be [R], R <= M = {x_fp8.shape[0]}, got "
                         f"{row_scale.shape}")
    if addend is not None and addend.shape != (x_fp8.shape[0], w_stacked.shape[1]):
        raise ValueError(f"addend must be [M, N] = {(x_fp8.shape[0], w_stacked.shape[1])}, got "
                         f"{addend.shape}")


def _pallas(x_fp8, w_stacked, layer, scale, *, out_dtype, config: Config, interpret: bool,
            addend=None, num_sms=None, row_scale=None, lead: Product | None = None):
    for a in (x_fp8, w_stacked) + ((lead.x, lead.w) if lead is not None else ()):
        if a.dtype != FP8:
            raise ValueError(f"the kernel takes float8_e4m3fn operands, got {a.dtype}")
    if lead is not None and not fits(lead.w.shape[1], lead.w.shape[2], config):
        raise ValueError(f"lead shape N={lead.w.shape[1]} K={lead.w.shape[2]} does not fit "
                         f"tiles {config}")
    m, k = x_fp8.shape
    _, n, _ = w_stacked.shape
    if not fits(n, k, config):
        raise ValueError(f"shape N={n} K={k} does not fit tiles {config}")
    m8 = -(-m // 8) * 8
    pad8 = lambda a: a if m8 == m else jnp.pad(a, ((0, m8 - m), (0, 0)))  # noqa: E731
    x = pad8(x_fp8)
    if lead is not None:
        lead = Product(pad8(lead.x), lead.w, jnp.reshape(jnp.asarray(lead.scale, jnp.float32),
                                                          (-1,)), lead.row_scale)
    if addend is not None:
        addend = addend.astype(out_dtype)
        addend = addend if m8 == m else jnp.pad(addend, ((0, m8 - m), (0, 0)))
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    # A per-layer stack of scales goes in whole: the kernel reads the layer's.
    scale1 = jnp.reshape(jnp.asarray(scale, jnp.float32), (-1,))
    sms = num_sms or (INTERPRET_NUM_SMS if interpret else device.sm_count())
    teams = _sk.teams_for(m8, n, config, sms)
    out = _sk.kernel(x, w_stacked, scale1, addend, layer_arr, out_dtype=out_dtype,
                     config=config, teams=teams, interpret=interpret, row_scale=row_scale,
                     lead=lead)
    return out if m8 == m else out[:m]


def stacked_fp8_matmul(x_fp8, w_stacked, layer, scale, *, out_dtype=jnp.bfloat16,
                       impl="auto", config: Config | None = None, addend=None,
                       num_sms: int | None = None, row_scale=None,
                       lead: Product | None = None) -> jax.Array:
    """x_fp8: [M, K] float8_e4m3fn (any M; rows padded to a multiple of 8 only);
    w_stacked: [L, N, K] float8_e4m3fn (K-major, N output features); layer: [] int32,
    may be traced (the scan's layer index; clamped to [0, L) like dynamic_slice);
    scale: [] float32 (x_scale * w_scale, applied in the epilogue), or [L] float32 (each
    layer's; the kernel reads scale[layer], so no XLA slice runs per call);
    row_scale: None or [R] float32 (R <= M), x's per-row scales (then ``scale`` is w's),
    applied with it; rows from R on are scaled by 0;
    addend: None or [M, N] (any float dtype; the kernel reads it as out_dtype), added in
    float32 before the rounding to out_dtype.
    lead: None or a ``Product`` (x_fp8 [M, K1], w_stacked [L, N, K1], scale, row_scale as
    above, row scales exactly when x has them), whose product is added: one kernel over
    K1 + K.
    Returns [M, N] out_dtype = (x @ w_stacked[layer].T) * scale (* row_scale[:, None])
    (+ lead's product) (+ addend).
    impl: 'auto' (Pallas on Hopper when the shape tiles, reference elsewhere) | 'pallas' |
    'reference' | 'interpret' (the Pallas kernel under the Mosaic GPU interpreter, CPU).
    config: the kernel's tiling (default ``pick_config(N, K)``).
    num_sms: the kernel's persistent grid (default: the device's SMs; 2 under the
    interpreter)."""
    _check(x_fp8, w_stacked, layer, scale, addend, row_scale)
    _check_lead(x_fp8, w_stacked, row_scale, lead)
    config = config or pick_config(*w_stacked.shape[1:], out_dtype)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        runs = uses_kernel(x_fp8, w_stacked, "auto", config) and (
            lead is None or uses_kernel(lead.x, lead.w, "auto", config))
        impl = "pallas" if runs else "reference"
    if impl == "reference":
        return reference(x_fp8, w_stacked, layer, scale, out_dtype=out_dtype, addend=addend,
                         row_scale=row_scale, lead=lead)
    return _pallas(x_fp8, w_stacked, layer, scale, out_dtype=out_dtype, config=config,
                   interpret=impl == "interpret", addend=addend, num_sms=num_sms,
                   row_scale=row_scale, lead=lead)
