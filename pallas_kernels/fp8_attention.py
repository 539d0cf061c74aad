"""FP8 attention over the ring KV cache: Pallas Mosaic GPU kernel, reference, dispatcher.

One attention call of the model: ``Tq`` new queries (757 for characters-57b) attend over
``S`` cache slots (5,788: the sink, then six ring frames) whose K and V are stored as
float8_e4m3fn with one float32 dequantization scale per head (real = stored * scale).
Some slots are invalid (a short prompt leaves sink slots empty, the ring is partly empty
early in a session); ``valid`` masks them. The softmax scale is 1/sqrt(D).

Three implementations sit side by side:

* :func:`attention_reference`: plain ``jnp`` in float32, any shape, any backend. It is
  the definition of the op and the portable fallback.
* :func:`attention_pallas`: a FlashAttention-3-style kernel for Hopper (H100/H200)
  written with Pallas' Mosaic GPU backend (``plgpu``), derived from jax's
  ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``, with FP8 wgmma for both
  products. A tile is one head and 128 query rows: two compute warpgroups of 64 rows
  each and one memory warpgroup feeding K, V and the mask through TMA into a ring of SMEM
  stages. By default the grid is persistent, one CTA per SM (stream-K): the tiles' KV
  blocks are split evenly over the CTAs, a CTA's range cuts tiles, and the CTA holding a
  tile's first block merges the others' bf16 partials (log2-sum-exp per row, GMEM
  semaphores) in the kernel (:func:`_fp8_attention_call`, ``num_ctas``). The kernel is
  softmax-bound on the H200 (a profile of its named scopes: ~1,560 cycles per warpgroup
  and 128-key step against ~830 of tensor work), so by default the two warpgroups run
  freely (no ping-pong schedule barrier: their softmaxes overlap), the row sums of P come
  from a small wgmma against a block of ones, and blocks without a masked slot skip the
  bias (``pingpong``, ``l_in_pv``, ``fast_unmasked``). Also on by default (BUILD_NOTES,
  GPU runs 14-23): ``p_codes`` (P's e4m3 codes from the logits' float bits, no ex2 and no
  cvt) with ``lazy_rescale`` (the output rescale only when a row max moves past a margin),
  twice the error of ex2 (``impl='pallas-exp2'``) and still within the model's run-to-run
  spread, and the wide V transpose; with V^T from the cache (``v_transposed``) 3 stages.
  Options off by default, correct on the H200 and slower: ``overlap='qk'`` / ``'pv'``
  (FlashAttention-3's intra-warpgroup pipelining, which ptxas serializes),
  ``overlap='batch'`` with the ping-pong (its inter-warpgroup order), ``bit_exp2``
  (exponentials from float bits). ``q_in_kernel`` (Q quantized in the kernel,
  ``impl='pallas-qik'``): GPU run 24, the kernel 2-6% slower and the call 4-7% faster
  (the wrapper's Q passes go). Without any softmax the kernel still runs at ~2.6 k
  cycles per 128-key step against 1.5 k of tensor work (``debug``): the lock-step
  wgmma issue/wait pattern and the memory warpgroup's V transpose bound it.

  - Q is quantized to e4m3 outside the kernel with one scale per (row, head); the row
    scale, the head's K scale, 1/sqrt(D) and log2(e) fold into one per-row factor that
    multiplies the FP8 logits. e4m3 Q alone costs ~2.5% relative error in the logits,
    which is as large as the whole 3e-2 budget on random data, so by default
    (``q_split=True``) Q is split into two e4m3 parts, hi = e4m3(q) and
    lo = e4m3(q - hi), and Q.K^T is two FP8 wgmmas into one accumulator (~2^-8
    relative error). ``q_split=False`` is one wgmma and the faster, coarser option.
  - P = exp2(s - m) is taken times 256 (still < 448, the e4m3 maximum; fewer
    underflows), cast to e4m3 and fed from registers as the A operand of the P.V wgmma.
    The V scale is applied once, to the output.
  - FP8 wgmma needs both operands K-major, so P.V needs V^T in shared memory. The f32
    accumulator layout of P holds column pairs (2t, 2t+1, 2t+8, 2t+9) per thread where
    the 8-bit A layout expects quadruplets (4t..4t+3); rather than shuffling P between
    threads, the keys of each 16-key group of V^T are permuted the same way, so the P
    registers are used as they are. By default (``v_in_kernel=True``) V is read as the
    cache stores it, [S, H, D]: the memory warpgroup TMA-loads each V block into a
    staging buffer and writes the permuted transpose with 32-bit shared loads/stores and
    byte permutes, bank-conflict-free, hidden under the compute warpgroups' matmuls
    (H200: +2 us of kernel time at 18 heads, and no 25-45 us XLA transpose per call).
    ``v_in_kernel=False`` builds V^T with XLA in the wrapper (GPU run 1's kernel).
    ``v_transposed=True`` takes V^T as a cache can store it (:func:`transpose_v`; the ring
    cache's ``v_cache='transposed'``): its blocks go by TMA straight into the wgmma's
    buffer, and the memory warpgroup does no transpose.
  - S need not be a multiple of the KV block: the last K block runs past S, TMA fills
    those rows with zeros and the bias masks them. Q is padded to a multiple of 128
    rows; the last output tile's store runs past Tq and TMA drops those rows. The mask
    is a per-slot bias (0 or -1e30, finite so that no row can produce NaN); the output
    factor is zero when no slot is valid, so such rows come out as zeros.
* ``jax.nn.dot_product_attention`` (cuDNN or XLA) on dequantized bf16 K/V, for
  comparison.

:func:`attention` dispatches: ``impl='auto'`` takes the Pallas kernel on an NVIDIA
Hopper GPU when K/V are FP8 and D == 128, the reference elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8_gemm_allreduce import device_sm_count
from pallas_kernels.mgpu_sync import fence_proxy_async_global

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0
LOG2E = math.log2(math.e)
_MASK_BIAS = -1e30  # finite: a fully masked row gives zeros, never NaN
_P_LOG2_SCALE = 8.0  # P is quantized as 256 * exp2(s - m)
IMPLS = ("auto", "reference", "pallas", "pallas-exp2", "pallas-qik", "cudnn", "xla")
# The Pallas kernel's impl names and their options: 'pallas' is attention_pallas's
# defaults (P's e4m3 codes from the logits' bits, the lazy rescale, the wide V transpose:
# the fastest measured set, BUILD_NOTES GPU runs 18-20); 'pallas-exp2' P from MUFU ex2 +
# cvt and the eager rescale (half the kernel's error, ~10% slower: the comparison for the
# step benchmark and the numerics harness); 'pallas-qik' Q quantized in the kernel (no
# XLA passes over Q in the wrapper).
PALLAS_IMPLS = {"pallas": {}, "pallas-exp2": {"p_codes": 0, "lazy_rescale": False},
                "pallas-qik": {"q_in_kernel": True}}
# exp2 from float bits (``bit_exp2``): u = y + _EXP2_MAGIC has a ulp of 2^-10 for
# |y| < 2^12, so its bits hold round(1024 y) plus a constant; shifted into the exponent
# field they give 2^floor(y) (1 + frac(y)) (Schraudolph's approximation, <= 6.1% high),
# times 2^-_EXP2_SHIFT, which the e4m3 rounding of P favours (numpy emulation of the
# kernel: rel. err 0.0084 at 0.045 against 0.0138 unshifted and 0.0068 with ex2).
_EXP2_MAGIC = 1.5 * 2**13
_EXP2_FLOOR = -100.0  # y is clamped here first: 2^-100 is 0 in e4m3; -1e30 has no bits
_EXP2_SHIFT = 0.045
_EXP2_ADD = (round((127 - _EXP2_SHIFT) * 2**23)
             - int(np.array(_EXP2_MAGIC, np.float32).view(np.int32)) * 2**13
             + 2**31) % 2**32 - 2**31
# P as e4m3 codes straight from the logits (``p_codes``), no MUFU ex2 and no cvt: an
# e4m3 code is 8 x (biased exponent) + mantissa, so round(8 y + 56 + _CODE_SHIFT) is the
# code of ~2^y (Schraudolph's linear mantissa on the e4m3 grid), y = log2 P <= 8. In the
# kernel: v = fma.sat(x, a, b) = clamp(code / 128, 0, 1), then fma(v, 128, _CODE_MAGIC)
# puts round(128 v) in the low byte of its bits, and byte permutes pack four codes per
# 32-bit register in the 8-bit wgmma layout. Codes below 8 are e4m3 subnormals, linear
# in value, not in y: with the low-range line (p_codes=2) the code is at least
# _CODE_LOW_SLOPE * y + _CODE_LOW_OFFSET, the tangent of 2^(y + 9) (the exact subnormal
# code) at y = -8, so that P in [2^-10, 2^-6] is not lost (numpy emulation of the kernel,
# inputs with outliers, 757 x 5788: rel. err 0.0095 with the line, 0.0185 without,
# 0.0068 with ex2; without outliers 0.023 either way against 0.017 with ex2).
_CODE_SHIFT = -0.25  # with lazy_rescale y <= 8.75: code <= 125.75 -> 126 (448), no NaN
_CODE_LOW_SLOPE = 2.0 * math.log(2.0)
_CODE_LOW_OFFSET = 2.0 + 8.0 * _CODE_LOW_SLOPE + 0.5
_CODE_MAGIC = 1.5 * 2**23  # 1 ulp = 1: fma(v, 128, magic) rounds 128 v into the low bits
# prmt selectors that pack the low bytes of four words a, b, c, d into [a, b, c, d]:
# lo = prmt(a, b, PAIR), hi = prmt(c, d, PAIR), word = prmt(lo, hi, QUAD).
_PACK_PAIR_SEL, _PACK_QUAD_SEL = 0x0040, 0x5410
# lazy_rescale: the running row max (log2 units) moves only past this margin, so P <=
# 2^(8 + margin) = 430 < 448 (e4m3's maximum; code 126 with p_codes).
_LAZY_RESCALE = 0.75
# The kernel's name as profiler traces show it ('fp8_attention_mosaic_gpu_kernel').
KERNEL_NAME = "fp8_attention"

__all__ = [
    "attention",
    "attention_reference",
    "attention_pallas",
    "attention_dot_product",
    "quantize_kv",
]


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# cuDNN / XLA comparison path
# --------------------------------------------------------------------------------------


def attention_dot_product(q, k, v, k_scale, v_scale, valid, *, implementation):
    """``jax.nn.dot_product_attention`` on bf16-dequantized K/V ('cudnn' or 'xla')."""
    dt = jnp.bfloat16
    kf = (k.astype(jnp.float32) * k_scale[None, :, None]).astype(dt)
    vf = (v.astype(jnp.float32) * v_scale[None, :, None]).astype(dt)
    mask = jnp.broadcast_to(valid[None, None, None, :], (1, 1, q.shape[0], k.shape[0]))
    o = jax.nn.dot_product_attention(
        q.astype(dt)[None], kf[None], vf[None], mask=mask, implementation=implementation)
    return o[0].astype(q.dtype)


# --------------------------------------------------------------------------------------
# Pallas Mosaic GPU kernel
# --------------------------------------------------------------------------------------

BLOCK_Q = 64  # rows per compute warpgroup (the wgmma M)
COMPUTE_WGS = 2


def exp2_from_bits(u):
    """~2^y for u = y + _EXP2_MAGIC (f32), y <= 8: 2^floor(y) (1 + frac(y)) 2^-0.045,
    one integer multiply-add on the bits instead of a MUFU ex2 (any backend, and inside
    the kernel). y below _EXP2_FLOOR must be clamped by the caller."""
    i = lax.bitcast_convert_type(u, jnp.int32) * (2**13) + jnp.int32(_EXP2_ADD)
    return lax.bitcast_convert_type(i, jnp.float32)


def _vec_elem(v, i: int):
    """Kernel code: element i (static) of an MLIR vector value."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector
    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def p_code_coefficients(xa, y_off, low_line: bool):
    """Per-row coefficients of the e4m3 P codes for y = x * xa + y_off (any shapes that
    broadcast): ((a, b), plus (a2, b2) with the low-range line), with which the kernel
    computes code / 128 = max(clamp(x a + b, 0, 1), x a2 + b2)."""
    c = ((xa * (1.0 / 16.0), y_off * (1.0 / 16.0) + (56.0 + _CODE_SHIFT) / 128.0),)
    if low_line:
        c += ((xa * (_CODE_LOW_SLOPE / 128.0),
               y_off * (_CODE_LOW_SLOPE / 128.0) + _CODE_LOW_OFFSET / 128.0),)
    return c


def p_codes_reference(x, xa, y_off, low_line: bool):
    """What the kernel's ``p_codes`` P is, as e4m3 values (f32): the codes of
    :func:`p_code_coefficients` for y = x * xa + y_off, rounded half to even."""
    (a, b), *low = p_code_coefficients(xa, y_off, low_line)
    v = jnp.clip(x * a + b, 0.0, 1.0)
    for a2, b2 in low:
        v = jnp.maximum(v, x * a2 + b2)
    code = jnp.round(v * 128.0).astype(jnp.uint8)
    return lax.bitcast_convert_type(code, F8).astype(jnp.float32)


def _p_codes_8bit_a(x, coefs, block_kv: int, raw: bool = False):
    """Kernel code: e4m3 P codes (:func:`p_codes_reference`) of x [64, bkv] f32 (WGMMA
    layout) in the 8-bit wgmma A layout, no MUFU, no cvt. coefs: the
    :func:`p_code_coefficients` pairs, each broadcast to x's shape. Per four elements of
    a row: four saturating FMAs (two more FMAs and a max each with the low-range line),
    four rounding FMAs and three byte permutes, one inline PTX block. The register
    grouping is :func:`_key_permutation`'s (pairs 2g and 2g + 1 of a row form one
    32-bit register), as in the e4m3 cast + regroup of the MUFU path. raw (a timing
    diagnostic): only the byte permutes, on x's own bits."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir

    low_line = len(coefs) == 2
    flat = [c for pair in coefs for c in pair]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,) * (1 + len(flat)),
        return_type=plgpu.ShapeDtypeStruct((BLOCK_Q, block_kv), F8,
                                           layout=plgpu.Layout.WGMMA_8BIT),
    )
    def codes(ctx, xs, *cs):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        lines = [f"fma.rn.sat.f32 t{i}, ${i + 1}, $5, $6;" for i in range(4)]
        if low_line:
            lines += [f"fma.rn.f32 w{i}, ${i + 1}, $7, $8;\n\tmax.f32 t{i}, t{i}, w{i};"
                      for i in range(4)]
        f32_hex = lambda v: f"0f{int(np.array(v, np.float32).view(np.uint32)):08X}"
        lines += [f"fma.rn.f32 t{i}, t{i}, {f32_hex(128.0)}, {f32_hex(_CODE_MAGIC)};"
                  for i in range(4)]
        if raw:
            lines = [f"mov.b32 t{i}, ${i + 1};" for i in range(4)]
        lines += [f"prmt.b32 lo, t0, t1, {_PACK_PAIR_SEL:#06x};",
                  f"prmt.b32 hi, t2, t3, {_PACK_PAIR_SEL:#06x};",
                  f"prmt.b32 $0, lo, hi, {_PACK_QUAD_SEL:#06x};"]
        ptx = ("{\n\t.reg .f32 t0, t1, t2, t3, w0, w1, w2, w3;\n\t.reg .b32 lo, hi;\n\t"
               + "\n\t".join(lines) + "\n\t}")
        regs = xs.registers  # [1, bkv/8, 1, 1, 2, 1, 1, 1, 1] of vector<2xf32>
        new = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((BLOCK_Q, block_kv)), object)
        for rh in range(2):
            # each coefficient is constant along a row: any register of row half rh
            row = [_vec_elem(c.registers[0, 0, 0, 0, rh, 0, 0, 0, 0], 0) for c in cs]
            for g in range(block_kv // 16):
                vals = [_vec_elem(regs[0, 2 * g + k, 0, 0, rh, 0, 0, 0, 0], e)
                        for k in range(2) for e in range(2)]
                word = utils.inline_ptx(ptx, *vals, *row, result_types=i32)
                new[0, g, 0, 0, rh, 0, 0, 0, 0] = utils.bitcast(word, f8x4)
        return mgpu.FragmentedArray(_registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                    _is_signed=None)

    return codes(x, *flat)


def _rescale_rows_if_any(acc, alpha):
    """Kernel code: acc [64, D] f32 (WGMMA layout) times alpha [64] per row, skipped by a
    warp (a branch on a warp vote) when all of its 16 rows have alpha == 1."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, scf

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                       return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def rescale(ctx, a, al):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        regs = a.registers  # [1, D/8, 1, 1, 2, 1, 1, 1, 1] of vector<2xf32>
        rows = [al.registers[0, 0, 0, 0, rh, 0, 0, 0, 0] for rh in range(2)]
        one = arith.constant(f32, 1.0)
        ne = [arith.cmpf(arith.CmpFPredicate.UNE, _vec_elem(r, 0), one) for r in rows]
        mine = arith.extui(i32, arith.ori(*ne))
        any_w = utils.inline_ptx(
            "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $1, 0;\n\t"
            "vote.sync.any.pred p, p, 0xffffffff;\n\tselp.u32 $0, 1, 0, p;\n\t}",
            mine, result_types=i32, convergent=True)
        cond = arith.cmpi(arith.CmpIPredicate.ne, any_w, arith.constant(i32, 0))
        idx = list(np.ndindex(regs.shape))
        flat = [regs[i] for i in idx]
        if_op = scf.IfOp(cond, [r.type for r in flat], has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            scf.yield_([arith.mulf(r, rows[i[4]]) for r, i in zip(flat, idx)])
        with ir.InsertionPoint(if_op.else_block):
            scf.yield_(flat)
        new = np.empty(regs.shape, object)
        for i, r in zip(idx, if_op.results):
            new[i] = r
        return mgpu.FragmentedArray(_registers=new, _layout=a.layout, _is_signed=None)

    return rescale(acc, lax.broadcast_in_dim(alpha, acc.shape, [0]))


def _key_permutation(block_kv: int) -> np.ndarray:
    """perm[i] = local key index whose V row sits at position i of a V^T block.

    Within each 16-key group, the key 8h + 2t + v (h<2, t<4, v<2) goes to 4t + 2h + v:
    that is where the 8-bit wgmma A layout reads the P value that the f32 accumulator
    layout holds for that key.
    """
    idx = np.arange(block_kv).reshape(block_kv // 16, 2, 4, 2)  # (g, h, t, v)
    return idx.transpose(0, 2, 1, 3).reshape(-1)


class _IntOps:
    """Integer arithmetic on Python ints (the CPU emulation's side of the V transpose's
    address plans; the kernel passes :class:`_MlirOps`)."""
    add = staticmethod(operator.add)
    mul = staticmethod(operator.mul)
    xor = staticmethod(operator.xor)
    and_ = staticmethod(operator.and_)
    or_ = staticmethod(operator.or_)
    shr = staticmethod(operator.rshift)


class _MlirOps:
    """The same operations as :class:`_IntOps` on i32 MLIR values (ints become constants)."""

    def __init__(self):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith
        i32 = ir.IntegerType.get_signless(32)
        lift = lambda x: arith.constant(i32, x) if isinstance(x, int) else x
        for name, op in (("add", arith.addi), ("mul", arith.muli), ("xor", arith.xori),
                         ("and_", arith.andi), ("or_", arith.ori), ("shr", arith.shrui)):
            setattr(self, name, lambda a, b, op=op: op(lift(a), lift(b)))


def _transpose_4x4(prmt, r0, r1, r2, r3):
    """Four 32-bit words (rows) -> their byte transpose: out[j] = (r0.b_j, r1.b_j, r2.b_j,
    r3.b_j), 8 prmt (prmt(a, b, sel): any function on ints or MLIR values)."""
    t01l, t01h = prmt(r0, r1, 0x5140), prmt(r0, r1, 0x7362)
    t23l, t23h = prmt(r2, r3, 0x5140), prmt(r2, r3, 0x7362)
    return (prmt(t01l, t23l, 0x5410), prmt(t01l, t23l, 0x7632),
            prmt(t01h, t23h, 0x5410), prmt(t01h, t23h, 0x7632))


def _word_transpose_plan(o, warp, lane, it):
    """The word transpose's byte offsets for thread (warp, lane) in iteration it < 8:
    four 32-bit loads (keys 16g + 2t + {0, 1, 8, 9} at d = 4 lane..4 lane + 3 of the raw
    [key, d] block) and the four stores of their transpose (d = 4 lane + j, columns
    4t..4t + 3 of group g, 128-byte swizzle), wk = lane ^ (8 warp + it), g = wk // 4,
    t = wk % 4. Returns (loads [4], stores [[4]])."""
    wk = o.xor(lane, o.add(o.mul(warp, 8), it))
    g, t = o.shr(wk, 2), o.and_(wk, 3)
    key0 = o.add(o.mul(g, 16), o.mul(t, 2))
    lane4 = o.mul(lane, 4)
    loads = [o.add(o.mul(o.add(key0, dk), 128), lane4) for dk in (0, 1, 8, 9)]
    stores = []
    for j in range(4):
        dd = o.add(lane4, j)
        chunk = o.xor(g, o.and_(dd, 7))
        stores.append(o.add(o.add(o.mul(dd, 128), o.mul(chunk, 16)), o.mul(t, 4)))
    return loads, [stores]


def _wide_transpose_plan(o, warp, lane, it):
    """The wide transpose's byte offsets for thread (warp, lane) in iteration it < 2: four
    16-byte loads (keys 16g + 2t + {0, 1, 8, 9}, d = d0..d0 + 15) and the 16 stores of
    their transpose (d = d0 + 4m + b, columns 4t..4t + 3 of group g), with g = lane % 8,
    t = lane // 8, d0 = 16 ((g + 2 warp + it) % 8). Each quarter warp's loads hit 8
    distinct 16-byte bank groups (distinct d0) and each warp-wide store 32 distinct banks
    (the swizzle XOR of distinct g by one d % 8, times 4 t). The 128-byte swizzle only
    flips bits 4-6 of the address, which hold g: store = ((d0*128 + 4t) | 16g) ^ 16 (d %
    8) + 128 (4m + b). Returns (loads [4], stores [4][4] by m, b)."""
    g, t = o.and_(lane, 7), o.shr(lane, 3)
    d0 = o.mul(o.and_(o.add(g, o.add(o.mul(warp, 2), it)), 7), 16)
    key0 = o.add(o.mul(g, 16), o.mul(t, 2))
    load0 = o.add(o.mul(key0, 128), d0)
    loads = [o.add(load0, dk * 128) for dk in (0, 1, 8, 9)]
    base = o.or_(o.add(o.mul(d0, 128), o.mul(t, 4)), o.mul(g, 16))
    stores = [[o.add(o.xor(base, 16 * ((4 * m + b) % 8)), 128 * (4 * m + b))
               for b in range(4)] for m in range(4)]
    return loads, stores


def _transpose_v_block(raw_ref, vt_ref, wide: bool = False):
    """Memory-warpgroup code: V^T[slot] <- key-permuted transpose of a staged V block.

    raw_ref: [bkv=128, D=128] e4m3, plain (as TMA wrote it: row = key, 128 bytes).
    vt_ref: [D, bkv] e4m3, the plain alias of the wgmma's V^T buffer, whose bytes follow
    the 128-byte swizzle: byte (d, c) sits at d*128 + ((c // 16) ^ (d % 8))*16 + c % 16.
    Column c = 4t + 2h + v of a 16-key group g holds key 16g + 8h + 2t + v
    (:func:`_key_permutation`), so each 32-bit store word (columns 4t..4t+3) gathers keys
    16g + (2t, 2t+1, 2t+8, 2t+9).

    wide=False (:func:`_word_transpose_plan`): 8 iterations of four 32-bit loads, a 4x4
    byte transpose (8 prmt) and four 32-bit stores, bank-conflict-free (~34 instructions
    an iteration in SASS, 18 of them address arithmetic). wide=True
    (:func:`_wide_transpose_plan`): 2 iterations of four 16-byte loads, four 4x4
    transposes and 16 stores, the store addresses one XOR each: about half the
    instructions, also bank-conflict-free.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def tr(ctx, raw, vt):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        c = lambda x: arith.constant(i32, x)
        tid = utils.thread_idx()
        lane = arith.andi(tid, c(31))
        warp = arith.andi(arith.shrui(tid, c(5)), c(3))
        raw_p = utils.memref_ptr(raw)
        vt_p = utils.memref_ptr(vt)
        ops = _MlirOps()

        def prmt(a, b, sel):
            return utils.inline_ptx("prmt.b32 $0, $1, $2, $3;", a, b, c(sel),
                                    result_types=i32)

        # A loop, not unrolled: this runs in the memory warpgroup under 40 registers.
        @utils.fori(c(2 if wide else 8), ())
        def _(it, carry):
            plan = _wide_transpose_plan if wide else _word_transpose_plan
            loads, stores = plan(ops, warp, lane, it)
            if wide:
                v4 = ir.VectorType.get((4,), i32)
                rows = [llvm.load(v4, utils.getelementptr(raw_p, [off], i8), alignment=16)
                        for off in loads]
                words = [[_vec_elem(r, m) for r in rows] for m in range(4)]
            else:
                words = [[llvm.load(i32, utils.getelementptr(raw_p, [off], i8))
                          for off in loads]]
            for quad, offs in zip(words, stores):
                for o_, off in zip(_transpose_4x4(prmt, *quad), offs):
                    llvm.store(o_, utils.getelementptr(vt_p, [off], i8))
            return carry

    tr(raw_ref, vt_ref)


def _fill_ones(ref):
    """Memory-warpgroup code: ref, 1,024 bytes (8 rows of 128 e4m3) <- 1.0 (0x38): all
    bytes alike, so the 128-byte swizzle does not matter."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def fill(ctx, r):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        tid = arith.andi(utils.thread_idx(), arith.constant(i32, 127))
        ptr = utils.memref_ptr(r)
        ones = arith.constant(i32, 0x38383838)
        for k in range(2):  # 128 threads x 2 words = 1,024 bytes
            off = arith.addi(arith.muli(tid, arith.constant(i32, 8)),
                             arith.constant(i32, 4 * k))
            llvm.store(ones, utils.getelementptr(ptr, [off], i8))

    fill(ref)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["valid", "bias", "block_masked", "any_valid"],
                   meta_fields=["block_kv"])
@dataclasses.dataclass(frozen=True)
class SlotMask:
    """The slot mask and what the kernel derives from it, made once where many calls share
    it (a step's blocks all attend under one mask; derived inside the block scan, each piece
    is a kernel per block): valid [S] bool, bias [S'] f32 (:func:`_slot_bias`),
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
    kernels', ``KernelOptions.block_kv``)."""
    block_kv = block_kv or KernelOptions().block_kv
    return SlotMask(valid, _slot_bias(valid, block_kv), block_masked_flags(valid, block_kv),
                    jnp.any(valid).astype(jnp.float32), block_kv)


def _mask_valid(valid):
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


def _prepare_inputs_v_in_kernel(q, k_scale, v_scale, valid, block_kv, q_split=True):
    """Wrapper-side work when the kernel reads V as stored: the FP8 Q parts, a tuple of P
    [Tq, H, D] arrays (unpadded), scales [H, 2, Tq'] and the slot bias [S'] (as
    :func:`_prepare_inputs`)."""
    return _prepare_q_scales_bias(q, k_scale, v_scale, valid, block_kv, q_split, pad_q=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedQ:
    """Q already in the kernel's form: ``parts`` a tuple of one or two e4m3 [Tq, H, D]
    arrays (hi, and lo = e4m3(q / s - hi) with Q's split), ``row_scale`` [Tq, H] float32
    (s = a (row, head)'s absolute maximum / 448): q ~ (hi + lo) * s. Made by
    :func:`quantize_q`, or by a kernel that produces Q (``pallas_kernels.fp8_qkv_prepare``).
    ``scales``: None, or the kernel's scales operand [H, 2, Tq'] f32 already made by that
    producer (:func:`attention_scales` of ``row_scale`` and the K/V scales and mask the call
    is given); the call then uses it as it is, with no XLA pass of its own."""

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


def quantize_q(q, q_split: bool = True) -> QuantizedQ:
    """q [Tq, H, D] float -> the kernel's e4m3 Q parts and row scales (:class:`QuantizedQ`)."""
    qf = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(qf), axis=-1)  # [Tq, H]
    q_rs = jnp.maximum(amax, 1e-30) / F8_MAX
    qs = qf / q_rs[..., None]
    q_hi = qs.astype(F8)
    # The barrier keeps XLA from folding f32 -> e4m3 -> f32 into a no-op (GPU XLA allows
    # excess precision), which silently made lo == 0 in the first GPU run.
    hi_f32 = lax.optimization_barrier(q_hi).astype(jnp.float32)
    return QuantizedQ((q_hi, (qs - hi_f32).astype(F8)) if q_split else (q_hi,), q_rs)


def _prepare_q_scales_bias(q, k_scale, v_scale, valid, block_kv, q_split, pad_q):
    """FP8 Q parts, a tuple of P arrays [Tq, H, D] (or [Tq', H, D], Tq' = Tq rounded up to
    128, with pad_q), scales [H, 2, Tq'] f32 (row 0: logit factor in the log2 domain, row 1:
    output factor) and the slot bias [S'] f32 (S' = S rounded up to block_kv). q: float,
    or a :class:`QuantizedQ` (its parts used as they are).

    The parts are separate kernel operands, not one stacked array: a stack costs XLA a
    concatenate pass over both parts per call (9 us at 18 heads, 17 us at 36 in GPU run 2)."""
    tq, h, d = q.shape
    tq_pad = padded_queries(tq)
    if not isinstance(q, QuantizedQ):
        q = quantize_q(q, q_split)
    q8 = q.parts
    if pad_q:
        q8 = tuple(jnp.pad(p, ((0, tq_pad - tq), (0, 0), (0, 0))) for p in q8)
    if q.scales is not None:
        if q.scales.shape != (h, 2, tq_pad):
            raise ValueError(f"QuantizedQ.scales must be [{h}, 2, {tq_pad}], got {q.scales.shape}")
        scales = q.scales
    else:
        scales = attention_scales(q.row_scale, k_scale, v_scale, _any_valid(valid), d)
    return q8, scales, _slot_bias(valid, block_kv)


def padded_queries(tq: int) -> int:
    """Tq' of the kernel's scales operand: Tq rounded up to its compute warpgroups' rows."""
    return -(-tq // (COMPUTE_WGS * BLOCK_Q)) * (COMPUTE_WGS * BLOCK_Q)


def attention_scales(q_rs, k_scale, v_scale, any_valid, d: int):
    """The kernel's scales operand [H, 2, Tq'] f32 (Tq' = :func:`padded_queries`), columns
    past Tq zero: row 0 Q's row scale times the head's logit factor (K scale x log2(e) /
    sqrt(D)), row 1 the head's output factor (V scale, times any_valid: 0 when no slot is
    valid). q_rs [Tq, H] f32; k_scale, v_scale [H]; any_valid [] f32."""
    tq, h = q_rs.shape
    head_sc = _head_scales(k_scale, v_scale, any_valid, d)  # [H, 2]
    logit = q_rs * head_sc[None, :, 0]
    out_sc = jnp.broadcast_to(head_sc[None, :, 1], (tq, h))
    return jnp.pad(jnp.stack([logit.T, out_sc.T], axis=1),
                   ((0, 0), (0, 0), (0, padded_queries(tq) - tq)))


def _any_valid(valid):
    """[] f32: 1 when any slot is valid, else 0 (valid [S] bool or a SlotMask)."""
    return valid.any_valid if isinstance(valid, SlotMask) else jnp.any(valid).astype(jnp.float32)


def _head_scales(k_scale, v_scale, any_valid, d):
    """[H, 2] f32: the logit factor of a head without Q's row scale (K scale x log2(e) /
    sqrt(D)) and its output factor (V scale, 0 when no slot is valid: any_valid [] f32)."""
    return jnp.stack([k_scale.astype(jnp.float32) * (LOG2E / math.sqrt(d)),
                      v_scale.astype(jnp.float32) * any_valid], axis=1)


def _slot_bias(valid, block_kv):
    """[S'] f32, S' = S rounded up to block_kv: 0 for a valid slot, _MASK_BIAS otherwise."""
    if isinstance(valid, SlotMask):
        if valid.block_kv == block_kv:
            return valid.bias
        valid = valid.valid
    s_pad = padded_slots(valid.shape[0], block_kv)
    return jnp.where(jnp.pad(valid, (0, s_pad - valid.shape[0])), 0.0,
                     _MASK_BIAS).astype(jnp.float32)


def _prepare_inputs_q_in_kernel(q, k_scale, v_scale, valid, block_kv):
    """Wrapper-side work when the kernel quantizes Q itself: (Q,) with Q bf16 [Tq', H, D]
    (Tq' = Tq rounded up to 128, zero rows: Mosaic GPU's TMA refuses a bf16 Q whose row
    count is not a multiple of 8, so the pad stays; in the model XLA can fuse it into Q's
    producer), the per-head scales [H, 2] (:func:`_head_scales`) and the slot bias [S']."""
    tq, _, d = q.shape
    tq_pad = padded_queries(tq)
    qb = jnp.pad(q.astype(jnp.bfloat16), ((0, tq_pad - tq), (0, 0), (0, 0)))
    return (qb,), _head_scales(k_scale, v_scale, _any_valid(valid), d), _slot_bias(valid, block_kv)


def _prepare_inputs(q, v, k_scale, v_scale, valid, block_kv, q_split=True):
    """Wrapper-side work: FP8 Q with per-row scales, permuted V^T, the slot bias.

    Returns q8, a tuple of P [Tq', H, D] e4m3 arrays (Tq' = Tq rounded up to 128, zero
    rows; P = 2 parts, q/scale ~ hi + lo, with q_split, else 1), scales
    [H, 2, Tq'] f32 (row 0: logit factor in the log2 domain, row 1: output factor),
    bias [S'] f32 (S' = S rounded up to block_kv) and vt [H, D, S'] e4m3.
    """
    q8, scales, bias = _prepare_q_scales_bias(q, k_scale, v_scale, valid, block_kv, q_split, pad_q=True)
    return q8, scales, bias, transpose_v(v, block_kv)


def permute_keys(x, inverse=False):
    """[..., S'] -> [..., S']: the key permutation inside each 16-key group (g, h2, t, v2)
    -> (g, t, h2, v2) (:func:`_key_permutation`), or its inverse. S' % 16 == 0."""
    *lead, s_pad = x.shape
    group = (4, 2, 2) if inverse else (2, 4, 2)  # (t, h2, v2) or (h2, t, v2)
    n = len(lead) + 1
    return jnp.swapaxes(x.reshape(*lead, s_pad // 16, *group), n, n + 1).reshape(*lead, s_pad)


def padded_slots(s_len: int, block_kv: int = 128) -> int:
    """S' for S = s_len slots: rounded up to the kernel's KV blocks (the mask bias's and
    V^T's length)."""
    return -(-s_len // block_kv) * block_kv


def transpose_v(v, block_kv: int = 128):
    """V as a cache can store it for the kernel (``attention(..., v_transposed=True)``):
    v [..., S, H, D] -> V^T [..., H, D, S'] (same dtype), S' = :func:`padded_slots`
    (zero slots past S), the keys permuted inside each 16-key group
    (:func:`_key_permutation`), so that the wgmma reads P straight from the accumulator's
    registers."""
    *lead, s_len, h, d = v.shape
    s_pad = padded_slots(s_len, block_kv)
    vp = jnp.pad(v, [(0, 0)] * len(lead) + [(0, s_pad - s_len), (0, 0), (0, 0)])
    # Two steps: a plain [S', H*D] -> [H*D, S'] transpose (XLA's tiled transpose), then the
    # key permutation. As one 7-D transpose XLA emitted a 90 us loop fusion at 18 heads.
    vt = jnp.swapaxes(vp.reshape(*lead, s_pad, h * d), -1, -2)
    vt = permute_keys(lax.optimization_barrier(vt))
    return vt.reshape(*lead, h, d, s_pad)


def untranspose_v(vt, s_len: int):
    """The inverse of :func:`transpose_v`: V^T [..., H, D, S'] -> V [..., S, H, D]."""
    *lead, h, d, s_pad = vt.shape
    v = permute_keys(vt.reshape(*lead, h * d, s_pad), inverse=True)
    v = jnp.swapaxes(v, -1, -2).reshape(*lead, s_pad, h, d)
    return v[..., :s_len, :, :]


def stream_k_ctas(n_tiles: int, nb: int, stages: int, num_sms: int | None) -> int:
    """How many CTAs the persistent (stream-K) schedule launches for ``n_tiles`` tiles of
    ``nb`` KV blocks: one per SM (``num_sms``, default the device's), so that all are
    resident at once (the owner CTAs wait for others); fewer when a CTA would get under
    2 * stages blocks (the pipeline's fill would dominate)."""
    units = n_tiles * nb
    sms = num_sms or device_sm_count()
    return max(1, min(sms, units // max(2 * stages, 1)))


def stream_k_ranges(units: int, num_ctas: int) -> np.ndarray:
    """[num_ctas + 1] int: CTA c takes the work units [r[c], r[c + 1]) (as the kernel
    computes them: c * units // num_ctas)."""
    return (np.arange(num_ctas + 1, dtype=np.int64) * units) // num_ctas


def stream_k_cta_of(unit, units: int, num_ctas: int, div=operator.floordiv):
    """The CTA whose range [c * units // num_ctas, (c + 1) * units // num_ctas) holds work
    unit ``unit`` (numpy or, with ``div=lax.div``, traced int32)."""
    return div((unit + 1) * num_ctas + units - 1, units) - 1


def _fp8_attention_call(q8, k8, vt, scales, bias, *, tq, block_kv, stages, out_dtype,
                        clip_out=True, v_in_kernel=False, layer=None, num_ctas=None,
                        profile_dir="", pingpong=True, l_in_pv=False, fast_unmasked=False,
                        block_masked=None, overlap="", bit_exp2=False, q_in_kernel=0,
                        p_codes=0, lazy_rescale=False, wide_v_transpose=False, vt_stored=False,
                        debug=()):
    """The pallas kernel. q8: a tuple of P [Tq', H, D] e4m3 parts, k8 [S, H, D] e4m3, vt
    [H, D, S'] e4m3,
    scales [H, 2, Tq'] f32, bias [S'] f32 -> [Tq, H, D] (clip_out) or [Tq', H, D].
    With clip_out the last query tile's store runs past Tq and TMA drops those rows.

    v_in_kernel: ``vt`` is V itself, [S, H, D] e4m3 as the cache stores it, and q8 may
    have any number of rows (Tq rows, unpadded; TMA zero-fills the rest of the last
    tile). The memory warpgroup then TMA-loads each V block untransposed into a staging
    buffer and writes it transposed (and key-permuted, see :func:`_key_permutation`)
    into the wgmma's V^T buffer with 32-bit shared loads, byte permutes and 32-bit
    shared stores, bank-conflict-free (:func:`_transpose_v_block`).

    layer: None, or a [1] int32 array (needs v_in_kernel); then k8 and vt are the whole
    cache stacks [L, S, H, D] and the kernel reads layer ``layer`` (clamped to [0, L))
    in place: it indexes the GMEM refs with it before the TMA copies, so XLA never
    copies the layer's K/V out of the stack.

    vt_stored (with v_in_kernel): everything as v_in_kernel, except that ``vt`` is V^T as a
    cache can store it, [(L,) H, D, S'] e4m3 from :func:`transpose_v` (S' = S rounded up to
    block_kv, keys permuted in 16-key groups): the memory warpgroup copies each block by
    TMA straight into the wgmma's buffer; no staging buffer, no transpose.

    num_ctas: the schedule. The work is H * n_qtiles tiles (tile t: head t // n_qtiles,
    query rows 128 * (t % n_qtiles) ...) of nb KV blocks each, nb * H * n_qtiles units in
    all, in that order; CTA c takes units [c * W // C, (c + 1) * W // C). None (or the
    tile count): one tile per CTA, the plain grid (108 CTAs at 18 heads: 82% of 132 SMs).
    Fewer CTAs than tiles (one per SM): stream-K. A CTA's range then cuts tiles: the CTA
    that holds a tile's first KV block (its "owner"; that segment is the last of its
    range) finishes the tile; the others (each a CTA's first segment, so done early)
    write a bf16 partial output, normalized, with its log2-sum-exp per row, and signal a
    semaphore; the owner waits for them (no wait in practice), merges and stores. Needs
    every CTA resident at once (num_ctas <= SMs, one CTA per SM by its shared memory).

    profile_dir: "" or a directory where the Mosaic GPU profiler writes a per-warpgroup
    trace of the kernel's named scopes (qk, softmax, sync, pv, v_transpose, ...).

    The softmax (the kernel's bottleneck: ~1,560 cycles per warpgroup and 128-key step on
    the H200, against ~830 of tensor work) has three options:
      pingpong: the two compute warpgroups alternate (a schedule barrier): one's softmax
        runs under the other's matmuls. False: they run freely.
      l_in_pv: the row sums of P come out of the tensor core: a second wgmma per block,
        P times an [8, bkv] block of e4m3 ones, into a fresh [64, 8] accumulator (so l is
        the sum of the e4m3 P actually multiplied, and the per-element adds and their
        shuffles go). Fresh per block: FP8 wgmma accumulates with reduced precision, and
        the sums carried across blocks in the P.V accumulator (ones rows in V^T, tried
        first) lost 2-4% to truncation on the H200.
      fast_unmasked: ``block_masked`` [nb] int32 says which KV blocks hold a masked slot;
        the others skip the bias: max over the raw logits, then one FMA per element for
        the exponent (the row factor is positive), one op less per element.
      overlap: "" (Q.K^T, softmax and P.V in turn, each waited for), "pv" or "qk".
        "pv" is FlashAttention-3's order: per block, issue Q.K^T of block j + 1, then P.V
        of block j (P in registers), wait for Q.K^T only, run block j + 1's softmax while
        P.V runs, then wait for all and rescale. P is fenced once (its only reader is the
        P.V wgmma: l_in_pv=False) and the softmax's results leave the wgmma region
        through refs initialized with dummies, so P is dead after its fence. Mosaic's
        fence is a tied-operand asm, and a live P forced register copies inside the
        pipeline stage, which ptxas serialized (C7513, GPU run 8: +31%). Not yet run in
        this form (BUILD_NOTES).
        "qk": FlashAttention-3's intra-warpgroup pipelining, another order. The softmax of block j runs while
        Q.K^T of block j + 1 and P.V of block j - 1 are on the tensor cores: S_j in
        registers, S_{j+1} in flight in a second accumulator, P through two shared-memory
        buffers per warpgroup (aliasing the output staging buffer), the output accumulator
        and row sums in flight across blocks (one run_scoped over the segment, explicit
        wgmma waits). Correct, but 1.5x slower on the H200: ptxas serializes its wgmmas
        (C7514: O is read and rescaled while Q.K^T is in flight, which FA3 avoids by
        rescaling after a wait for all) and spills (BUILD_NOTES, GPU run 12).
      q_in_kernel: 0, or the number of e4m3 parts (1 or 2, as q_split) into which the
        kernel quantizes Q itself: q8 is then (Q,) with Q [Tq', H, D] bf16 (Tq' a multiple
        of 128), and scales is [H, 2] f32 per head (logit factor without the row scale,
        output factor). Each warpgroup TMA-loads its bf16 tile into a staging buffer
        (the next tile's while the current one runs), takes the row amax and writes the
        e4m3 parts to shared memory at the tile's start; the wrapper's quantization
        passes over Q (XLA, ~11 us of the 84 us call at 18 heads) go.
      bit_exp2: P's exponentials from float bits (:func:`exp2_from_bits`: a clamp and
        an integer multiply-add per element) instead of the MUFU ex2 (16 per SM and
        cycle). On the H200 the softmax shortens by ~25% but the kernel does not (its two
        warpgroups then wait longer on the tensor cores; BUILD_NOTES, GPU run 10);
        rel. err 0.008 instead of 0.007.
      lazy_rescale: the running max moves only when a block's row max passes it by
        more than :data:`_LAZY_RESCALE` (log2 units); otherwise alpha = 1 and P may reach
        2^8.75 (< 448, the e4m3 maximum). A warp whose 16 rows all keep their max skips
        the rescale of its output accumulator (:func:`_rescale_rows_if_any`), which after
        the first few blocks is most of them (FlashAttention-4's conditional rescale).
      wide_v_transpose: the memory warpgroup transposes V with 16-byte shared loads
        (:func:`_wide_transpose_plan`: about half the instructions of the 32-bit word
        transpose, which takes ~1.36 k cycles per block and shares the sub-partitions'
        issue with the softmax; without it the kernel is 5% faster, BUILD_NOTES run 15;
        GPU runs 18-19: -4 to -6% with p_codes).
      debug: diagnostics for timing only, with wrong results: "no_v_transpose" (the
        memory warpgroup hands out V^T stages unwritten) and "no_softmax" (P = the low
        bytes of the logits' bits, three byte permutes per four elements, m and l kept):
        what the kernel costs without that part (benchmarks/attention_profile.py).
      p_codes: 0, or P's e4m3 codes computed from the logits' float bits, without the
        MUFU ex2 and without the f32 -> e4m3 cvt (:func:`_p_codes_8bit_a`; the two are
        16-per-SM-and-cycle operations, 66 + 32 per thread and block); 2 adds the
        low-range line for P below 2^-6 (:data:`_CODE_LOW_SLOPE`). Needs l_in_pv.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental import mosaic as _mosaic  # noqa: F401
    import jax.experimental.mosaic.gpu as mgpu

    q8 = tuple(q8)
    n_q_ops = len(q8)
    n_parts = q_in_kernel or n_q_ops  # e4m3 parts of Q in shared memory
    tq_in, h, d = q8[0].shape
    stacked = layer is not None
    if stacked and not v_in_kernel:
        raise ValueError("reading the K/V stack in place needs v_in_kernel=True")
    num_layers = k8.shape[0] if stacked else 1
    tq_pad = padded_queries(tq_in)
    if vt_stored and not v_in_kernel:
        raise ValueError("vt_stored is a form of v_in_kernel=True")
    if vt_stored and vt.shape[-1] % block_kv:
        raise ValueError(f"vt_stored: V^T's slots {vt.shape[-1]} must be a multiple of "
                         f"block_kv={block_kv} (transpose_v pads them)")
    transpose_in_kernel = v_in_kernel and not vt_stored
    nb = -(-k8.shape[-3] // block_kv)  # K is [(L,) S, H, D] whatever form V takes
    stages = min(stages, nb)
    n_qtiles = tq_pad // (COMPUTE_WGS * BLOCK_Q)
    n_tiles = h * n_qtiles
    units = n_tiles * nb
    num_ctas = n_tiles if num_ctas is None else int(num_ctas)
    if not 1 <= num_ctas <= units:
        raise ValueError(f"num_ctas must be in [1, {units}], got {num_ctas}")
    if units * (num_ctas + 1) >= 2**31:
        raise ValueError(f"{units} work units x {num_ctas} CTAs overflow int32")
    ranges = stream_k_ranges(units, num_ctas)
    # Partials exist when some CTA starts inside a tile.
    has_partials = bool(np.any(ranges[:-1] % nb != 0))
    if has_partials and np.any(np.diff(ranges) < 1):
        raise ValueError("every CTA needs at least one KV block")
    out_rows = tq if clip_out else tq_pad
    if d != 128:
        raise NotImplementedError(f"the FP8 kernel handles head_dim 128, got {d}")
    if l_in_pv and not v_in_kernel:
        raise ValueError("l_in_pv needs v_in_kernel=True")
    if fast_unmasked and block_masked is None:
        raise ValueError("fast_unmasked needs block_masked [nb] int32")
    if overlap not in ("", "pv", "qk", "batch"):
        raise ValueError(f"overlap must be '', 'pv', 'qk' or 'batch', got {overlap!r}")
    if p_codes not in (0, 1, 2) or (p_codes and (bit_exp2 or not l_in_pv)):
        raise ValueError("p_codes (1, or 2 with the low-range line) replaces bit_exp2 and "
                         "needs l_in_pv=True (the row sums of the e4m3 P)")
    if overlap == "pv" and l_in_pv:
        raise ValueError("overlap='pv' lets one wgmma read P: pass l_in_pv=False")
    if overlap in ("pv", "qk") and pingpong:
        raise ValueError("overlap 'pv' / 'qk' replace the ping-pong: pass pingpong=False")
    p_in_smem = overlap == "qk"  # P's buffers alias the output staging buffer
    # With the tensor core's row sums the default and 'batch' loops carry l as the [64, 8]
    # row-sum tile (all columns equal: no cross-thread reduction per block) and reduce it
    # once, after the segment.
    l8_carry = l_in_pv and overlap in ("", "batch")
    if p_in_smem and not (jnp.dtype(out_dtype).itemsize == 2 and block_kv == d):
        raise ValueError("overlap='qk' needs a 16-bit output and block_kv == 128")
    if q_in_kernel and not (q_in_kernel in (1, 2) and n_q_ops == 1 and v_in_kernel
                            and q8[0].dtype == jnp.bfloat16
                            and tq_in % (COMPUTE_WGS * BLOCK_Q) == 0
                            and scales.shape == (h, 2)):
        raise ValueError("q_in_kernel (1 or 2 parts) takes one bf16 Q [Tq', H, D] with Tq' "
                         "a multiple of 128, scales [H, 2] and v_in_kernel=True")
    n_part_slots = num_ctas if has_partials else 1
    # Q of a CTA's next tile is prefetched into a second buffer while the current one
    # runs, where a CTA has several tiles and the shared memory allows it.
    kb = 1024
    smem_one_q = (COMPUTE_WGS * n_parts * BLOCK_Q * d + COMPUTE_WGS * BLOCK_Q * d * 2
                  + (3 if transpose_in_kernel else 2) * stages * block_kv * d + 8 * kb)
    n_qbuf = 2 if (num_ctas != n_tiles and not q_in_kernel and
                   smem_one_q + COMPUTE_WGS * n_parts * BLOCK_Q * d <= 224 * kb) else 1

    def to_8bit_a(p8):
        """Regroup an e4m3 [64, bkv] array from the WGMMA layout (pairs) into the
        8-bit WGMMA layout (quadruplets) without moving data between threads; the
        column order this implies is undone by the V^T key permutation."""

        @plgpu.inline_mgpu(
            arg_types=(plgpu.Layout.WGMMA,),
            return_type=plgpu.ShapeDtypeStruct(
                (BLOCK_Q, block_kv), F8, layout=plgpu.Layout.WGMMA_8BIT),
        )
        def regroup(ctx, x):
            del ctx
            regs = x.registers  # [1, bkv/8, 1, 1, 2, 1, 1, 1, 1] of vector<2xf8>
            new_shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape((BLOCK_Q, block_kv))
            new = np.empty(new_shape, dtype=object)
            for g in range(block_kv // 16):
                for rh in range(2):
                    lo = regs[0, 2 * g, 0, 0, rh, 0, 0, 0, 0]
                    hi = regs[0, 2 * g + 1, 0, 0, rh, 0, 0, 0, 0]
                    new[0, g, 0, 0, rh, 0, 0, 0, 0] = mgpu.utils.vector_concat([lo, hi])
            return mgpu.FragmentedArray(
                _registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)

        return regroup(p8)

    def kernel(q_refs, k_ref, vt_ref, sc_ref, bias_ref, out_ref, part_ref, lse_ref, scoped,
               layer_ref=None, mask_ref=None):
        if layer_ref is not None:
            # Views of layer `li` of the stacks (clamped like lax.dynamic_slice): no copy.
            li = jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)
            k_ref, vt_ref = k_ref.at[li], vt_ref.at[li]
        cta = lax.axis_index("ctas")
        u0 = lax.div(cta * units, num_ctas)
        u1 = lax.div((cta + 1) * units, num_ctas)
        n_steps = u1 - u0
        wg = lax.axis_index("wg")
        (q_smem2, o_smem2, sc_smem2, (k_smem, k_smem_tma), v_smem, b_smem,
         lse_smem2, (ones_smem, ones_plain), *q_stage2), bars = scoped
        if p_in_smem:  # P's two buffers per warpgroup alias the output staging buffer
            o_smem2, p_smem2 = o_smem2
        (k_bars, v_bars, q_bars), (k_done, v_done), sched = bars[:3]
        t_first, t_last = lax.div(u0, nb), lax.div(u1 - 1, nb)
        # A CTA whose first segment is a partial signals it after the next segment's first
        # KV step (its TMA store has long completed by then), or at once if it has no other.
        signal_step = (t_first + 1) * nb - u0
        defer_signal = jnp.logical_and(u0 - t_first * nb > 0, signal_step < n_steps)
        p_bars = bars[3]
        ones_ready = bars[4] if vt_stored and l_in_pv else None
        if v_in_kernel:
            # q_smem2 = (tiled view for the wgmma, untiled view for the TMA)
            q_smem2, q_smem2_tma = q_smem2
        if transpose_in_kernel:
            # v_smem = (tiled V^T for the wgmma, plain alias for the transpose)
            v_smem, vt_plain = v_smem
            v_raw, v_raw_bars = bars[4]
        sems = (pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas * COMPUTE_WGS,)))
                if has_partials else None)

        def schedule_barrier():
            if pingpong:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        def head_block(unit):
            tile = lax.div(unit, nb)
            return lax.div(tile, n_qtiles), unit - tile * nb

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]
            p_smem = p_smem2.at[wg] if p_in_smem else None
            q_dst2 = q_smem2_tma if v_in_kernel else q_smem2

            def tile_rows(t):
                head = lax.div(t, n_qtiles)
                return head, ((t - head * n_qtiles) * COMPUTE_WGS + wg) * BLOCK_Q

            def issue_q(t, buf):
                """Q (all parts) and the row scales of tile t into buffer ``buf``; with
                q_in_kernel the bf16 tile into the staging buffer."""
                head, q0 = tile_rows(t)
                bar = q_bars.at[buf * COMPUTE_WGS + wg]
                if q_in_kernel:
                    plgpu.copy_gmem_to_smem(q_refs[0].at[pl.ds(q0, BLOCK_Q), head],
                                            q_stage2[0].at[wg], bar)
                    return
                for part in range(n_parts):
                    # v_in_kernel: rows past Tq are zero-filled by TMA (no padded copy of Q)
                    plgpu.copy_gmem_to_smem(q_refs[part].at[pl.ds(q0, BLOCK_Q), head],
                                            q_dst2.at[buf, wg, part], bar)
                plgpu.copy_gmem_to_smem(sc_ref.at[head, :, pl.ds(q0, BLOCK_Q)],
                                        sc_smem2.at[buf, wg], bar)

            def signal_partial():
                plgpu.wait_smem_to_gmem(0)  # the partial is written, not only read
                fence_proxy_async_global()
                plgpu.semaphore_signal(sems.at[cta * COMPUTE_WGS + wg], 1,
                                       memory_scope="gpu")

            def quantize_q(t, head):
                """q_in_kernel: the staged bf16 tile -> e4m3 parts in q_smem (hi, and
                lo = e4m3(q/s - hi)), s = row amax / 448; then the staging buffer takes
                the next tile. Returns the row factor of the logits, s * head factor."""
                x = plgpu.load(q_stage2[0].at[wg], layout=plgpu.Layout.WGMMA
                               ).astype(jnp.float32)
                q_rs = jnp.maximum(jnp.max(jnp.abs(x), axis=1), 1e-30) / F8_MAX
                qs = x * lax.broadcast_in_dim(1.0 / q_rs, x.shape, [0])
                hi = qs.astype(F8)
                q_smem2.at[0, wg, 0][...] = hi
                if n_parts == 2:
                    q_smem2.at[0, wg, 1][...] = (qs - hi.astype(jnp.float32)).astype(F8)
                plgpu.commit_smem()  # all threads' stores, visible to the wgmma
                pl.when(t < t_last)(lambda: issue_q(t + 1, 0))  # staging read: refill
                return q_rs * sc_ref[head, 0]

            if n_qbuf == 2 or q_in_kernel:
                issue_q(t_first, 0)
            if not overlap:  # (with overlap, each segment waits for its first K)
                plgpu.barrier_wait(k_bars.at[0])
            if ones_ready is not None:  # the row-sum wgmma's ones, written by the memory WG
                plgpu.barrier_wait(ones_ready)
            pl.when(wg == 1)(schedule_barrier)  # the ping-pong's offset (no-op without)

            @pl.loop(t_first, t_last + 1)
            def _segment(t):
                head, q0 = tile_rows(t)
                jb = jnp.maximum(u0 - t * nb, 0)
                je = jnp.minimum(u1 - t * nb, nb)
                buf = lax.rem(t - t_first, n_qbuf)
                if n_qbuf == 1 and not q_in_kernel:
                    issue_q(t, 0)
                with jax.named_scope("q_wait"):
                    plgpu.barrier_wait(q_bars.at[buf * COMPUTE_WGS + wg])
                if n_qbuf == 2:
                    # buffer 1 - buf was the previous tile's: its wgmmas have completed
                    pl.when(t < t_last)(lambda: issue_q(t + 1, 1 - buf))
                q_smem, sc_smem = q_smem2.at[buf, wg], sc_smem2.at[buf, wg]
                if q_in_kernel:  # (the previous tile's wgmmas on q_smem have completed)
                    with jax.named_scope("q_quant"):
                        row_scale = quantize_q(t, head)
                else:
                    row_scale = plgpu.load(sc_smem.at[0],
                                           layout=plgpu.Layout.WGMMA.reduce(1))

                m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)

                def issue_qk(s_ref, slot):
                    for part in range(n_parts):  # s = (q_hi + q_lo) . k
                        plgpu.wgmma(s_ref, q_smem.at[part], k_smem.at[slot].T)

                def waited_qk(slot, step):
                    """S = Q.K^T of K stage ``slot`` in a fresh accumulator, waited for
                    (the ping-pong's schedule barrier between issue and wait), then the
                    deferred partial signal if ``step`` is due for it."""
                    def qk(s_ref):
                        issue_qk(s_ref, slot)
                        schedule_barrier()
                        return s_ref[...]

                    with jax.named_scope("qk"):
                        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                    maybe_signal(step)
                    return s

                def issue_pv(acc_ref, sums_ref, p8, slot):
                    plgpu.wgmma(acc_ref, p8, v_smem.at[slot].T)
                    if l_in_pv:  # this block's row sums of P, in a fresh accumulator
                        plgpu.wgmma(sums_ref, p8, ones_smem.T)

                def softmax(s, m_i, l_i, acc, slot, masked):
                    """Online softmax of one block: (p8, m_new, alpha, row sums of P or
                    None with l_in_pv, acc, l_i); m in the log2 domain, P = 256 exp2(s -
                    m_new) as e4m3 in the 8-bit wgmma layout, alpha = exp2(m_i - m_new).
                    acc and l_i are rescaled by alpha here (their multiplies interleave
                    with the exponentials), or passed as None (overlap: acc is in flight)
                    and returned so. Releases the K stage (K and the bias) once the bias
                    is read. lazy_rescale: m moves only when the block's row max passes it
                    by more than _LAZY_RESCALE (else alpha = 1, P up to 2^8.75), and a
                    warp whose rows all keep their m skips the rescale of acc."""
                    rs = lax.broadcast_in_dim(row_scale, s.shape, [0])
                    if masked:  # x = logits with the bias, y = x + 8 - m_new
                        b = plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                        plgpu.barrier_arrive(k_done.at[slot])
                        x = s * rs + lax.broadcast_in_dim(b, s.shape, [1])
                        m_blk = x.max(axis=1)
                    else:  # no bias: the row factor is > 0, so max(s * f) = f max(s)
                        plgpu.barrier_arrive(k_done.at[slot])
                        x = s
                        m_blk = s.max(axis=1) * row_scale
                    if lazy_rescale:
                        moved = m_blk > m_i + _LAZY_RESCALE
                        m_new = jnp.where(moved, jnp.maximum(m_i, m_blk), m_i)
                    else:
                        m_new = jnp.maximum(m_i, m_blk)

                    def alpha_of():
                        alpha = jnp.exp2(m_i - m_new)
                        return jnp.where(moved, alpha, 1.0) if lazy_rescale else alpha

                    if "no_softmax" in debug:  # timing only: P = garbage, no math
                        zeros = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32),
                                                  plgpu.Layout.WGMMA.reduce(1))
                        unused = (lax.broadcast_in_dim(zeros, s.shape, [0]),) * 2
                        p8 = _p_codes_8bit_a(s, (unused,), block_kv, raw=True)
                        return lax.optimization_barrier((p8, m_i, zeros, None, acc, l_i))
                    if p_codes:  # P's e4m3 codes straight from x: y = x * xa + y_off
                        xa = (plgpu.layout_cast(jnp.full((BLOCK_Q,), 1.0, jnp.float32),
                                                plgpu.Layout.WGMMA.reduce(1))
                              if masked else row_scale)
                        coefs = tuple(
                            tuple(lax.broadcast_in_dim(c, s.shape, [0]) for c in pair)
                            for pair in p_code_coefficients(xa, _P_LOG2_SCALE - m_new,
                                                            p_codes == 2))
                        p8 = _p_codes_8bit_a(x, coefs, block_kv)
                        alpha, psum = alpha_of(), None
                    else:  # P = exp2(y); bit_exp2: from u = y + magic
                        off = _EXP2_MAGIC if bit_exp2 else 0.0
                        y = (x if masked else x * rs) + lax.broadcast_in_dim(
                            _P_LOG2_SCALE + off - m_new, s.shape, [0])
                        if bit_exp2:
                            p = exp2_from_bits(jnp.maximum(y, _EXP2_MAGIC + _EXP2_FLOOR))
                        else:
                            p = jnp.exp2(y)
                        alpha = alpha_of()
                        psum = None if l_in_pv else p.sum(axis=1)
                    if acc is not None:
                        acc = (_rescale_rows_if_any(acc, alpha) if lazy_rescale else
                               acc * lax.broadcast_in_dim(alpha, acc.shape, [0]))
                        if l8_carry:  # l is the [64, 8] row-sum tile
                            l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [0])
                        else:
                            l_i = l_i * alpha if psum is None else l_i * alpha + psum
                    if not p_codes:
                        p8 = to_8bit_a(p.astype(F8))
                    return lax.optimization_barrier((p8, m_new, alpha, psum, acc, l_i))

                def mask_flag(j):
                    """Block j's masked flag (fast_unmasked), a GMEM load: read it before
                    the wgmma wait that precedes its use, so that its latency hides."""
                    return mask_ref[j] if fast_unmasked else None

                def softmax_block(s, m_i, slot, j, l_i=None, acc=None, flag=None):
                    with jax.named_scope("softmax"):
                        if fast_unmasked:
                            flag = mask_flag(j) if flag is None else flag
                            return lax.cond(flag != 0,
                                            functools.partial(softmax, masked=True),
                                            functools.partial(softmax, masked=False),
                                            s, m_i, l_i, acc, slot)
                        return softmax(s, m_i, l_i, acc, slot, masked=True)

                def maybe_signal(step):
                    if has_partials:
                        pl.when(jnp.logical_and(defer_signal, step == signal_step))(
                            signal_partial)

                def fresh_acc(n):
                    """A zeroed [64, n] f32 wgmma accumulator."""
                    return plgpu.ACC.init(plgpu.layout_cast(
                        jnp.full((BLOCK_Q, n), 0.0, jnp.float32), plgpu.Layout.WGMMA))

                def kv_step(j, carry):
                    """One KV block: Q.K^T, wait, softmax, P.V, wait."""
                    acc, m_i, l_i = carry
                    step = t * nb + j - u0  # this CTA's pipeline step
                    slot = lax.rem(step, stages)
                    flag = mask_flag(j)
                    s = waited_qk(slot, step)
                    p8, m_new, _, _, acc, l_i = softmax_block(s, m_i, slot, j, l_i, acc, flag)
                    with jax.named_scope("sync"):
                        if pingpong:
                            plgpu.barrier_arrive(sched)
                        plgpu.barrier_wait(v_bars.at[slot])
                        if pingpong:
                            plgpu.barrier_wait(sched)

                    def pv(refs):
                        issue_pv(*refs, p8, slot)
                        nxt = step + 1

                        @pl.when(nxt < n_steps)
                        def _():
                            plgpu.barrier_wait(k_bars.at[lax.rem(nxt, stages)])

                    with jax.named_scope("pv"):
                        acc, sums = pl.run_state(pv)(
                            (plgpu.ACC.init(acc), fresh_acc(8) if l_in_pv else None))
                    plgpu.barrier_arrive(v_done.at[slot])
                    if l_in_pv:
                        l_i = l_i + sums  # l8_carry
                    return acc, m_new, l_i

                if l8_carry:
                    l_i = plgpu.layout_cast(jnp.full((BLOCK_Q, 8), 0.0, jnp.float32),
                                            plgpu.Layout.WGMMA)

                def batched_step(j, carry, has_next):
                    """overlap='batch': the softmax of block j, then one wgmma batch: P.V of
                    block j (and its row sums) and, with has_next, Q.K^T of block j + 1,
                    waited for together: no wgmma is in flight during a softmax. With the
                    ping-pong the schedule barrier follows the batch's issue, so the two
                    warpgroups' batches alternate on the tensor cores and each softmax
                    runs under the other warpgroup's batch (FlashAttention-3's
                    inter-warpgroup schedule). carry: (S_j, acc, m, l, block j's mask
                    flag) -> the same for j + 1 (S None without has_next)."""
                    s, acc, m_i, l_i, flag = carry
                    step = t * nb + j - u0
                    slot = lax.rem(step, stages)
                    p8, m_new, _, _, acc, l_i = softmax_block(s, m_i, slot, j, l_i, acc, flag)
                    flag_n = mask_flag(jnp.minimum(j + 1, nb - 1)) if has_next else None
                    with jax.named_scope("sync"):
                        plgpu.barrier_wait(v_bars.at[slot])

                    def body(refs):
                        acc_ref, sums_ref, s_ref = refs
                        issue_pv(acc_ref, sums_ref, p8, slot)
                        if has_next:
                            plgpu.barrier_wait(k_bars.at[lax.rem(step + 1, stages)])
                            issue_qk(s_ref, lax.rem(step + 1, stages))
                        schedule_barrier()

                    with jax.named_scope("pv"):
                        acc, sums, s_next = pl.run_state(body)(
                            (plgpu.ACC.init(acc), fresh_acc(8) if l_in_pv else None,
                             fresh_acc(block_kv) if has_next else None))
                    plgpu.barrier_arrive(v_done.at[slot])
                    if has_next:
                        maybe_signal(step + 1)
                    if l_in_pv:
                        l_i = l_i + sums  # l8_carry
                    return s_next, acc, m_new, l_i, flag_n

                def first_s():
                    """overlap 'batch' / 'pv': Q.K^T of the segment's first block, its K
                    waited for here, and that block's mask flag."""
                    step = t * nb + jb - u0
                    slot = lax.rem(step, stages)
                    flag = mask_flag(jb)
                    with jax.named_scope("sync"):
                        plgpu.barrier_wait(k_bars.at[slot])
                    return waited_qk(slot, step), flag

                def store_p(p8, step):
                    """overlap='qk': P of pipeline step ``step`` into SMEM buffer step % 2
                    (the other one holds the P that the P.V in flight reads)."""
                    p_smem.at[lax.rem(step, 2)][...] = p8
                    plgpu.commit_smem()  # visible to the wgmma (async proxy), all threads

                def qk_pipelined_segment(m_i, l_i):
                    """overlap='qk': the segment's KV blocks jb..je-1 with the softmax of
                    block j under Q.K^T of block j + 1 and P.V of block j - 1. Returns
                    (acc, m, l) once every wgmma has completed."""
                    step0 = t * nb + jb - u0
                    n_pv = 1 + int(l_in_pv)  # wgmma groups per P.V (with the row sums)

                    def body(acc_ref, s_ref, sums_ref):
                        slot0 = lax.rem(step0, stages)
                        with jax.named_scope("sync"):
                            plgpu.barrier_wait(k_bars.at[slot0])
                        with jax.named_scope("qk"):
                            issue_qk(s_ref, slot0)
                            s0 = plgpu.wgmma_accumulator_load(s_ref, wait_n=0)
                        maybe_signal(step0)

                        def step(j, carry, has_next):
                            # carry: S_j (waited), m over blocks < j, l over blocks < j - 1
                            # (scale m_{j-1}), the row sums of P_{j-1} (None with l_in_pv:
                            # they are in sums_ref, in flight with P.V_{j-1}).
                            s_cur, m_i, l_i, psum_prev = carry
                            step = t * nb + j - u0
                            slot = lax.rem(step, stages)
                            if has_next:  # Q.K^T of block j + 1 into the free accumulator
                                slot_n = lax.rem(step + 1, stages)
                                with jax.named_scope("sync"):
                                    plgpu.barrier_wait(k_bars.at[slot_n])
                                s_ref[...] = plgpu.layout_cast(
                                    jnp.full((BLOCK_Q, block_kv), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA)
                                issue_qk(s_ref, slot_n)
                            p8, m_new, alpha, psum, _, _ = softmax_block(s_cur, m_i, slot, j)
                            store_p(p8, step)
                            with jax.named_scope("pv"):
                                # P.V_{j-1} and its row sums done; Q.K^T_{j+1} may run on
                                plgpu.wgmma_wait(n_parts if has_next else 0)

                                @pl.when(j > jb)
                                def _():
                                    plgpu.barrier_arrive(v_done.at[lax.rem(step - 1, stages)])

                                if l_in_pv:
                                    rows = plgpu.wgmma_accumulator_load(
                                        sums_ref, wait_n=None).max(axis=1)
                                    sums_ref[...] = plgpu.layout_cast(
                                        jnp.full((BLOCK_Q, 8), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)
                                else:
                                    rows = psum_prev
                                l_i = (l_i + rows) * alpha
                                acc = plgpu.wgmma_accumulator_load(acc_ref, wait_n=None)
                                acc_ref[...] = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                                with jax.named_scope("sync"):
                                    plgpu.barrier_wait(v_bars.at[slot])
                                issue_pv(acc_ref, sums_ref, p_smem.at[lax.rem(step, 2)], slot)
                            if has_next:
                                with jax.named_scope("qk"):
                                    s_next = plgpu.wgmma_accumulator_load(s_ref, wait_n=n_pv)
                                return s_next, m_new, l_i, psum
                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(v_done.at[slot])
                            if l_in_pv:
                                psum = plgpu.wgmma_accumulator_load(
                                    sums_ref, wait_n=None).max(axis=1)
                            acc = plgpu.wgmma_accumulator_load(acc_ref, wait_n=None)
                            return acc, m_new, l_i + psum

                        psum0 = None if l_in_pv else l_i
                        carry = lax.fori_loop(jb, je - 1,
                                              functools.partial(step, has_next=True),
                                              (s0, m_i, l_i, psum0))
                        return step(je - 1, carry, has_next=False)

                    return pl.run_scoped(
                        body, plgpu.ACC((BLOCK_Q, d), jnp.float32),
                        plgpu.ACC((BLOCK_Q, block_kv), jnp.float32),
                        plgpu.ACC((BLOCK_Q, 8), jnp.float32) if l_in_pv else None)

                def first_block(m_i):
                    """overlap='pv': Q.K^T and the softmax of the segment's first block:
                    (p8, m, row sums of P)."""
                    s, flag = first_s()  # (no ping-pong with overlap)
                    slot = lax.rem(t * nb + jb - u0, stages)
                    p8, m_new, _, psum, _, _ = softmax_block(s, m_i, slot, jb, flag=flag)
                    return p8, m_new, psum

                def pv_pipelined_step(j, carry, has_next):
                    """overlap='pv': P.V of block j runs while the softmax of block j + 1
                    does (Q.K^T of j + 1 issued first; the wait for it leaves P.V in
                    flight). carry: (acc, m, l) over the blocks before j, block j's P and
                    row sums."""
                    acc, m_i, l_i, p8, psum = carry
                    step = t * nb + j - u0
                    slot = lax.rem(step, stages)
                    slot_n = lax.rem(step + 1, stages)
                    with jax.named_scope("sync"):
                        if has_next:
                            plgpu.barrier_wait(k_bars.at[slot_n])
                        plgpu.barrier_wait(v_bars.at[slot])

                    def body(refs):
                        acc_ref, s_ref, next_refs = refs
                        if has_next:
                            issue_qk(s_ref, slot_n)
                        issue_pv(acc_ref, None, p8, slot)  # P's last use
                        if not has_next:
                            return
                        with jax.named_scope("qk"):
                            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                        for ref, value in zip(next_refs,
                                              softmax_block(s, m_i, slot_n, j + 1)[:4]):
                            ref[...] = value

                    # Dummies of the softmax results' types and layouts (not P itself: a
                    # P live past its fence costs register copies inside the stage).
                    p_dummy = plgpu.layout_cast(jnp.zeros((BLOCK_Q, block_kv), F8),
                                                plgpu.Layout.WGMMA_8BIT)
                    s_acc = plgpu.ACC.init(plgpu.layout_cast(
                        jnp.full((BLOCK_Q, block_kv), 0.0, jnp.float32), plgpu.Layout.WGMMA))
                    inits = (plgpu.ACC.init(acc), s_acc if has_next else None,
                             (p_dummy, m_i, m_i, m_i) if has_next else None)
                    with jax.named_scope("pv"):
                        acc, _, nxt = pl.run_state(body)(inits)
                    plgpu.barrier_arrive(v_done.at[slot])
                    l_i = l_i + psum
                    if not has_next:
                        return acc, m_i, l_i
                    p8_n, m_n, alpha, psum_n = nxt
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    return acc, m_n, l_i * alpha, p8_n, psum_n

                if overlap == "pv":
                    p8, m_i, psum = first_block(m_i)
                    carry = lax.fori_loop(
                        jb, je - 1, functools.partial(pv_pipelined_step, has_next=True),
                        (acc, m_i, l_i, p8, psum))
                    acc, m_i, l_i = pv_pipelined_step(je - 1, carry, has_next=False)
                elif overlap == "qk":
                    acc, m_i, l_i = qk_pipelined_segment(m_i, l_i)
                elif overlap == "batch":
                    s0, flag0 = first_s()
                    carry = lax.fori_loop(jb, je - 1,
                                          functools.partial(batched_step, has_next=True),
                                          (s0, acc, m_i, l_i, flag0))
                    _, acc, m_i, l_i, _ = batched_step(je - 1, carry, has_next=False)
                else:
                    acc, m_i, l_i = lax.fori_loop(jb, je, kv_step, (acc, m_i, l_i))
                if l8_carry:
                    l_i = l_i.max(axis=1)

                @jax.named_scope("store")
                def store_output(acc, l_i):
                    out_scale = (sc_ref[head, 1] if q_in_kernel else
                                 plgpu.load(sc_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1)))
                    # l_i = 0 (no valid slot; with bit_exp2 masked slots give P = 0): acc is 0
                    acc = acc * lax.broadcast_in_dim(out_scale / jnp.maximum(l_i, 1e-30),
                                                     acc.shape, [0])
                    o_smem[...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(q0, BLOCK_Q), head])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                if not has_partials:
                    store_output(acc, l_i)
                    return

                @pl.when(jb > 0)
                @jax.named_scope("partial")
                def _write_partial():
                    # Normalized partial output (bf16) and its log2-sum-exp per row.
                    lse = m_i + jnp.log2(l_i)  # -inf for an all-masked range: weight 0
                    o_smem[...] = (acc * lax.broadcast_in_dim(1.0 / jnp.maximum(l_i, 1e-30),
                                                              acc.shape, [0])
                                   ).astype(out_dtype)
                    lse_smem[...] = lax.broadcast_in_dim(lse, (BLOCK_Q, 8), [0])
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, part_ref.at[cta, wg])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[cta, wg])
                    if p_in_smem:  # the next segment's P reuses o_smem's bytes
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(jnp.logical_not(defer_signal))(signal_partial)

                @pl.when(jb == 0)
                def _finish():
                    @jax.named_scope("merge")
                    def merge(c2, carry):
                        acc, m_i, l_i = carry
                        plgpu.semaphore_wait(sems.at[c2 * COMPUTE_WGS + wg], 1,
                                             decrement=False, memory_scope="gpu")
                        fence_proxy_async_global()
                        # o_smem: a partial is loaded and the output stored with the same
                        # layout, so each thread reads and writes the same addresses.
                        plgpu.copy_gmem_to_smem(part_ref.at[c2, wg], o_smem, p_bars.at[wg])
                        plgpu.copy_gmem_to_smem(lse_ref.at[c2, wg], lse_smem, p_bars.at[wg])
                        plgpu.barrier_wait(p_bars.at[wg])
                        lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA).max(axis=1)
                        m_new = jnp.maximum(m_i, lse)
                        a_own = jnp.exp2(m_i - m_new)
                        a_part = jnp.exp2(lse - m_new)
                        o_part = o_smem[...].astype(jnp.float32)
                        acc = (acc * lax.broadcast_in_dim(a_own, acc.shape, [0])
                               + o_part * lax.broadcast_in_dim(a_part, acc.shape, [0]))
                        return acc, m_new, l_i * a_own + a_part

                    # Partials of this tile: the CTAs after this one up to the tile's end.
                    last = stream_k_cta_of(t * nb + nb - 1, units, num_ctas, lax.div)
                    acc2, _, l2 = lax.fori_loop(cta + 1, last + 1, merge, (acc, m_i, l_i))
                    store_output(acc2, l2)

            pl.when(wg == 0)(schedule_barrier)
            plgpu.wait_smem_to_gmem(0)

        def issue_k(unit, slot):
            """K and the slot bias of work unit `unit` into stage `slot` (rows past S:
            TMA zeros, masked by the bias)."""
            head, j = head_block(unit)
            plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(j * block_kv, block_kv), head],
                                    k_smem_tma.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(bias_ref.at[pl.ds(j * block_kv, block_kv)],
                                    b_smem.at[slot], k_bars.at[slot])

        def _memory_v_in_kernel():
            # 232 + 232 + 40 = 504 = 3 x 168, the registers the CTA is launched with.
            plgpu.set_max_registers(40, action="decrease")

            def issue_v(unit, slot):
                head, j = head_block(unit)
                plgpu.copy_gmem_to_smem(vt_ref.at[pl.ds(j * block_kv, block_kv), head],
                                        v_raw.at[slot], v_raw_bars.at[slot])

            for i in range(stages):
                @pl.when(i < n_steps)
                def _(i=i):
                    issue_k(u0 + i, i)
                    issue_v(u0 + i, i)

            if l_in_pv:  # the ones operand of the row-sum wgmma, written once
                _fill_ones(ones_plain)

            @pl.loop(0, n_steps)
            def _(i):
                # K of step i - 1 + stages once both warpgroups' Q.K of step i - 1 is
                # done; first, so that a K load never waits behind a transpose.
                @pl.when(jnp.logical_and(i >= 1, i - 1 + stages < n_steps))
                def _():
                    ps = lax.rem(i - 1, stages)
                    plgpu.barrier_wait(k_done.at[ps])
                    issue_k(u0 + i - 1 + stages, ps)

                slot = lax.rem(i, stages)
                plgpu.barrier_wait(v_raw_bars.at[slot])

                @pl.when(i >= stages)
                def _():  # the P.V of step i - stages has finished reading V^T[slot]
                    plgpu.barrier_wait(v_done.at[slot])

                with jax.named_scope("v_transpose"):
                    if "no_v_transpose" not in debug:  # (timing only)
                        _transpose_v_block(v_raw.at[slot], vt_plain.at[slot],
                                           wide=wide_v_transpose)
                plgpu.commit_smem()  # generic-proxy stores -> visible to the wgmma
                plgpu.barrier_arrive(v_bars.at[slot])

                @pl.when(i + stages < n_steps)
                def _():
                    issue_v(u0 + i + stages, slot)

        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(unit, slot):
                issue_k(unit, slot)
                head, j = head_block(unit)
                plgpu.copy_gmem_to_smem(vt_ref.at[head, :, pl.ds(j * block_kv, block_kv)],
                                        v_smem.at[slot], v_bars.at[slot])

            for i in range(stages):
                pl.when(i < n_steps)(lambda i=i: issue(u0 + i, i))
            if ones_ready is not None:  # the row-sum wgmma's operand, once
                _fill_ones(ones_plain)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ones_ready)

            @pl.loop(0, jnp.maximum(n_steps - stages, 0))
            def _(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])
                issue(u0 + i + stages, slot)

        pl.when(wg == COMPUTE_WGS)(_memory_v_in_kernel if transpose_in_kernel else _memory)

    def entry(*refs):
        q_refs, (k_ref, vt_ref, sc_ref, bias_ref) = refs[:n_q_ops], refs[n_q_ops:n_q_ops + 4]
        rest = refs[n_q_ops + 4:]
        layer_ref, rest = (rest[0], rest[1:]) if stacked else (None, rest)
        mask_ref, rest = (rest[0], rest[1:]) if fast_unmasked else (None, rest)
        out_ref, part_ref, lse_ref = rest
        sw = plgpu.SwizzleTransform(128)
        t8 = plgpu.TilingTransform((8, 128))
        t16 = plgpu.TilingTransform((8, 64))
        q_shape = (n_qbuf, COMPUTE_WGS, n_parts, BLOCK_Q, d)
        q_spec = plgpu.SMEM(q_shape, F8, transforms=(t8, sw))
        vt_spec = plgpu.SMEM((stages, d, block_kv), F8, transforms=(t8, sw))
        if v_in_kernel:
            q_spec = plgpu.RefUnion(q_spec, plgpu.SMEM(q_shape, F8, transforms=(sw,)))
        if transpose_in_kernel:
            # The plain alias sees the same bytes; _transpose_v_block applies the 128-byte
            # swizzle itself (for 128-byte rows the (8, 128) tiling is the identity).
            vt_spec = plgpu.RefUnion(vt_spec, plgpu.SMEM((stages, d, block_kv), F8))
        lse_rows = BLOCK_Q if has_partials else 8  # stream-K partials' lse (unused else)
        o_spec = plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, d), out_dtype, transforms=(t16, sw))
        if p_in_smem:  # same bytes per warpgroup: 64 x 128 bf16 = 2 x 64 x 128 e4m3
            o_spec = plgpu.RefUnion(o_spec, plgpu.SMEM((COMPUTE_WGS, 2, BLOCK_Q, block_kv),
                                                       F8, transforms=(t8, sw)))
        smem = (
            q_spec,
            o_spec,
            plgpu.SMEM((n_qbuf, COMPUTE_WGS, 2, BLOCK_Q), jnp.float32),
            # K: TMA writes through an untiled view (the (8, 128) tiling of 128-byte
            # rows is the identity, so no S % 8 == 0 requirement on the cache) and the
            # wgmma reads the tiled view of the same bytes.
            plgpu.RefUnion(plgpu.SMEM((stages, block_kv, d), F8, transforms=(t8, sw)),
                           plgpu.SMEM((stages, block_kv, d), F8, transforms=(sw,))),
            vt_spec,
            plgpu.SMEM((stages, block_kv), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, lse_rows, 8), jnp.float32),
            # l_in_pv: [8, bkv] e4m3 ones, the B operand of the row-sum wgmma
            plgpu.RefUnion(plgpu.SMEM((8, block_kv), F8, transforms=(t8, sw)),
                           plgpu.SMEM((8, block_kv), F8)),
        )
        if q_in_kernel:  # the bf16 Q tiles as TMA brings them (as o_smem's layout)
            smem = smem + (plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, d), q8[0].dtype,
                                      transforms=(t16, sw)),)
        bars = (
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
             plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=1 if q_in_kernel else n_parts + 1,
                           num_barriers=n_qbuf * COMPUTE_WGS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),  # partial loads
        )
        if vt_stored and l_in_pv:  # the ones operand is written
            bars = bars + (plgpu.Barrier(num_arrivals=1),)
        if transpose_in_kernel:  # untransposed V staging buffers and their TMA barriers
            bars = bars + ((plgpu.SMEM((stages, block_kv, d), F8),
                            plgpu.Barrier(num_barriers=stages)),)
        n_smem = len(smem)
        pl.run_scoped(
            lambda *scoped: kernel(q_refs, k_ref, vt_ref, sc_ref, bias_ref, out_ref,
                                   part_ref, lse_ref, (scoped[:n_smem], scoped[n_smem:]),
                                   layer_ref, mask_ref),
            *smem, *bars, collective_axes="wg")

    out, _, _ = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((out_rows, h, d), out_dtype),
                  jax.ShapeDtypeStruct((n_part_slots, COMPUTE_WGS, BLOCK_Q, d), out_dtype),
                  jax.ShapeDtypeStruct((n_part_slots, COMPUTE_WGS, BLOCK_Q, 8), jnp.float32)),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(
            approx_math=True, profile_space=512 if profile_dir else 0,
            profile_dir=profile_dir),
    )(*q8, k8, vt, scales, bias, *((layer,) if stacked else ()),
      *((block_masked,) if fast_unmasked else ()))
    return out


def default_stages(v_transposed: bool) -> int:
    """The pipeline depth that fits shared memory and measured fastest: 3 when V arrives
    as V^T (no transpose staging buffer; GPU run 20: 56.9 vs 58.2 us at 18 heads with 2),
    else 2."""
    return 3 if v_transposed else 2


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The Pallas kernel's options, with their defaults, as :func:`attention_pallas` and
    :func:`kernel_options` take them (keywords); :func:`attention_pallas` documents them."""

    block_kv: int = 128
    stages: int | None = None
    q_split: bool = True
    v_in_kernel: bool = True
    persistent: bool = True
    num_sms: int | None = None
    pingpong: bool = False
    l_in_pv: bool = True
    fast_unmasked: bool = True
    overlap: str = ""
    bit_exp2: bool = False
    q_in_kernel: bool = False
    p_codes: int | None = None
    lazy_rescale: bool = True
    wide_v_transpose: bool = True
    v_transposed: bool = False


KERNEL_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(KernelOptions))


def kernel_options(h: int, valid, *, tq: int, **options) -> dict:
    """The keyword arguments of :func:`_fp8_attention_call` (all but the output's dtype and
    clipping) for ``h`` heads, ``tq`` queries and the slot mask ``valid`` [S], from
    :class:`KernelOptions` keywords: the CTA count of the schedule and the per-block mask
    flags that the softmax options need; q_split matters only with q_in_kernel (how many
    e4m3 parts the kernel makes of Q); stages None: :func:`default_stages`; p_codes None: 1
    where the other options allow it (the row sums from the tensor core, no bit_exp2),
    else 0."""
    o = KernelOptions(**options)
    stages = default_stages(o.v_transposed) if o.stages is None else o.stages
    p_codes = (int(o.l_in_pv and o.v_in_kernel and not o.bit_exp2) if o.p_codes is None
               else o.p_codes)
    n_tiles = h * -(-tq // (COMPUTE_WGS * BLOCK_Q))
    nb = -(-valid.shape[0] // o.block_kv)
    return dict(
        tq=tq, block_kv=o.block_kv, stages=stages, v_in_kernel=o.v_in_kernel,
        num_ctas=(stream_k_ctas(n_tiles, nb, min(stages, nb), o.num_sms) if o.persistent
                  else None),
        pingpong=o.pingpong, l_in_pv=o.l_in_pv and o.v_in_kernel,
        fast_unmasked=o.fast_unmasked,
        block_masked=block_masked_flags(valid, o.block_kv) if o.fast_unmasked else None,
        overlap=o.overlap, bit_exp2=o.bit_exp2,
        q_in_kernel=(2 if o.q_split else 1) if o.q_in_kernel else 0, p_codes=p_codes,
        lazy_rescale=o.lazy_rescale,
        wide_v_transpose=o.wide_v_transpose and o.v_in_kernel and not o.v_transposed,
        vt_stored=o.v_transposed)


@functools.partial(jax.jit, static_argnames=("clip_out", "padded_out") + KERNEL_OPTION_NAMES)
def attention_pallas(q, k, v, k_scale, v_scale, valid, layer=None, *, clip_out: bool = False,
                     padded_out: bool = False, **options):
    """FP8 attention through the Mosaic GPU kernel (Hopper only).

    Same arguments and result as :func:`attention`; K/V must be float8_e4m3fn and
    D == 128. v_in_kernel=True: V is read as stored and transposed in the kernel (and
    with ``layer`` the [L, S, H, D] stacks are read in place); False: the wrapper builds
    a permuted V^T with XLA (GPU run 1's kernel). persistent=True: the stream-K schedule
    over ``num_sms`` CTAs (default: the device's SMs, see :func:`stream_k_ctas`); False:
    one CTA per (head, 128-query tile). pingpong, l_in_pv, fast_unmasked: the softmax
    options of :func:`_fp8_attention_call` (the defaults measured fastest together on the
    H200: -9% kernel time at 18 heads, -7% at 36; BUILD_NOTES, GPU run 6). q_in_kernel: the
    kernel quantizes Q into its e4m3 part(s) itself (needs v_in_kernel; see
    ``_fp8_attention_call``), instead of XLA passes in this wrapper. p_codes: P's e4m3
    codes from the logits' bits (1; 2 with the low-range line; 0: ex2 + cvt, half the
    error, ~10% slower; None, the default: 1 where l_in_pv holds and bit_exp2 is off).
    lazy_rescale (default on): the output's rescale only when a row's max moves by > 0.75
    (log2). wide_v_transpose (default on): the in-kernel V
    transpose with 16-byte shared loads. The three defaults are GPU runs 18-20's fastest
    set; the step's numerics stay within the run-to-run spread (BUILD_NOTES, GPU run 21).
    v_transposed: ``v`` is V^T as :func:`transpose_v` makes it ([(L,) H, D, S']); the
    kernel copies its blocks as they are (``vt_stored``: no transpose). Needs v_in_kernel.
    stages: the K/V pipeline depth, None for :func:`default_stages` (3 with v_transposed).
    options: these, as :class:`KernelOptions` keywords (an unknown name is a TypeError).
    """
    tq, h, d = q.shape
    o = KernelOptions(**options)
    if isinstance(q, QuantizedQ) and (o.q_in_kernel or len(q.parts) != (2 if o.q_split else 1)):
        raise ValueError(f"a QuantizedQ of {len(q.parts)} parts does not fit options {o}")
    if o.v_transposed and not o.v_in_kernel:
        raise ValueError("v_transposed needs v_in_kernel=True")
    if k.dtype != F8 or v.dtype != F8:
        raise TypeError("attention_pallas needs float8_e4m3fn K/V")
    if layer is not None and not o.v_in_kernel:
        k, v = _layer_of(k, layer), _layer_of(v, layer)
        layer = None
    call = functools.partial(_fp8_attention_call, out_dtype=jnp.bfloat16, clip_out=clip_out,
                             **kernel_options(h, valid, tq=tq, **options))
    if o.q_in_kernel and not o.v_in_kernel:
        raise ValueError("q_in_kernel needs v_in_kernel=True")
    if o.v_in_kernel:
        if o.q_in_kernel:
            q8, scales, bias = _prepare_inputs_q_in_kernel(q, k_scale, v_scale, valid,
                                                           o.block_kv)
        else:
            q8, scales, bias = _prepare_inputs_v_in_kernel(q, k_scale, v_scale, valid,
                                                           o.block_kv, o.q_split)
        layer_arr = None if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
        out = call(q8, k, v, scales, bias, layer=layer_arr)
    else:
        q8, scales, bias, vt = _prepare_inputs(q, v, k_scale, v_scale, valid, o.block_kv,
                                               o.q_split)
        out = call(q8, k, vt, scales, bias)
    return (out if padded_out else out[:tq]).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------


def is_hopper() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    return cc is not None and str(cc).startswith("9")


def resolve_impl(impl: str, kv_dtype, head_dim: int) -> str:
    """The concrete implementation that :func:`attention` runs for ``impl``:
    'auto' is 'pallas' on an NVIDIA Hopper GPU for FP8 K/V and head_dim 128, else
    'reference'; any other name is checked and returned."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    ok = jnp.dtype(kv_dtype) == F8 and head_dim == 128 and is_hopper()
    return "pallas" if ok else "reference"


def _layer_of(x, layer):
    return lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def attention(q, k, v, k_scale, v_scale, valid, *, impl: str = "auto", layer=None,
              v_transposed: bool = False, padded_out: bool = False) -> jax.Array:
    """q: [Tq, H, D] bf16/f32 (queries, RoPE already applied), or a :class:`QuantizedQ`
    (the kernels' e4m3 parts, made elsewhere; the other impls dequantize it); k, v: [S, H, D] float8_e4m3fn
    (or bf16/f32 when the cache is not FP8); k_scale, v_scale: [H] float32 per-head dequant
    scales (real = stored * scale); valid: [S] bool slot mask, or its :class:`SlotMask`
    (made once for many calls). Softmax scale 1/sqrt(D).
    layer: None, or an int32 scalar (may be traced); then k and v are the cache's whole
    stacks [L, S, H, D] and layer ``layer`` is attended (clamped to [0, L)): the Pallas
    kernel reads it in place, the other impls slice it.
    v_transposed: v is V^T as :func:`transpose_v` makes it, [(L,) H, D, S'] (how a cache
    stores V for the kernel: no transpose per call); the other impls undo it.
    padded_out: the Pallas kernels return all the rows they computed, [Tq' >= Tq, H, D]
    (Tq rounded up to their query tile; the rows past Tq are not attention outputs), for a
    consumer that reads only the first Tq rows (a slice would be a copy); other impls
    return [Tq, H, D] regardless.
    Returns [Tq, H, D] in q.dtype. impl: 'auto' | 'reference' | 'pallas' | 'pallas-exp2'
    (the kernel with P from ex2 + cvt and the eager rescale) | 'cudnn' | 'xla'.
    'auto' picks the Pallas kernel on an NVIDIA Hopper GPU for FP8 K/V and the reference elsewhere."""
    impl = resolve_impl(impl, k.dtype, q.shape[-1])
    if isinstance(q, QuantizedQ) and impl not in PALLAS_IMPLS:
        q = q.dequantize(jnp.bfloat16)
    if impl not in PALLAS_IMPLS:
        valid = _mask_valid(valid)
    if layer is not None and k.ndim != 4:
        raise ValueError(f"with layer, k and v must be [L, S, H, D] stacks, got {k.shape}")
    if impl in PALLAS_IMPLS:
        return attention_pallas(q, k, v, k_scale, v_scale, valid, layer,
                                **PALLAS_IMPLS[impl], v_transposed=v_transposed,
                                padded_out=padded_out)
    if v_transposed:
        v = untranspose_v(v, k.shape[-3])
    if layer is not None:
        k, v = _layer_of(k, layer), _layer_of(v, layer)
    if impl == "reference":
        return attention_reference(q, k, v, k_scale, v_scale, valid)
    if impl in ("cudnn", "xla"):
        return attention_dot_product(q, k, v, k_scale, v_scale, valid, implementation=impl)
    raise ValueError(f"unknown attention impl {impl!r}")
