"""``attention``: the dispatcher over the implementations, and ``attention_pallas``, the
FP8 kernel's wrapper (its operands made, its grid sized from ``AttentionTuning``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import device
from pallas_kernels.fp8_attention.kernel import fp8_attention_call
from pallas_kernels.fp8_attention.operands import (QuantizedQ, block_masked_flags, mask_valid,
                                                   prepare_operands)
from pallas_kernels.fp8_attention.reference import attention_dot_product, attention_reference
from pallas_kernels.fp8_attention.schedule import (BLOCK_Q, COMPUTE_WGS, DEFAULT_TUNING,
                                                   AttentionTuning, stream_k_ctas)
from pallas_kernels.numerics import FP8 as F8

IMPLS = ("auto", "reference", "pallas", "cudnn", "xla")
PALLAS_IMPLS = ("pallas",)


@functools.partial(jax.jit, static_argnames=("padded_out", "tuning"))
def attention_pallas(q, k, v, k_scale, v_scale, valid, layer=None, *, padded_out: bool = False,
                     tuning: AttentionTuning = DEFAULT_TUNING):
    """FP8 attention through the Mosaic GPU kernel (Hopper only).

    Same arguments and result as :func:`attention`; K/V must be float8_e4m3fn and
    D == 128. With ``layer`` the [L, S, H, D] stacks are read in place. tuning: the
    kernel's tiling (:class:`AttentionTuning`).
    """
    tq, h, d = q.shape
    if k.dtype != F8 or v.dtype != F8:
        raise TypeError("attention_pallas needs float8_e4m3fn K/V")
    n_tiles = h * -(-tq // (COMPUTE_WGS * BLOCK_Q))
    nb = -(-valid.shape[0] // tuning.block_kv)
    num_ctas = stream_k_ctas(n_tiles, nb, min(tuning.stages, nb), tuning.num_sms)
    block_masked = block_masked_flags(valid, tuning.block_kv)
    q8, scales, bias = prepare_operands(q, k_scale, v_scale, valid, tuning.block_kv)
    layer_arr = None if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = fp8_attention_call(q8, k, v, scales, bias, block_masked, block_kv=tuning.block_kv,
                              stages=tuning.stages, num_ctas=num_ctas, out_dtype=jnp.bfloat16,
                              layer=layer_arr)
    return (out if padded_out else out[:tq]).astype(q.dtype)


def resolve_impl(impl: str, kv_dtype, head_dim: int) -> str:
    """The concrete implementation that :func:`attention` runs for ``impl``:
    'auto' is 'pallas' on an NVIDIA Hopper GPU for FP8 K/V and head_dim 128, else
    'reference'; any other name is checked and returned."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    ok = jnp.dtype(kv_dtype) == F8 and head_dim == 128 and device.is_hopper()
    return "pallas" if ok else "reference"


def layer_of(x, layer):
    return lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def attention(q, k, v, k_scale, v_scale, valid, *, impl: str = "auto", layer=None,
              padded_out: bool = False) -> jax.Array:
    """q: [Tq, H, D] bf16/f32 (queries, RoPE already applied), or a :class:`QuantizedQ`
    (the kernel's e4m3 parts, made elsewhere; the other impls dequantize it); k, v: [S, H, D]
    float8_e4m3fn (or bf16/f32 when the cache is not FP8); k_scale, v_scale: [H] float32
    per-head dequant scales (real = stored * scale); valid: [S] bool slot mask, or its
    :class:`SlotMask` (made once for many calls). Softmax scale 1/sqrt(D).
    layer: None, or an int32 scalar (may be traced); then k and v are the cache's whole
    stacks [L, S, H, D] and layer ``layer`` is attended (clamped to [0, L)): the Pallas
    kernel reads it in place, the other impls slice it.
    padded_out: the Pallas kernel returns all the rows it computed, [Tq' >= Tq, H, D]
    (Tq rounded up to its query tile; the rows past Tq are not attention outputs), for a
    consumer that reads only the first Tq rows (a slice would be a copy); other impls
    return [Tq, H, D] regardless.
    Returns [Tq, H, D] in q.dtype. impl: 'auto' | 'reference' | 'pallas' | 'cudnn' | 'xla'.
    'auto' picks the Pallas kernel on an NVIDIA Hopper GPU for FP8 K/V and the reference
    elsewhere."""
    impl = resolve_impl(impl, k.dtype, q.shape[-1])
    if isinstance(q, QuantizedQ) and impl not in PALLAS_IMPLS:
        q = q.dequantize(jnp.bfloat16)
    if impl not in PALLAS_IMPLS:
        valid = mask_valid(valid)
    if layer is not None and k.ndim != 4:
        raise ValueError(f"with layer, k and v must be [L, S, H, D] stacks, got {k.shape}")
    if impl in PALLAS_IMPLS:
        return attention_pallas(q, k, v, k_scale, v_scale, valid, layer,
                                padded_out=padded_out)
    if layer is not None:
        k, v = layer_of(k, layer), layer_of(v, layer)
    if impl == "reference":
        return attention_reference(q, k, v, k_scale, v_scale, valid)
    if impl in ("cudnn", "xla"):
        return attention_dot_product(q, k, v, k_scale, v_scale, valid, implementation=impl)
    raise ValueError(f"unknown attention impl {impl!r}")
