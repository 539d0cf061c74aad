"""Test inputs: float weights quantized to the model's FP8 weight format."""

import jax
import jax.numpy as jnp

from characters_jax.parallel.fp8_linear import Fp8Weight
from pallas_kernels.numerics import scale_from_amax, to_fp8


def quantize_weight(w: jax.Array, per_channel: bool = False) -> Fp8Weight:
    """w [N, K] float -> FP8 e4m3 with a per-tensor or per-row (per_channel) scale."""
    if w.ndim != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {w.shape}")
    absw = jnp.abs(w.astype(jnp.float32))
    amax = jnp.max(absw, axis=1) if per_channel else jnp.max(absw)
    scale = scale_from_amax(amax)
    inv = 1.0 / (scale[:, None] if per_channel else scale)
    return Fp8Weight(values=to_fp8(w, inv), scale=scale)
