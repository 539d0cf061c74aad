"""The numerics that the kernels and the model share, in plain jnp (imports jax only).

The kernels' references are written in these functions, and so is the model, so a kernel
and the code it replaces round the same way:

  FP8 e4m3 (``FP8``, ``FP8_MAX`` = 448) with scales computed on the device:
    ``quantize_activation`` (per tensor or per row, scale = max(amax, AMAX_FLOOR) / 448),
    ``quantize_per_head`` (a fixed scale per head, saturating: the KV cache's write);
  ``rms_norm`` / ``modulated_norm`` (adaLN), ``gelu_tanh`` / ``mlp_hidden``;
  ``rotate`` (RoPE by precomputed angles).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448.0
AMAX_FLOOR = 1e-12  # keeps the scale of an all-zero tensor (or row) finite


def row_broadcast(scale: jax.Array) -> jax.Array:
    """[] stays []; per-row [...] -> [..., 1], to multiply [..., K] or [..., N]."""
    return scale[..., None] if scale.ndim else scale


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """The e4m3 scale of an absolute maximum: max(amax, AMAX_FLOOR) / 448, float32."""
    return jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) / FP8_MAX


def to_fp8(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """clip(x * inv_scale, +-448) as e4m3, computed in float32."""
    scaled = x.astype(jnp.float32) * inv_scale
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_activation(x: jax.Array, per_row: bool = False) -> tuple[jax.Array, jax.Array]:
    """FP8 quantization on the device: x [..., K] -> (x_fp8 [..., K], scale f32), the scale
    [] per tensor or [...] per row (the maximum over K of each row).

    The absolute maximum is reduced on the device; nothing is read by the host.
    """
    amax = jnp.max(jnp.abs(x), axis=-1) if per_row else jnp.max(jnp.abs(x))
    scale = scale_from_amax(amax)
    return to_fp8(x, row_broadcast(1.0 / scale)), scale


def quantize_per_head(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x: [T, H, D] float; scale: [H] float32 -> [T, H, D] float8_e4m3fn, saturating."""
    y = x.astype(jnp.float32) / scale[None, :, None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8)


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm without gain over the last axis, computed in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def modulated_norm(x: jax.Array, shift: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """adaLN on an RMSNorm: rms_norm(x) * (1 + scale) + shift in float32, in x.dtype.
    x [T, d]; shift, scale [d] float32."""
    return (rms_norm(x, eps).astype(jnp.float32) * (1.0 + scale) + shift).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation, in x's dtype (as ``jax.nn.gelu(approximate=True)``):
    x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
    return x * (0.5 * (1.0 + jnp.tanh(inner)))


def mlp_hidden(y: jax.Array) -> jax.Array:
    """The MLP's hidden activation of up's output y [T, F]: GELU in float32, rounded once to
    y.dtype."""
    return gelu_tanh(y.astype(jnp.float32)).astype(y.dtype)


def rotate(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates x [T, H, D] (any float dtype) by ``rope`` = (cos, sin) [T, D/2] (the rotary
    pairs are (i, i + D/2)). Computed in float32; returns x.dtype."""
    cos, sin = (a[:, None, :] for a in rope)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
