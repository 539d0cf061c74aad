"""FP8 (e4m3) linear layers with weights stored (N, K), K-major.

The weights of every projection are kept as ``float8_e4m3fn`` with a float32
dequantization scale (per tensor, or per output channel).  Activations are
quantized on the device with a per-tensor scale computed from their absolute
maximum (never read by the host).  The product is one ``dot_general`` on the two
FP8 operands contracting K of both, so the (N, K) weight is consumed as stored
(no transpose) and XLA on NVIDIA GPUs emits its cuBLASLt FP8 GEMM; the scales
are applied to the output afterwards, where they cost one multiply per output
element (a scalar per-tensor scale, which the GEMM rewriter folds into the
cuBLASLt call, or a length-N vector for per-channel weights).

Shapes and dtypes:
  ``Fp8Weight.values``  [N, K] float8_e4m3fn
  ``Fp8Weight.scale``   []  float32 (per tensor) or [N] float32 (per channel)
  ``linear(x, w)``      x [..., K] -> [..., N] in ``out_dtype`` (default x.dtype)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0
_TINY = 1e-12  # keeps the scale of an all-zero tensor finite


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight [N, K] (N output features, K-major) and its dequant scale.

    ``values.astype(f32) * scale[..., None]`` approximates the float weight.
    """

    values: jax.Array  # [N, K] float8_e4m3fn
    scale: jax.Array  # [] or [N] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def per_channel(self) -> bool:
        return self.scale.ndim == 1

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [N, K] this FP8 weight stands for."""
        scale = self.scale[:, None] if self.per_channel else self.scale
        return (self.values.astype(jnp.float32) * scale).astype(dtype)


def _scale_from_amax(amax: jax.Array) -> jax.Array:
    return jnp.maximum(amax.astype(jnp.float32), _TINY) / FP8_MAX


def _to_fp8(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    scaled = x.astype(jnp.float32) * inv_scale
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_weight(w: jax.Array, per_channel: bool = False) -> Fp8Weight:
    """Quantizes a float weight w [N, K] to FP8 e4m3 with a per-tensor or per-row scale."""
    if w.ndim != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {w.shape}")
    absw = jnp.abs(w.astype(jnp.float32))
    amax = jnp.max(absw, axis=1) if per_channel else jnp.max(absw)
    scale = _scale_from_amax(amax)
    inv = 1.0 / (scale[:, None] if per_channel else scale)
    return Fp8Weight(values=_to_fp8(w, inv), scale=scale)


def quantize_activation(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-tensor FP8 quantization on the device: x [..., K] -> (x_fp8 [..., K], scale [] f32).

    The absolute maximum is reduced on the device; nothing is read by the host.
    """
    scale = _scale_from_amax(jnp.max(jnp.abs(x)))
    return _to_fp8(x, 1.0 / scale), scale


def fp8_dot(x_fp8: jax.Array, w_fp8: jax.Array, out_dtype) -> jax.Array:
    """x_fp8 [M, K] . w_fp8 [N, K] -> [M, N], contracting K of both (the weight is not transposed)."""
    return jax.lax.dot_general(
        x_fp8,
        w_fp8,
        dimension_numbers=(((x_fp8.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=out_dtype,
    )


def linear(x: jax.Array, w, out_dtype=None, *, accumulate_dtype=None) -> jax.Array:
    """y = x @ w.T for x [..., K] and w an ``Fp8Weight`` or a float [N, K] array.

    Args:
      x: activations [..., K] (bf16 or f32).
      w: ``Fp8Weight`` (values [N, K] e4m3, scale [] or [N]) or a float [N, K].
      out_dtype: dtype of the result (default x.dtype).
      accumulate_dtype: dtype the FP8 GEMM writes before the scales are applied
        (default f32, which keeps the full accumulator precision; bf16 halves the
        bytes written).  Ignored for float weights.
    Returns:
      [..., N] in ``out_dtype``.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if not isinstance(w, Fp8Weight):
        y = jax.lax.dot_general(
            x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        return y.astype(out_dtype)
    x_fp8, x_scale = quantize_activation(x)
    y = fp8_dot(x_fp8, w.values, accumulate_dtype or jnp.float32)
    return (y.astype(jnp.float32) * (x_scale * w.scale)).astype(out_dtype)


def flops(m: int, k: int, n: int) -> int:
    """Floating-point operations of one [m, k] x [k, n] product."""
    return 2 * m * k * n
