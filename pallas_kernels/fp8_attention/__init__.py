"""FP8 attention over the ring KV cache: the Pallas Mosaic GPU kernel, the reference and
the dispatcher.

One attention call of the model: ``Tq`` new queries (757 for characters-57b) attend over
``S`` cache slots (5,788: the sink, then six ring frames) whose K and V are stored as
float8_e4m3fn with one float32 dequantization scale per head (real = stored * scale).
Some slots are invalid (a short prompt leaves sink slots empty, the ring is partly empty
early in a session); ``valid`` masks them. The softmax scale is 1/sqrt(D).

``attention(impl=...)`` dispatches ('auto': the Pallas kernel on an NVIDIA Hopper GPU for
FP8 K/V and D == 128, the reference elsewhere) over:

* ``attention_reference`` (``reference``): plain ``jnp`` in float32, any shape, any
  backend: the definition of the op and the portable fallback; and
  ``attention_dot_product``: ``jax.nn.dot_product_attention`` (cuDNN or XLA) on
  dequantized bf16 K/V.
* ``attention_pallas`` (``api``; the kernel in ``kernel``): a FlashAttention-3-style
  kernel for Hopper (H100/H200), derived from jax's ``attention_mgpu.py``, with FP8 wgmma
  for both products. A tile is one head and 128 query rows: two compute warpgroups of 64
  rows and one memory warpgroup feeding K, V and the mask through TMA. The grid is
  persistent, one CTA per SM (stream-K, ``schedule``); the two compute warpgroups run
  freely, the row sums of P come from a small wgmma against a block of ones, blocks
  without a masked slot skip the bias, P's e4m3 codes come from the logits' float bits
  and the output is rescaled only when a row max moves past a margin (``inline``).

  - Q is quantized to e4m3 outside the kernel with one scale per (row, head), split into
    two e4m3 parts, hi = e4m3(q) and lo = e4m3(q - hi), so Q.K^T is two FP8 wgmmas into
    one accumulator (~2^-8 relative error; e4m3 Q alone costs ~2.5% in the logits). The
    row scale, the head's K scale, 1/sqrt(D) and log2(e) fold into one per-row factor
    that multiplies the FP8 logits (``operands``).
  - P ~ 256 exp2(s - m) (below 448, the e4m3 maximum) is fed from registers as the A
    operand of the P.V wgmma. The V scale is applied once, to the output.
  - FP8 wgmma needs both operands K-major, so P.V needs V^T in shared memory. The f32
    accumulator layout of P holds column pairs (2t, 2t+1, 2t+8, 2t+9) per thread where
    the 8-bit A layout expects quadruplets (4t..4t+3); rather than shuffling P between
    threads, the keys of each 16-key group of V^T are permuted the same way. V is read as
    the cache stores it, [S, H, D]: the memory warpgroup TMA-loads each V block into a
    staging buffer and writes the permuted transpose, bank-conflict-free, hidden under
    the compute warpgroups' matmuls.
  - S need not be a multiple of the KV block: the last K block runs past S, TMA fills
    those rows with zeros and the bias masks them. The last output tile's rows past Tq
    are padding (``padded_out``). The mask is a per-slot bias (0 or -1e30, finite so
    that no row can produce NaN); the output factor is zero when no slot is valid, so
    such rows come out as zeros.
"""

from pallas_kernels.fp8_attention.api import (IMPLS, PALLAS_IMPLS, attention, attention_pallas,
                                              resolve_impl)
from pallas_kernels.fp8_attention.kernel import KERNEL_NAME
from pallas_kernels.fp8_attention.operands import (LOG2E, QuantizedQ, SlotMask, attention_scales,
                                                   block_masked_flags, quantize_q, slot_mask)
from pallas_kernels.fp8_attention.reference import (attention_dot_product, attention_reference,
                                                    quantize_kv)
from pallas_kernels.fp8_attention.schedule import (DEFAULT_TUNING, AttentionTuning,
                                                   padded_queries, padded_slots)
from pallas_kernels.numerics import FP8 as F8, FP8_MAX as F8_MAX

__all__ = [
    "DEFAULT_TUNING", "F8", "F8_MAX", "IMPLS", "KERNEL_NAME", "LOG2E", "PALLAS_IMPLS",
    "AttentionTuning", "QuantizedQ", "SlotMask", "attention", "attention_dot_product",
    "attention_pallas", "attention_reference", "attention_scales", "block_masked_flags",
    "padded_queries", "padded_slots", "quantize_kv", "quantize_q", "resolve_impl", "slot_mask",
]
