"""The portable implementations: ``attention_reference`` (plain jnp in float32: the
definition of the op, on any backend) and ``attention_dot_product`` (``jax.nn.
dot_product_attention``, cuDNN or XLA, on bf16-dequantized K/V); ``quantize_kv`` makes FP8
K/V with one scale per head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import FP8 as F8, FP8_MAX as F8_MAX


def attention_reference(q, k, v, k_scale, v_scale, valid):
    """Plain-jnp attention over a (possibly FP8) KV cache, computed in float32.

    Args:
      q: [Tq, H, D] bf16/f32 queries (RoPE already applied).
      k, v: [S, H, D] float8_e4m3fn (or bf16/f32) stored keys / values.
      k_scale, v_scale: [H] float32 per-head dequantization scales.
      valid: [S] bool; False slots have no influence.
    Returns:
      [Tq, H, D] in q.dtype. A row with no valid slot is all zeros.
    """
    d = q.shape[-1]
    qf = q.astype(jnp.float32)
    kf = k.astype(jnp.float32) * k_scale.astype(jnp.float32)[None, :, None]
    vf = v.astype(jnp.float32) * v_scale.astype(jnp.float32)[None, :, None]
    s = jnp.einsum("qhd,khd->hqk", qf, kf, precision=lax.Precision.HIGHEST)
    s = s * (1.0 / math.sqrt(d))
    s = jnp.where(valid[None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)  # exp(-inf) = 0 for masked slots
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("hqk,khd->qhd", p / jnp.maximum(l, 1e-30), vf,
                   precision=lax.Precision.HIGHEST)
    return o.astype(q.dtype)


def quantize_kv(x, axis_reduce=(0, 2)):
    """Quantizes [S, H, D] K or V to e4m3 with one scale per head: (x8, scale[H])."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis_reduce)
    scale = jnp.maximum(amax, 1e-12) / F8_MAX
    x8 = (x.astype(jnp.float32) / scale[None, :, None]).astype(F8)
    return x8, scale.astype(jnp.float32)


def attention_dot_product(q, k, v, k_scale, v_scale, valid, *, implementation):
    """``jax.nn.dot_product_attention`` on bf16-dequantized K/V ('cudnn' or 'xla')."""
    dt = jnp.bfloat16
    kf = (k.astype(jnp.float32) * k_scale[None, :, None]).astype(dt)
    vf = (v.astype(jnp.float32) * v_scale[None, :, None]).astype(dt)
    mask = jnp.broadcast_to(valid[None, None, None, :], (1, 1, q.shape[0], k.shape[0]))
    o = jax.nn.dot_product_attention(
        q.astype(dt)[None], kf[None], vf[None], mask=mask, implementation=implementation)
    return o[0].astype(q.dtype)
