"""Row-parallel GEMM + all-reduce with a pluggable reduction.

Called inside a ``jax.shard_map`` body over the tensor-parallel mesh axis.  Each
device holds a slice of the contraction dimension: x_shard [M, K/tp] and
w_shard [N, K/tp] (an ``Fp8Weight`` or a float array, stored (N, K)); the product
x_shard @ w_shard.T is a partial sum of the [M, N] result, and the partials of all
devices are summed (all-reduced) so that every device ends with the same [M, N].

A transformer block with parallel attention and MLP computes two such products
(attention-out and MLP-down) and reduces their sum once: pass a list of
(x_shard, w_shard) pairs to ``row_parallel_matmul_reduce``.

Methods (the ``method`` argument):
  'psum'      XLA dot(s), then ``lax.psum`` (NCCL all-reduce on GPUs).
  'ppermute'  a ring over row chunks of the output: at step s each device
              computes the partial of one chunk of rows while the running sum of
              the previous chunk travels to its ring neighbour (``lax.ppermute``);
              after tp-1 hops each device holds one fully reduced chunk
              (a reduce-scatter), and an all-gather rebuilds [M, N].  Only the
              activations are sliced (rows), never the weights, so no weight is
              copied.  Portable: runs on CPU devices too.
  'pallas'    the fused FP8 GEMM + all-reduce Pallas Mosaic GPU kernel
              (``pallas_kernels.fp8_gemm_allreduce``), NVIDIA Hopper only; output
              tiles are pushed to the peers as they finish while later tiles compute.
              Stacked weights (``Fp8Weight.layer``) are read in place by the kernel.
  'auto'      the best measured method for the backend (see ``resolve_method``).

Activation scales (``act_scale``): 'tensor' quantizes each x with one scale; 'row' with
one per row (token), applied to the product's rows after the GEMM (every method; the
fused kernels take the rows' scales in their epilogues).  An x may also come already
quantized (``Fp8Activation``, e.g. from ``pallas_kernels.fp8_row_quantize``), with zero
padding rows past the others' M: the other FP8 pairs are then quantized and padded to
its rows, and the result is sliced back to M.

At tp = 1 there is nothing to reduce: with stacked weights the fused methods take the
'psum' path, whose stacked GEMMs use the stream-K schedule (the fused kernel's
data-parallel GEMM is slower; BUILD_NOTES, "tp=1 row-parallel").

Stacked FP8 weights on the 'psum' path: the two largest-K products run as one stream-K
GEMM (the smaller leading in the same accumulator), any others are chained
through the stacked GEMM's epilogue addend (``stacked_partial``), and, where the Pallas kernel runs, x is
quantized and then padded to a multiple of 8 rows (the kernel's TMA tiling; 757 -> 760),
not 16, so the pad fuses into the quantization.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from characters_jax.parallel.fp8_linear import (
    Fp8Activation, Fp8Weight, check_act_scale, fp8_dot, linear, quantize, stacked_gemm_runs_kernel,
    stacked_linear)

METHODS = ("psum", "ppermute", "pallas", "auto")
# 'auto' uses the fused kernel for calls with at most this many (x, w) pairs.
AUTO_FUSED_MAX_PAIRS = 2
# FP8 GEMMs want M a multiple of 16 (XLA pads x and slices the output otherwise);
# the psum path pads once, reduces the padded rows and slices after the reduction,
# where the slice fuses into the consumer instead of costing a copy before the psum.
ROW_ALIGN = 16
# The stacked Pallas GEMM needs only a multiple of 8 rows (its TMA tiling): 757 -> 760
# (used where that kernel runs; the reference path keeps ROW_ALIGN).
STACKED_ROW_ALIGN = 8


def resolve_method(method: str, backend: str | None = None, pairs=None) -> str:
    """Maps 'auto' to a concrete method for the backend (and operands); checks the name.

    'auto' picks the fused kernel ('pallas') for up to ``AUTO_FUSED_MAX_PAIRS``
    FP8 pairs with per-tensor scales and tileable shapes on NVIDIA Hopper, where a
    single pair measured faster than XLA dot + psum (BUILD_NOTES.md, "FP8 GEMM +
    all-reduce"); 'psum' everywhere else.  The model's two-pair call (attention-out as
    the addend of MLP-down) is included: with the entry handshake its numerics equal
    FP8 GEMMs + psum (the numerics harness), and the block's o + down took 358 us
    against 402 us for stacked GEMMs + psum (H200 x 2; BUILD_NOTES.md).
    """
    if method not in METHODS:
        raise ValueError(f"unknown reduction method {method!r}; expected one of {METHODS}")
    if method != "auto":
        return method
    if ((backend or jax.default_backend()) != "gpu" or pairs is None
            or not 1 <= len(pairs) <= AUTO_FUSED_MAX_PAIRS):
        return "psum"
    from pallas_kernels import fp8_gemm_allreduce

    if not fp8_gemm_allreduce.is_supported():
        return "psum"
    # The fused pair is the one with the largest K (see _pallas_matmul_reduce); stacked
    # weights are read in place by the kernel (``layer``).
    x, w = max(pairs, key=lambda p: p[0].shape[1])
    if not all(isinstance(pw, Fp8Weight) and not pw.per_channel for _, pw in pairs):
        return "psum"
    if fp8_gemm_allreduce.fits(x.shape[1], w.shape[0]):
        return "pallas"
    return "psum"


def _as_pairs(x_or_pairs, w) -> list[tuple[jax.Array, object]]:
    if w is None:
        pairs = list(x_or_pairs)
        if not pairs:
            raise ValueError("expected at least one (x_shard, w_shard) pair")
        return [tuple(p) for p in pairs]
    return [(x_or_pairs, w)]


def _check_pairs(pairs) -> tuple[int, int]:
    """(M, N): M the fewest rows of any x; only an ``Fp8Activation`` may have more (zero
    padding rows, e.g. from a fused quantization kernel)."""
    m = min(x.shape[0] for x, _ in pairs)
    n = pairs[0][1].shape[0]
    for x, w in pairs:
        if len(x.shape) != 2 or (x.shape[0] != m and not isinstance(x, Fp8Activation)):
            raise ValueError(f"every x_shard must be [M={m}, K], got {x.shape}")
        if w.shape[0] != n or w.shape[1] != x.shape[1]:
            raise ValueError(f"w_shard {w.shape} does not match x_shard {x.shape} and N={n}")
    return m, n


def _align_rows(pairs, act_scale: str):
    """Pairs whose activations differ in rows (an ``Fp8Activation`` with padding rows
    beside float activations): every FP8 pair quantized (then padded: the FP8 pad fuses into
    the quantization), so that all carry the most rows."""
    rows = max(x.shape[0] for x, _ in pairs)
    if all(x.shape[0] == rows for x, _ in pairs):
        return pairs
    return [(_pad_activation(quantize(x, act_scale), rows) if isinstance(w, Fp8Weight)
             else x, w) for x, w in pairs]


def local_partial(pairs: Sequence[tuple[jax.Array, object]], out_dtype,
                  act_scale: str = "tensor") -> jax.Array:
    """Sum over pairs of x @ w.T on this device: [M, N] in out_dtype.

    The partials are summed in f32 and the sum is rounded to out_dtype once.
    """
    acc = None
    for x, w in pairs:
        y = linear(x, w, out_dtype=jnp.float32, act_scale=act_scale)
        acc = y if acc is None else acc + y
    return acc.astype(out_dtype)


def _all_stacked(pairs) -> bool:
    return all(isinstance(w, Fp8Weight) and w.stacked and not w.per_channel for _, w in pairs)


def joinable(lead, main) -> bool:
    """Whether two stacked (x, w) pairs can run as one stream-K GEMM (``lead``): both on the
    Pallas kernel here, the same [L, N] stack shape and the same layer (the one traced
    index: the block's)."""
    (_, lw), (_, w) = lead, main
    return (lw.layer is w.layer and lw.values.shape[:2] == w.values.shape[:2]
            and stacked_gemm_runs_kernel(lw) and stacked_gemm_runs_kernel(w))


def stacked_partial(pairs: Sequence[tuple[jax.Array, Fp8Weight]], out_dtype,
                    act_scale: str = "tensor") -> jax.Array:
    """Sum over pairs of x @ w.T for stacked per-tensor FP8 weights: [M, N] out_dtype.

    The two largest-K pairs, where ``joinable``, run as one stream-K GEMM over both K
    ranges (the smaller's product leading in the same accumulator): for the block's
    attention-out + MLP-down one kernel and no [M, N] partial between two. Otherwise (and
    for the rest) the products are chained through the GEMM's epilogue addend, smallest K
    first: each product is written once, in the dtype the next GEMM
    reads as its addend, and the last one in out_dtype.  With the stacked Pallas kernel
    that dtype is out_dtype (bf16 for the model: one bf16 [M, N] write and read instead of
    two f32 outputs, an XLA add and a convert); on the reference path it is float32, so
    the sum is rounded once, as in ``local_partial``.
    """
    order = sorted(pairs, key=lambda p: p[0].shape[1])
    lead = None
    if len(order) >= 2 and joinable(order[-2], order[-1]):
        lead, order = order[-2], order[:-2] + order[-1:]
    acc = None
    for i, (x, w) in enumerate(order):
        last = i == len(order) - 1
        if last:
            dtype = out_dtype
        else:
            _, w_next = order[i + 1]
            dtype = out_dtype if stacked_gemm_runs_kernel(w_next) else jnp.float32
        acc = stacked_linear(x, w, out_dtype=dtype, addend=acc, act_scale=act_scale,
                             lead=lead if last else None)
    return acc


def _pad_activation(xq: Fp8Activation, rows: int) -> Fp8Activation:
    """Zero rows appended to the values up to ``rows``; per-row scales stay those of the real
    rows (``Fp8Activation.row_scales`` pads them where needed; the stacked kernel bounds its
    copy of them, so no pad kernel runs)."""
    return xq if xq.shape[0] == rows else Fp8Activation(_pad_rows(xq.values, rows), xq.scale)


def _psum_matmul_reduce(pairs, axis_name: str, out_dtype, act_scale: str) -> jax.Array:
    m = pairs[0][0].shape[0]
    stacked = _all_stacked(pairs)
    # 8 rows for the stacked kernel; elsewhere 16 (XLA's FP8 GEMM; the reference path keeps
    # the row count, and with it the float rounding, of the sliced path).
    kernel = stacked and all(stacked_gemm_runs_kernel(w) for _, w in pairs)
    align = STACKED_ROW_ALIGN if kernel else ROW_ALIGN
    mp = -(-m // align) * align
    if kernel:
        # Quantized first, then padded: the FP8 pad fuses into the quantization (a bf16 pad
        # in front of the amax is a copy: ~10 ms per step at tp=1, H200).
        pairs = [(_pad_activation(quantize(x, act_scale), mp), w) for x, w in pairs]
    elif any(isinstance(w, Fp8Weight) for _, w in pairs):
        pairs = [(_pad_rows(x, mp), w) for x, w in pairs]
    else:
        mp = m
    partial = (stacked_partial(pairs, out_dtype, act_scale) if stacked
               else local_partial(pairs, out_dtype, act_scale))
    out = lax.psum(partial, axis_name)
    return out[:m] if mp != m else out


def _ring_all_reduce_rows(chunk_partial, m: int, tp: int, axis_name: str) -> jax.Array:
    """Ring reduce-scatter over row chunks, then all-gather.

    chunk_partial(c) returns this device's partial [mc, N] (f32) for row chunk c
    (a traced int).  Device d computes chunk (d + s + 1) % tp at step s and adds it
    to the running sum received from device d + 1, so after tp - 1 hops it holds
    chunk d reduced over all devices.  The matmul of step s does not depend on
    the hop of step s - 1, so the two can overlap.
    Returns the reduced [m, N].
    """
    d = lax.axis_index(axis_name)
    to_left = [(i, (i - 1) % tp) for i in range(tp)]
    acc = chunk_partial((d + 1) % tp)
    out_dtype = acc.dtype
    for s in range(1, tp):
        local = chunk_partial((d + s + 1) % tp)
        received = lax.ppermute(acc, axis_name, to_left)
        acc = (received.astype(jnp.float32) + local.astype(jnp.float32)).astype(out_dtype)
    full = lax.all_gather(acc, axis_name, axis=0, tiled=True)  # [tp * mc, N]
    return full[:m]


def _pad_rows(x, rows: int):
    """x [M, K] (an array or an ``Fp8Activation``) with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    if isinstance(x, Fp8Activation):
        return _pad_activation(x, rows)
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _ppermute_matmul_reduce(pairs, axis_name: str, out_dtype, act_scale: str) -> jax.Array:
    m, _ = _check_pairs(pairs)
    tp = lax.axis_size(axis_name)
    if tp == 1:
        return local_partial(pairs, out_dtype, act_scale)
    mc = -(-m // tp)
    # Quantize each activation once (per tensor: one scale for all its rows), then slice
    # rows (and per-row scales with them).
    prepared = []
    for x, w in pairs:
        if isinstance(w, Fp8Weight):
            xq = _pad_activation(quantize(x, act_scale), mc * tp)
            prepared.append((xq.values, w.values, xq.row_scales() if xq.per_row else None,
                             w.scale if xq.per_row else xq.scale * w.scale))
        else:
            prepared.append((_pad_rows(x, mc * tp), w.astype(x.dtype), None, None))

    def chunk_partial(c):
        acc = None
        for x_op, w_op, row_scale, scale in prepared:
            rows = lax.dynamic_slice_in_dim(x_op, c * mc, mc, axis=0)
            if scale is None:
                y = lax.dot_general(rows, w_op, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            else:
                y = fp8_dot(rows, w_op, jnp.float32) * scale
                if row_scale is not None:
                    y = y * lax.dynamic_slice_in_dim(row_scale, c * mc, mc)[:, None]
            acc = y if acc is None else acc + y
        return acc.astype(out_dtype)

    return _ring_all_reduce_rows(chunk_partial, m, tp, axis_name)


def _pallas_matmul_reduce(pairs, axis_name: str, out_dtype, act_scale: str) -> jax.Array:
    from pallas_kernels import fp8_gemm_allreduce

    # The fused kernel runs the pair with the largest K; the others are computed first
    # (XLA, or the stacked kernel for stacked weights) and enter the kernel's epilogue as an
    # addend in out_dtype.  Stacked weights are read in place (``layer``), never sliced.
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0].shape[1])
    x, w = pairs[order[-1]]
    rest = [pairs[i] for i in order[:-1]]
    if not rest:
        addend = None
    elif _all_stacked(rest):
        addend = stacked_partial(rest, out_dtype, act_scale)
    else:
        addend = local_partial(rest, out_dtype, act_scale)
    if not isinstance(w, Fp8Weight):
        raise NotImplementedError("method='pallas' needs an Fp8Weight for the fused pair")
    xq = quantize(x, act_scale)
    # A stack's scales whole (the kernels read the layer's); a single weight's as it is.
    return fp8_gemm_allreduce.gemm_allreduce(xq.values, w.values, w.scale, layer=w.layer,
                                             addend=addend, axis_name=axis_name,
                                             out_dtype=out_dtype, x_scale=xq.scale)


def row_parallel_matmul_reduce(x_shard, w_shard=None, *, axis_name: str = "tp",
                               method: str = "psum", out_dtype=None,
                               act_scale: str = "tensor") -> jax.Array:
    """All-reduced row-parallel product, inside a shard_map body over ``axis_name``.

    Args:
      x_shard: [M, K/tp] activations (bf16/f32), or a list of (x_shard, w_shard)
        pairs whose products are summed before the single reduction.
      w_shard: [N, K/tp] ``Fp8Weight`` or float array (omit when passing pairs).
      axis_name: the tensor-parallel mesh axis.
      method: 'psum' | 'ppermute' | 'pallas' | 'auto' (module docstring).
      out_dtype: dtype of the result and of the communicated partials
        (default: the first activation's dtype).
      act_scale: how activations are quantized for FP8 weights: 'tensor' | 'row'
        (module docstring).
    Returns:
      [M, N] = sum over devices (and pairs) of x @ w.T, replicated on every device.
    """
    pairs = _as_pairs(x_shard, w_shard)
    m, _ = _check_pairs(pairs)
    check_act_scale(act_scale)
    if out_dtype is None:
        first = pairs[0][0]
        if isinstance(first, Fp8Activation):
            raise ValueError("out_dtype is required when the first activation is FP8")
        out_dtype = first.dtype
    out_dtype = jnp.dtype(out_dtype)
    pairs = _align_rows(pairs, act_scale)
    method = resolve_method(method, jax.default_backend(), pairs)
    if method == "pallas" and lax.axis_size(axis_name) == 1 and _all_stacked(pairs):
        method = "psum"  # no peers: the stacked (stream-K) GEMMs alone
    if method == "psum":
        out = _psum_matmul_reduce(pairs, axis_name, out_dtype, act_scale)
    elif method == "ppermute":
        # The ring takes one [N, K] weight: stacked weights are sliced out (an XLA copy).
        pairs = [(x, w.at_layer() if isinstance(w, Fp8Weight) else w) for x, w in pairs]
        out = _ppermute_matmul_reduce(pairs, axis_name, out_dtype, act_scale)
    else:
        out = _pallas_matmul_reduce(pairs, axis_name, out_dtype, act_scale)
    return out[:m]
