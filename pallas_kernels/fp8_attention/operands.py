"""The kernel's operands as the wrapper makes them: the slot mask's derived forms
(``SlotMask``: the per-slot bias, the per-block masked flags, whether any slot is valid),
Q's two e4m3 parts with their row scales (``QuantizedQ``), and the per-row logit and output
factors (``attention_scales``)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_attention.schedule import DEFAULT_TUNING, padded_queries, padded_slots
from pallas_kernels.numerics import FP8 as F8, FP8_MAX as F8_MAX

LOG2E = math.log2(math.e)
MASK_BIAS = -1e30  # finite: a fully masked row gives zeros, never NaN


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["valid", "bias", "block_masked", "any_valid"],
                   meta_fields=["block_kv"])
@dataclasses.dataclass(frozen=True)
class SlotMask:
    """The slot mask and what the kernel derives from it, made once where many calls share
    it (a step's blocks all attend under one mask; derived inside the block scan, each piece
    is a kernel per block): valid [S] bool, bias [S'] f32 (:func:`slot_bias`),
    block_masked [nb] int32 (:func:`block_masked_flags`), any_valid [] f32, for KV blocks of
    ``block_kv`` (another block size derives its own from ``valid``). Made by :func:`slot_mask`;
    :func:`attention` takes it wherever it takes ``valid``."""

    valid: jax.Array
    bias: jax.Array
    block_masked: jax.Array
    any_valid: jax.Array
    block_kv: int

    @property
    def shape(self):
        return self.valid.shape


def slot_mask(valid, block_kv: int | None = None) -> SlotMask:
    """valid [S] bool -> its :class:`SlotMask` for KV blocks of ``block_kv`` (default: the
    kernel's, ``DEFAULT_TUNING.block_kv``)."""
    block_kv = block_kv or DEFAULT_TUNING.block_kv
    return SlotMask(valid, slot_bias(valid, block_kv), block_masked_flags(valid, block_kv),
                    jnp.any(valid).astype(jnp.float32), block_kv)


def mask_valid(valid):
    return valid.valid if isinstance(valid, SlotMask) else valid


def block_masked_flags(valid, block_kv: int) -> jax.Array:
    """[nb] int32: 1 where the KV block holds a masked (invalid or padding) slot."""
    if isinstance(valid, SlotMask):
        if valid.block_kv == block_kv:
            return valid.block_masked
        valid = valid.valid
    s_len = valid.shape[0]
    nb = -(-s_len // block_kv)
    v = jnp.pad(valid, (0, nb * block_kv - s_len))
    return jnp.any(~v.reshape(nb, block_kv), axis=1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedQ:
    """Q already in the kernel's form: ``parts`` (hi, lo), two e4m3 [Tq, H, D] arrays with
    lo = e4m3(q / s - hi), ``row_scale`` [Tq, H] float32 (s = a (row, head)'s absolute
    maximum / 448): q ~ (hi + lo) * s. Made by :func:`quantize_q`, or by a kernel that
    produces Q (``pallas_kernels.fp8_qkv_prepare``). ``scales``: None, or the kernel's
    scales operand [H, 2, Tq'] f32 already made by that producer (:func:`attention_scales`
    of ``row_scale`` and the K/V scales and mask the call is given); the call then uses it
    as it is, with no XLA pass of its own."""

    parts: tuple
    row_scale: jax.Array
    scales: jax.Array | None = None

    @property
    def shape(self):
        return self.parts[0].shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)  # the attention output's

    def dequantize(self, dtype=jnp.float32):
        q = sum(p.astype(jnp.float32) for p in self.parts) * self.row_scale[..., None]
        return q.astype(dtype)


def quantize_q(q) -> QuantizedQ:
    """q [Tq, H, D] float -> the kernel's two e4m3 Q parts and row scales
    (:class:`QuantizedQ`)."""
    qf = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(qf), axis=-1)  # [Tq, H]
    q_rs = jnp.maximum(amax, 1e-30) / F8_MAX
    qs = qf / q_rs[..., None]
    q_hi = qs.astype(F8)
    # The barrier keeps XLA from folding f32 -> e4m3 -> f32 into a no-op (GPU XLA allows
    # excess precision), which would make lo == 0.
    hi_f32 = lax.optimization_barrier(q_hi).astype(jnp.float32)
    return QuantizedQ((q_hi, (qs - hi_f32).astype(F8)), q_rs)


def prepare_operands(q, k_scale, v_scale, valid, block_kv):
    """The wrapper's operands: Q's two e4m3 parts [Tq, H, D] (unpadded: TMA zero-fills the
    last tile), scales [H, 2, Tq'] f32 (row 0: logit factor in the log2 domain, row 1:
    output factor) and the slot bias [S'] f32 (S' = S rounded up to block_kv). q: float,
    or a :class:`QuantizedQ` (its parts used as they are).

    The parts are separate kernel operands, not one stacked array: a stack costs XLA a
    concatenate pass over both parts per call."""
    tq, h, d = q.shape
    tq_pad = padded_queries(tq)
    if not isinstance(q, QuantizedQ):
        q = quantize_q(q)
    if q.scales is not None:
        if q.scales.shape != (h, 2, tq_pad):
            raise ValueError(f"QuantizedQ.scales must be [{h}, 2, {tq_pad}], got {q.scales.shape}")
        scales = q.scales
    else:
        scales = attention_scales(q.row_scale, k_scale, v_scale, valid_flag(valid), d)
    return q.parts, scales, slot_bias(valid, block_kv)


def attention_scales(q_rs, k_scale, v_scale, any_valid, d: int):
    """The kernel's scales operand [H, 2, Tq'] f32 (Tq' = :func:`padded_queries`), columns
    past Tq zero: row 0 Q's row scale times the head's logit factor (K scale x log2(e) /
    sqrt(D)), row 1 the head's output factor (V scale, times any_valid: 0 when no slot is
    valid). q_rs [Tq, H] f32; k_scale, v_scale [H]; any_valid [] f32."""
    tq, h = q_rs.shape
    head_sc = head_scales(k_scale, v_scale, any_valid, d)  # [H, 2]
    logit = q_rs * head_sc[None, :, 0]
    out_sc = jnp.broadcast_to(head_sc[None, :, 1], (tq, h))
    return jnp.pad(jnp.stack([logit.T, out_sc.T], axis=1),
                   ((0, 0), (0, 0), (0, padded_queries(tq) - tq)))


def valid_flag(valid):
    """[] f32: 1 when any slot is valid, else 0 (valid [S] bool or a SlotMask)."""
    return valid.any_valid if isinstance(valid, SlotMask) else jnp.any(valid).astype(jnp.float32)


def head_scales(k_scale, v_scale, any_valid, d):
    """[H, 2] f32: the logit factor of a head without Q's row scale (K scale x log2(e) /
    sqrt(D)) and its output factor (V scale, 0 when no slot is valid: any_valid [] f32)."""
    return jnp.stack([k_scale.astype(jnp.float32) * (LOG2E / math.sqrt(d)),
                      v_scale.astype(jnp.float32) * any_valid], axis=1)


def slot_bias(valid, block_kv):
    """[S'] f32, S' = S rounded up to block_kv: 0 for a valid slot, MASK_BIAS otherwise."""
    if isinstance(valid, SlotMask):
        if valid.block_kv == block_kv:
            return valid.bias
        valid = valid.valid
    s_pad = padded_slots(valid.shape[0], block_kv)
    return jnp.where(jnp.pad(valid, (0, s_pad - valid.shape[0])), 0.0,
                     MASK_BIAS).astype(jnp.float32)
