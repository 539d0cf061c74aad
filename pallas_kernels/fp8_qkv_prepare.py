"""From the qkv projection's output to the FP8 attention's operands in one pass (Pallas,
Triton), and the reference.

After a block's qkv GEMM, a step of the ring cache does, per token and head:
  q = rope(rms_norm(q) * q_gain), then Q's e4m3 parts and row scale for the attention kernel
      (``fp8_attention.quantize_q``);
  k = rope(rms_norm(k) * k_gain), then e4m3 with the layer's fixed K scale, written into the
      ring cache at the frame's slots (``kv_cache.write``);
  v = e4m3 with the layer's V scale, written likewise.
XLA runs that as ~8 kernels per block pass (the q/k slices converted to float32, the norms'
gains, Q's maximum, its two e4m3 parts, the two cache updates: ~30 us at tp=4's 18 heads
on an H200, BUILD_NOTES). Here one program per token and group of up to
``HEADS_PER_PROGRAM`` heads reads its 3 x heads x D values once and writes Q's parts and
scales and the cache's K and V rows in place (the two caches are aliased to the outputs).

The arithmetic is the model's, in its order and dtypes: the norm in float32 rounded to
bf16, times the bf16 gain rounded to bf16, the rotation in float32 rounded to bf16, then
Q's scale s = max(amax, 1e-30) / 448, hi = e4m3(q / s), lo = e4m3(q / s - hi); K and V
divided by their scales, clipped to +-448, e4m3. ``reference`` is that model code.

Shapes and dtypes (per tensor-parallel shard):
  qkv       [Ty >= T, H * 3 * D] bfloat16 (the GEMM's output; rows from T on not read)
  q_gain, k_gain [D] float32; cos, sin [T, D / 2] float32 (``rope.rope_angles``)
  k_scale, v_scale [H] float32 (this layer's), or the cache's [L, H] stacks (the kernel reads
                 the layer's); cache_k, cache_v [L, S, H, D] float8_e4m3fn
  layer, offset  [] int32: the block, and the first of the T slots written
  any_valid [] f32 or None: given, the kernel also writes the attention kernel's scales
                 operand (``QuantizedQ.scales`` [H, 2, Tq'], ``fp8_attention.attention_scales``
                 of Q's row scales, this layer's K/V scales and any_valid), so the attention
                 call makes none (an XLA kernel per block pass fewer)
  out       (QuantizedQ (parts [T, H, D] e4m3 x 2, row_scale [T, H] f32, scales), cache_k,
             cache_v)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import device
from pallas_kernels.fp8_attention import LOG2E, QuantizedQ, attention_scales, padded_queries, quantize_q
from pallas_kernels.numerics import FP8 as F8, FP8_MAX as F8_MAX, quantize_per_head, rms_norm, rotate

IMPLS = ("auto", "pallas", "reference", "interpret")
KERNEL_NAME = "fp8_qkv_prepare"
# Heads per program (a power of two; the token's heads in groups of it, the last masked): 18
# heads at tp=4 are one group of 32, 72 at tp=1 three, so a program's registers stay those of
# tp=4's, where the kernel was measured.
HEADS_PER_PROGRAM = 32


def is_supported() -> bool:
    """The Triton kernel's e4m3 conversion needs an NVIDIA GPU of compute capability 8.9+."""
    return device.has_fp8_conversion()


def _split(qkv, t, heads, head_dim):
    x = qkv[:t].reshape(t, heads, 3, head_dim)
    return x[:, :, 0], x[:, :, 1], x[:, :, 2]


def reference(qkv, q_gain, k_gain, cos, sin, k_scale, v_scale, cache_k, cache_v, layer,
              offset, *, t: int, heads: int, eps: float, any_valid=None):
    """The model's code: QK-norm (``numerics.rms_norm`` times the gain in qkv's dtype),
    RoPE (``numerics.rotate``), ``fp8_attention.quantize_q``, the cache's
    ``numerics.quantize_per_head`` and the in-place update of the cache rows
    [layer, offset : offset + t]; with any_valid, the attention's scales
    (``fp8_attention.attention_scales``)."""
    if k_scale.ndim == 2:  # the [L, H] stacks: this layer's
        k_scale, v_scale = k_scale[layer], v_scale[layer]
    d = cache_k.shape[-1]
    q, k, v = _split(qkv, t, heads, d)
    q = rotate(rms_norm(q, eps) * q_gain.astype(qkv.dtype), (cos, sin))
    k = rotate(rms_norm(k, eps) * k_gain.astype(qkv.dtype), (cos, sin))
    start = (layer, offset, jnp.int32(0), jnp.int32(0))
    cache_k = jax.lax.dynamic_update_slice(cache_k, quantize_per_head(k, k_scale)[None], start)
    cache_v = jax.lax.dynamic_update_slice(cache_v, quantize_per_head(v, v_scale)[None], start)
    q8 = quantize_q(q)
    if any_valid is not None:
        q8 = dataclasses.replace(q8, scales=attention_scales(q8.row_scale, k_scale, v_scale,
                                                             any_valid, d))
    return q8, cache_k, cache_v


def _kernel(qkv_ref, qg_ref, kg_ref, cos_ref, sin_ref, ks_ref, vs_ref, layer_ref, offset_ref,
            *refs, heads: int, hp: int, d: int, eps: float, t_len: int, with_scales: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if with_scales:
        av_ref, _ck, _cv, *out_refs = refs
        *q_refs, qrs_ref, sc_ref, ck_ref, cv_ref = out_refs
    else:
        _ck, _cv, *out_refs = refs
        *q_refs, qrs_ref, ck_ref, cv_ref = out_refs
    t = pl.program_id(0)
    half = d // 2
    dtype = qkv_ref.dtype
    head_ids = pl.program_id(1) * hp + jnp.arange(hp)  # this program's group of hp heads
    h = head_ids[:, None]  # [hp, 1]
    lane = jnp.arange(half)[None, :]  # [1, half]
    hm = (h < heads) & (lane >= 0)  # [hp, half]
    tok = jnp.zeros_like(h) + t

    def load(j, side):
        """Part j (0 q, 1 k, 2 v) of every head, lanes [side * half, (side + 1) * half)."""
        cols = h * (3 * d) + j * d + side * half + lane
        return plt.load(qkv_ref.at[tok, cols], mask=hm, other=0.0).astype(jnp.float32)

    lanes1 = jnp.arange(half)
    cos = plt.load(cos_ref.at[t, lanes1])[None, :]
    sin = plt.load(sin_ref.at[t, lanes1])[None, :]

    def bf16(x):
        return x.astype(dtype).astype(jnp.float32)

    def norm_rope(j, gain_ref):
        a, b = load(j, 0), load(j, 1)
        rstd = jax.lax.rsqrt((jnp.sum(a * a, axis=1) + jnp.sum(b * b, axis=1))[:, None] / d
                             + eps)
        ga = bf16(plt.load(gain_ref.at[lanes1]))[None, :]
        gb = bf16(plt.load(gain_ref.at[half + lanes1]))[None, :]
        a, b = bf16(bf16(a * rstd) * ga), bf16(bf16(b * rstd) * gb)
        return bf16(a * cos - b * sin), bf16(a * sin + b * cos)

    # Q: its parts and row scale, as fp8_attention.quantize_q.
    qa, qb = norm_rope(0, qg_ref)
    amax = jnp.maximum(jnp.max(jnp.abs(qa), axis=1), jnp.max(jnp.abs(qb), axis=1))  # [hp]
    q_rs = jnp.maximum(amax, 1e-30) / F8_MAX
    for side, x in enumerate((qa, qb)):
        qs = x / q_rs[:, None]
        hi = qs.astype(F8)
        idx = (tok, h, side * half + lane)
        plt.store(q_refs[0].at[idx], hi, mask=hm)
        plt.store(q_refs[1].at[idx], (qs - hi.astype(jnp.float32)).astype(F8), mask=hm)
    plt.store(qrs_ref.at[t, head_ids], q_rs, mask=head_ids < heads)

    # K and V into the cache rows [layer, offset + t], with the layer's scales (read from the
    # [L, H] stacks at the layer: no slice kernel before the call).
    layer, offset = layer_ref[0], offset_ref[0]
    slot = jnp.zeros_like(h) + offset + t
    lyr = jnp.zeros_like(h) + layer
    hs = jnp.minimum(head_ids, heads - 1)
    k_s = plt.load(ks_ref.at[layer, hs])[:, None]
    v_s = plt.load(vs_ref.at[layer, hs])[:, None]
    if with_scales:
        # The attention's scales operand [H, 2, Tq'] (fp8_attention.attention_scales, in its
        # order): column t, and the zero padding columns T + t, 2T + t, ... below Tq'.
        hm1 = head_ids < heads
        logit = q_rs * (k_s[:, 0] * (LOG2E / math.sqrt(d)))
        out_sc = v_s[:, 0] * av_ref[0]
        plt.store(sc_ref.at[head_ids, 0, t], logit, mask=hm1)
        plt.store(sc_ref.at[head_ids, 1, t], out_sc, mask=hm1)
        tq_pad = sc_ref.shape[2]
        zero = jnp.zeros_like(logit)
        for j in range(1, -(-tq_pad // t_len)):
            col = j * t_len + t
            for row in (0, 1):
                plt.store(sc_ref.at[head_ids, row, jnp.minimum(col, tq_pad - 1)], zero,
                          mask=hm1 & (col < tq_pad))
    ka, kb = norm_rope(1, kg_ref)
    for side, (kx, vx) in enumerate(((ka, load(2, 0)), (kb, load(2, 1)))):
        idx = (lyr, slot, h, side * half + lane)
        plt.store(ck_ref.at[idx], jnp.clip(kx / k_s, -F8_MAX, F8_MAX).astype(F8), mask=hm)
        plt.store(cv_ref.at[idx], jnp.clip(vx / v_s, -F8_MAX, F8_MAX).astype(F8), mask=hm)


def prepare_qkv(qkv, q_gain, k_gain, cos, sin, k_scale, v_scale, cache_k, cache_v, layer,
                offset, *, t: int, heads: int, eps: float, any_valid=None, impl: str = "auto",
                num_warps: int = 4):
    """(QuantizedQ, cache_k, cache_v) of the module docstring; the caches are updated in
    place by the kernel (aliased), by ``dynamic_update_slice`` in the reference. any_valid
    ([] f32, e.g. ``fp8_attention.SlotMask.any_valid``): the QuantizedQ carries the
    attention's scales operand too.

    impl: 'auto' (the Triton kernel on a GPU that has it, else the reference) | 'pallas' |
    'reference' | 'interpret' (the kernel under the Pallas interpreter, CPU)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    d = cache_k.shape[-1]
    if qkv.ndim != 2 or qkv.shape[1] != heads * 3 * d or qkv.shape[0] < t:
        raise ValueError(f"want qkv [>= {t}, {heads * 3 * d}], got {qkv.shape}")
    if cache_k.dtype != F8 or cache_v.dtype != F8 or cache_k.shape != cache_v.shape \
            or cache_k.shape[2] != heads or d % 2:
        raise ValueError(f"want e4m3 caches [L, S, {heads}, D], got {cache_k.shape} "
                         f"{cache_k.dtype} and {cache_v.shape} {cache_v.dtype}")
    scale_shapes = ((heads,), (cache_k.shape[0], heads))
    if k_scale.shape not in scale_shapes or v_scale.shape != k_scale.shape:
        raise ValueError(f"want k_scale, v_scale [{heads}] or [L, {heads}], got {k_scale.shape}, "
                         f"{v_scale.shape}")
    if cos.shape != (t, d // 2) or sin.shape != (t, d // 2):
        raise ValueError(f"want cos, sin [{t}, {d // 2}], got {cos.shape}, {sin.shape}")
    if impl == "auto":
        impl = "pallas" if is_supported() else "reference"
    args = (qkv, q_gain, k_gain, cos, sin, k_scale, v_scale, cache_k, cache_v, layer, offset)
    if impl == "reference":
        return reference(*args, t=t, heads=heads, eps=eps, any_valid=any_valid)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # Per-head scales as [L, H] stacks, read at the layer (one layer's [H] is broadcast).
    if k_scale.ndim == 1:
        stack = (cache_k.shape[0], heads)
        k_scale, v_scale = jnp.broadcast_to(k_scale, stack), jnp.broadcast_to(v_scale, stack)
    one = lambda a: jnp.reshape(jnp.asarray(a, jnp.int32), (1,))  # noqa: E731 (a bitcast)
    parts = 2  # Q's hi and lo
    hp = min(pl.next_power_of_2(heads), HEADS_PER_PROGRAM)
    with_scales = any_valid is not None
    kernel = functools.partial(_kernel, heads=heads, hp=hp, d=d, eps=eps, t_len=t,
                               with_scales=with_scales)
    scales_out = [jax.ShapeDtypeStruct((heads, 2, padded_queries(t)), jnp.float32)] * with_scales
    extra_in = [jnp.reshape(f32(any_valid), (1,))] if with_scales else []
    n_in = 9 + with_scales  # the caches' operand indices: n_in, n_in + 1
    outs = pl.pallas_call(
        kernel,
        grid=(t, pl.cdiv(heads, hp)),
        out_shape=(*[jax.ShapeDtypeStruct((t, heads, d), F8)] * parts,
                   jax.ShapeDtypeStruct((t, heads), jnp.float32),
                   *scales_out,
                   jax.ShapeDtypeStruct(cache_k.shape, F8),
                   jax.ShapeDtypeStruct(cache_v.shape, F8)),
        input_output_aliases={n_in: parts + 1 + with_scales, n_in + 1: parts + 2 + with_scales},
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=impl == "interpret",
        name=KERNEL_NAME,
    )(qkv, f32(q_gain), f32(k_gain), f32(cos), f32(sin), f32(k_scale), f32(v_scale),
      one(layer), one(offset), *extra_in, cache_k, cache_v)
    *q_parts, q_rs = outs[:parts + 1]
    scales = outs[parts + 1] if with_scales else None
    return (QuantizedQ(tuple(q_parts), q_rs, scales), outs[-2], outs[-1])
