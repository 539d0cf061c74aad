"""FP8 attention over the ring KV cache: Pallas Mosaic GPU kernel, reference, dispatcher.

One attention call of the model: ``Tq`` new queries (757 for characters-57b) attend over
``S`` cache slots (5,788: the sink, then six ring frames) whose K and V are stored as
float8_e4m3fn with one float32 dequantization scale per head (real = stored * scale).
Some slots are invalid (a short prompt leaves sink slots empty, the ring is partly empty
early in a session); ``valid`` masks them. The softmax scale is 1/sqrt(D).

Implementations:

* :func:`attention_reference`: plain ``jnp`` in float32, any shape, any backend. It is
  the definition of the op and the portable fallback.
* :func:`attention_pallas`: a FlashAttention-3-style kernel for Hopper (H100/H200)
  written with Pallas' Mosaic GPU backend (``plgpu``), derived from jax's
  ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``, with FP8 wgmma for both
  products. A tile is one head and 128 query rows: two compute warpgroups of 64 rows
  each and one memory warpgroup feeding K, V and the mask through TMA into a ring of SMEM
  stages. The grid is persistent, one CTA per SM (stream-K): the tiles' KV blocks are
  split evenly over the CTAs, a CTA's range cuts tiles, and the CTA holding a tile's
  first block merges the others' bf16 partials (log2-sum-exp per row, GMEM semaphores)
  in the kernel. The two compute warpgroups run freely (their softmaxes overlap), the
  row sums of P come from a small wgmma against a block of ones, and blocks without a
  masked slot skip the bias. P's e4m3 codes are computed from the logits' float bits
  (no ex2, no cvt), and the output is rescaled only when a row max moves past a margin.

  - Q is quantized to e4m3 outside the kernel with one scale per (row, head), split into
    two e4m3 parts, hi = e4m3(q) and lo = e4m3(q - hi), so Q.K^T is two FP8 wgmmas into
    one accumulator (~2^-8 relative error; e4m3 Q alone costs ~2.5% in the logits). The
    row scale, the head's K scale, 1/sqrt(D) and log2(e) fold into one per-row factor
    that multiplies the FP8 logits.
  - P ~ 256 exp2(s - m) (below 448, the e4m3 maximum) is fed from registers as the A
    operand of the P.V wgmma. The V scale is applied once, to the output.
  - FP8 wgmma needs both operands K-major, so P.V needs V^T in shared memory. The f32
    accumulator layout of P holds column pairs (2t, 2t+1, 2t+8, 2t+9) per thread where
    the 8-bit A layout expects quadruplets (4t..4t+3); rather than shuffling P between
    threads, the keys of each 16-key group of V^T are permuted the same way, so the P
    registers are used as they are. V is read as the cache stores it, [S, H, D]: the
    memory warpgroup TMA-loads each V block into a staging buffer and writes the
    permuted transpose with 16-byte shared loads, byte permutes and 32-bit shared
    stores, bank-conflict-free, hidden under the compute warpgroups' matmuls.
  - S need not be a multiple of the KV block: the last K block runs past S, TMA fills
    those rows with zeros and the bias masks them. The last output tile's rows past Tq
    are padding (``padded_out``). The mask is a per-slot bias (0 or -1e30, finite so
    that no row can produce NaN); the output factor is zero when no slot is valid, so
    such rows come out as zeros.
* ``jax.nn.dot_product_attention`` (cuDNN or XLA) on dequantized bf16 K/V.

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

from pallas_kernels import device
from pallas_kernels.mgpu_sync import fence_proxy_async_global
from pallas_kernels.numerics import FP8 as F8, FP8_MAX as F8_MAX

LOG2E = math.log2(math.e)
_MASK_BIAS = -1e30  # finite: a fully masked row gives zeros, never NaN
_P_LOG2_SCALE = 8.0  # P is quantized as 256 * exp2(s - m)
IMPLS = ("auto", "reference", "pallas", "cudnn", "xla")
PALLAS_IMPLS = ("pallas",)
# P as e4m3 codes straight from the logits, no MUFU ex2 and no cvt: an e4m3 code is
# 8 x (biased exponent) + mantissa, so round(8 y + 56 + _CODE_SHIFT) is the code of ~2^y
# (Schraudolph's linear mantissa on the e4m3 grid), y = log2 P <= 8.75. In the kernel:
# v = fma.sat(x, a, b) = clamp(code / 128, 0, 1), then fma(v, 128, _CODE_MAGIC) puts
# round(128 v) in the low byte of its bits, and byte permutes pack four codes per 32-bit
# register in the 8-bit wgmma layout.
_CODE_SHIFT = -0.25  # y <= 8.75: code <= 125.75 -> 126 (448), no NaN
_CODE_MAGIC = 1.5 * 2**23  # 1 ulp = 1: fma(v, 128, magic) rounds 128 v into the low bits
# prmt selectors that pack the low bytes of four words a, b, c, d into [a, b, c, d]:
# lo = prmt(a, b, PAIR), hi = prmt(c, d, PAIR), word = prmt(lo, hi, QUAD).
_PACK_PAIR_SEL, _PACK_QUAD_SEL = 0x0040, 0x5410
# The running row max (log2 units) moves only past this margin, so P <= 2^(8 + margin)
# = 430 < 448 (e4m3's maximum; code 126).
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
# cuDNN / XLA path
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


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """The Pallas kernel's tiling: ``block_kv`` keys per KV block (128: the kernel's V
    transpose is written for 128 x 128 blocks), ``stages`` K/V pipeline stages in shared
    memory, and ``num_sms`` CTAs of the persistent (stream-K) grid (None: the device's
    SMs; :func:`stream_k_ctas`)."""

    block_kv: int = 128
    stages: int = 2
    num_sms: int | None = None


DEFAULT_TUNING = AttentionTuning()


def _vec_elem(v, i: int):
    """Kernel code: element i (static) of an MLIR vector value."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector
    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def p_code_coefficients(xa, y_off):
    """Per-row coefficients (a, b) of the e4m3 P codes for y = x * xa + y_off (any shapes
    that broadcast), with which the kernel computes code / 128 = clamp(x a + b, 0, 1)."""
    return xa * (1.0 / 16.0), y_off * (1.0 / 16.0) + (56.0 + _CODE_SHIFT) / 128.0


def p_codes_reference(x, xa, y_off):
    """What the kernel's P is, as e4m3 values (f32): the codes of
    :func:`p_code_coefficients` for y = x * xa + y_off, rounded half to even."""
    a, b = p_code_coefficients(xa, y_off)
    v = jnp.clip(x * a + b, 0.0, 1.0)
    code = jnp.round(v * 128.0).astype(jnp.uint8)
    return lax.bitcast_convert_type(code, F8).astype(jnp.float32)


def _p_codes_8bit_a(x, coefs, block_kv: int):
    """Kernel code: e4m3 P codes (:func:`p_codes_reference`) of x [64, bkv] f32 (WGMMA
    layout) in the 8-bit wgmma A layout, no MUFU, no cvt. coefs: the
    :func:`p_code_coefficients` pair, each broadcast to x's shape. Per four elements of
    a row: four saturating FMAs, four rounding FMAs and three byte permutes, one inline
    PTX block. The register grouping is :func:`_key_permutation`'s (pairs 2g and 2g + 1
    of a row form one 32-bit register)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,) * 3,
        return_type=plgpu.ShapeDtypeStruct((BLOCK_Q, block_kv), F8,
                                           layout=plgpu.Layout.WGMMA_8BIT),
    )
    def codes(ctx, xs, *cs):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        lines = [f"fma.rn.sat.f32 t{i}, ${i + 1}, $5, $6;" for i in range(4)]
        f32_hex = lambda v: f"0f{int(np.array(v, np.float32).view(np.uint32)):08X}"
        lines += [f"fma.rn.f32 t{i}, t{i}, {f32_hex(128.0)}, {f32_hex(_CODE_MAGIC)};"
                  for i in range(4)]
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

    return codes(x, *coefs)


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
    address plan; the kernel passes :class:`_MlirOps`)."""
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


def _transpose_plan(o, warp, lane, it):
    """The V transpose's byte offsets for thread (warp, lane) in iteration it < 2: four
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


def _transpose_v_block(raw_ref, vt_ref):
    """Memory-warpgroup code: V^T[slot] <- key-permuted transpose of a staged V block.

    raw_ref: [bkv=128, D=128] e4m3, plain (as TMA wrote it: row = key, 128 bytes).
    vt_ref: [D, bkv] e4m3, the plain alias of the wgmma's V^T buffer, whose bytes follow
    the 128-byte swizzle: byte (d, c) sits at d*128 + ((c // 16) ^ (d % 8))*16 + c % 16.
    Column c = 4t + 2h + v of a 16-key group g holds key 16g + 8h + 2t + v
    (:func:`_key_permutation`), so each 32-bit store word (columns 4t..4t+3) gathers keys
    16g + (2t, 2t+1, 2t+8, 2t+9). Two iterations (:func:`_transpose_plan`) of four
    16-byte loads, four 4x4 byte transposes (8 prmt each) and 16 32-bit stores, the store
    addresses one XOR each, bank-conflict-free.
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
        @utils.fori(c(2), ())
        def _(it, carry):
            loads, stores = _transpose_plan(ops, warp, lane, it)
            v4 = ir.VectorType.get((4,), i32)
            rows = [llvm.load(v4, utils.getelementptr(raw_p, [off], i8), alignment=16)
                    for off in loads]
            words = [[_vec_elem(r, m) for r in rows] for m in range(4)]
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
    kernel's, ``DEFAULT_TUNING.block_kv``)."""
    block_kv = block_kv or DEFAULT_TUNING.block_kv
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


def _prepare_q_scales_bias(q, k_scale, v_scale, valid, block_kv):
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
        scales = attention_scales(q.row_scale, k_scale, v_scale, _any_valid(valid), d)
    return q.parts, scales, _slot_bias(valid, block_kv)


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


def padded_slots(s_len: int, block_kv: int = 128) -> int:
    """S' for S = s_len slots: rounded up to the kernel's KV blocks (the mask bias's
    length)."""
    return -(-s_len // block_kv) * block_kv


def stream_k_ctas(n_tiles: int, nb: int, stages: int, num_sms: int | None) -> int:
    """How many CTAs the persistent (stream-K) schedule launches for ``n_tiles`` tiles of
    ``nb`` KV blocks: one per SM (``num_sms``, default the device's), so that all are
    resident at once (the owner CTAs wait for others); fewer when a CTA would get under
    2 * stages blocks (the pipeline's fill would dominate)."""
    units = n_tiles * nb
    sms = num_sms or device.sm_count()
    return max(1, min(sms, units // max(2 * stages, 1)))


def stream_k_ranges(units: int, num_ctas: int) -> np.ndarray:
    """[num_ctas + 1] int: CTA c takes the work units [r[c], r[c + 1]) (as the kernel
    computes them: c * units // num_ctas)."""
    return (np.arange(num_ctas + 1, dtype=np.int64) * units) // num_ctas


def stream_k_cta_of(unit, units: int, num_ctas: int, div=operator.floordiv):
    """The CTA whose range [c * units // num_ctas, (c + 1) * units // num_ctas) holds work
    unit ``unit`` (numpy or, with ``div=lax.div``, traced int32)."""
    return div((unit + 1) * num_ctas + units - 1, units) - 1


def _fp8_attention_call(q8, k8, v8, scales, bias, block_masked, *, block_kv, stages,
                        num_ctas, out_dtype, layer=None):
    """The Pallas kernel. q8: Q's two e4m3 parts [Tq, H, D]; k8, v8 [S, H, D] e4m3 as the
    cache stores them (V transposed in the kernel); scales [H, 2, Tq'] f32; bias [S'] f32;
    block_masked [nb] int32 -> [Tq', H, D] out_dtype (Tq' = :func:`padded_queries`; rows
    past Tq are padding).

    layer: None, or a [1] int32 array; then k8 and v8 are the whole cache stacks
    [L, S, H, D] and the kernel reads layer ``layer`` (clamped to [0, L)) in place: it
    indexes the GMEM refs with it before the TMA copies, so XLA never copies the layer's
    K/V out of the stack.

    num_ctas: the schedule. The work is H * n_qtiles tiles (tile t: head t // n_qtiles,
    query rows 128 * (t % n_qtiles) ...) of nb KV blocks each, nb * H * n_qtiles units in
    all, in that order; CTA c takes units [c * W // C, (c + 1) * W // C). With as many
    CTAs as tiles each CTA runs whole tiles. With fewer (one per SM: stream-K) a CTA's
    range cuts tiles: the CTA that holds a tile's first KV block (its "owner"; that
    segment is the last of its range) finishes the tile; the others (each a CTA's first
    segment, so done early) write a bf16 partial output, normalized, with its
    log2-sum-exp per row, and signal a semaphore; the owner waits for them (no wait in
    practice), merges and stores. Needs every CTA resident at once (num_ctas <= SMs, one
    CTA per SM by its shared memory).

    Per KV block a compute warpgroup issues Q.K^T (two wgmmas, one per Q part) into a
    fresh accumulator and waits; the softmax (``block_masked`` picks the bias-free form
    for blocks without a masked slot) turns the logits into P's e4m3 codes
    (:func:`_p_codes_8bit_a`) with the lazy rescale (the running max moves only past
    :data:`_LAZY_RESCALE`; a warp whose rows all keep their max skips the rescale of its
    output, :func:`_rescale_rows_if_any`); then P.V and P times a block of e4m3 ones
    (the row sums of the P actually multiplied, in a fresh [64, 8] accumulator) are
    issued together and waited for.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental import mosaic as _mosaic  # noqa: F401
    import jax.experimental.mosaic.gpu as mgpu  # noqa: F401

    q8 = tuple(q8)
    n_parts = len(q8)
    tq_in, h, d = q8[0].shape
    stacked = layer is not None
    num_layers = k8.shape[0] if stacked else 1
    tq_pad = padded_queries(tq_in)
    nb = -(-k8.shape[-3] // block_kv)
    stages = min(stages, nb)
    n_qtiles = tq_pad // (COMPUTE_WGS * BLOCK_Q)
    n_tiles = h * n_qtiles
    units = n_tiles * nb
    num_ctas = int(num_ctas)
    if n_parts != 2:
        raise ValueError(f"the kernel takes Q as its two e4m3 parts, got {n_parts}")
    if not 1 <= num_ctas <= units:
        raise ValueError(f"num_ctas must be in [1, {units}], got {num_ctas}")
    if units * (num_ctas + 1) >= 2**31:
        raise ValueError(f"{units} work units x {num_ctas} CTAs overflow int32")
    ranges = stream_k_ranges(units, num_ctas)
    # Partials exist when some CTA starts inside a tile.
    has_partials = bool(np.any(ranges[:-1] % nb != 0))
    if has_partials and np.any(np.diff(ranges) < 1):
        raise ValueError("every CTA needs at least one KV block")
    if d != 128 or block_kv != 128:
        raise NotImplementedError(f"the FP8 kernel handles head_dim 128 and KV blocks of "
                                  f"128, got {d} and {block_kv}")
    n_part_slots = num_ctas if has_partials else 1
    # Q of a CTA's next tile is prefetched into a second buffer while the current one
    # runs, where a CTA has several tiles and the shared memory allows it.
    kb = 1024
    smem_one_q = (COMPUTE_WGS * n_parts * BLOCK_Q * d + COMPUTE_WGS * BLOCK_Q * d * 2
                  + 3 * stages * block_kv * d + 8 * kb)
    n_qbuf = 2 if (num_ctas != n_tiles and
                   smem_one_q + COMPUTE_WGS * n_parts * BLOCK_Q * d <= 224 * kb) else 1

    def kernel(q_refs, k_ref, vt_ref, sc_ref, bias_ref, out_ref, part_ref, lse_ref, scoped,
               layer_ref, mask_ref):
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
         lse_smem2, (ones_smem, ones_plain)), bars = scoped
        (k_bars, v_bars, q_bars), (k_done, v_done), p_bars, (v_raw, v_raw_bars) = bars
        t_first, t_last = lax.div(u0, nb), lax.div(u1 - 1, nb)
        # A CTA whose first segment is a partial signals it after the next segment's first
        # KV step (its TMA store has long completed by then), or at once if it has no other.
        signal_step = (t_first + 1) * nb - u0
        defer_signal = jnp.logical_and(u0 - t_first * nb > 0, signal_step < n_steps)
        # q_smem2 = (tiled view for the wgmma, untiled view for the TMA)
        q_smem2, q_smem2_tma = q_smem2
        # v_smem = (tiled V^T for the wgmma, plain alias for the transpose)
        v_smem, vt_plain = v_smem
        sems = (pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas * COMPUTE_WGS,)))
                if has_partials else None)

        def head_block(unit):
            tile = lax.div(unit, nb)
            return lax.div(tile, n_qtiles), unit - tile * nb

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]

            def tile_rows(t):
                head = lax.div(t, n_qtiles)
                return head, ((t - head * n_qtiles) * COMPUTE_WGS + wg) * BLOCK_Q

            def issue_q(t, buf):
                """Q (both parts) and the row scales of tile t into buffer ``buf``."""
                head, q0 = tile_rows(t)
                bar = q_bars.at[buf * COMPUTE_WGS + wg]
                for part in range(n_parts):
                    # rows past Tq are zero-filled by TMA (no padded copy of Q)
                    plgpu.copy_gmem_to_smem(q_refs[part].at[pl.ds(q0, BLOCK_Q), head],
                                            q_smem2_tma.at[buf, wg, part], bar)
                plgpu.copy_gmem_to_smem(sc_ref.at[head, :, pl.ds(q0, BLOCK_Q)],
                                        sc_smem2.at[buf, wg], bar)

            def signal_partial():
                plgpu.wait_smem_to_gmem(0)  # the partial is written, not only read
                fence_proxy_async_global()
                plgpu.semaphore_signal(sems.at[cta * COMPUTE_WGS + wg], 1,
                                       memory_scope="gpu")

            if n_qbuf == 2:
                issue_q(t_first, 0)
            plgpu.barrier_wait(k_bars.at[0])

            @pl.loop(t_first, t_last + 1)
            def _segment(t):
                head, q0 = tile_rows(t)
                jb = jnp.maximum(u0 - t * nb, 0)
                je = jnp.minimum(u1 - t * nb, nb)
                buf = lax.rem(t - t_first, n_qbuf)
                if n_qbuf == 1:
                    issue_q(t, 0)
                with jax.named_scope("q_wait"):
                    plgpu.barrier_wait(q_bars.at[buf * COMPUTE_WGS + wg])
                if n_qbuf == 2:
                    # buffer 1 - buf was the previous tile's: its wgmmas have completed
                    pl.when(t < t_last)(lambda: issue_q(t + 1, 1 - buf))
                q_smem, sc_smem = q_smem2.at[buf, wg], sc_smem2.at[buf, wg]
                row_scale = plgpu.load(sc_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))

                m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)
                # The row sums ride as a [64, 8] tile (all columns equal: no cross-thread
                # reduction per block), reduced once after the segment.
                l_i = plgpu.layout_cast(jnp.full((BLOCK_Q, 8), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)

                def waited_qk(slot, step):
                    """S = Q.K^T of K stage ``slot`` in a fresh accumulator, waited for,
                    then the deferred partial signal if ``step`` is due for it."""
                    def qk(s_ref):
                        for part in range(n_parts):  # s = (q_hi + q_lo) . k
                            plgpu.wgmma(s_ref, q_smem.at[part], k_smem.at[slot].T)
                        return s_ref[...]

                    with jax.named_scope("qk"):
                        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                    maybe_signal(step)
                    return s

                def softmax(s, m_i, l_i, acc, slot, masked):
                    """Online softmax of one block: (p8, m_new, alpha, acc, l_i); m in the
                    log2 domain, P = 256 exp2(s - m_new) as e4m3 codes in the 8-bit wgmma
                    layout. m moves only when the block's row max passes it by more than
                    _LAZY_RESCALE (else alpha = 1, P up to 2^8.75); acc and l_i are
                    rescaled by alpha = exp2(m_i - m_new), acc only by the warps whose rows
                    moved. Releases the K stage (K and the bias) once the bias is read."""
                    if masked:  # x = logits with the bias, y = x + 8 - m_new
                        rs = lax.broadcast_in_dim(row_scale, s.shape, [0])
                        b = plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                        plgpu.barrier_arrive(k_done.at[slot])
                        x = s * rs + lax.broadcast_in_dim(b, s.shape, [1])
                        m_blk = x.max(axis=1)
                    else:  # no bias: the row factor is > 0, so max(s * f) = f max(s)
                        plgpu.barrier_arrive(k_done.at[slot])
                        x = s
                        m_blk = s.max(axis=1) * row_scale
                    moved = m_blk > m_i + _LAZY_RESCALE
                    m_new = jnp.where(moved, jnp.maximum(m_i, m_blk), m_i)
                    # P's codes from x: y = x * xa + (8 - m_new)
                    xa = (plgpu.layout_cast(jnp.full((BLOCK_Q,), 1.0, jnp.float32),
                                            plgpu.Layout.WGMMA.reduce(1))
                          if masked else row_scale)
                    coefs = tuple(lax.broadcast_in_dim(c, s.shape, [0])
                                  for c in p_code_coefficients(xa, _P_LOG2_SCALE - m_new))
                    p8 = _p_codes_8bit_a(x, coefs, block_kv)
                    alpha = jnp.where(moved, jnp.exp2(m_i - m_new), 1.0)
                    acc = _rescale_rows_if_any(acc, alpha)
                    l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [0])
                    return lax.optimization_barrier((p8, m_new, alpha, acc, l_i))

                def maybe_signal(step):
                    if has_partials:
                        pl.when(jnp.logical_and(defer_signal, step == signal_step))(
                            signal_partial)

                def fresh_acc(n):
                    """A zeroed [64, n] f32 wgmma accumulator."""
                    return plgpu.ACC.init(plgpu.layout_cast(
                        jnp.full((BLOCK_Q, n), 0.0, jnp.float32), plgpu.Layout.WGMMA))

                def kv_step(j, carry):
                    """One KV block: Q.K^T, wait, softmax, P.V and the row sums, wait."""
                    acc, m_i, l_i = carry
                    step = t * nb + j - u0  # this CTA's pipeline step
                    slot = lax.rem(step, stages)
                    flag = mask_ref[j]  # read before the wgmma wait, so its latency hides
                    s = waited_qk(slot, step)
                    with jax.named_scope("softmax"):
                        p8, m_new, _, acc, l_i = lax.cond(
                            flag != 0, functools.partial(softmax, masked=True),
                            functools.partial(softmax, masked=False), s, m_i, l_i, acc, slot)
                    with jax.named_scope("sync"):
                        plgpu.barrier_wait(v_bars.at[slot])

                    def pv(refs):
                        acc_ref, sums_ref = refs
                        plgpu.wgmma(acc_ref, p8, v_smem.at[slot].T)
                        plgpu.wgmma(sums_ref, p8, ones_smem.T)  # this block's row sums
                        nxt = step + 1

                        @pl.when(nxt < n_steps)
                        def _():
                            plgpu.barrier_wait(k_bars.at[lax.rem(nxt, stages)])

                    with jax.named_scope("pv"):
                        acc, sums = pl.run_state(pv)((plgpu.ACC.init(acc), fresh_acc(8)))
                    plgpu.barrier_arrive(v_done.at[slot])
                    return acc, m_new, l_i + sums

                acc, m_i, l_i = lax.fori_loop(jb, je, kv_step, (acc, m_i, l_i))
                l_i = l_i.max(axis=1)

                @jax.named_scope("store")
                def store_output(acc, l_i):
                    out_scale = plgpu.load(sc_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
                    # l_i = 0 (no valid slot): acc is 0
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

            plgpu.wait_smem_to_gmem(0)

        def issue_k(unit, slot):
            """K and the slot bias of work unit `unit` into stage `slot` (rows past S:
            TMA zeros, masked by the bias)."""
            head, j = head_block(unit)
            plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(j * block_kv, block_kv), head],
                                    k_smem_tma.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(bias_ref.at[pl.ds(j * block_kv, block_kv)],
                                    b_smem.at[slot], k_bars.at[slot])

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
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

            _fill_ones(ones_plain)  # the ones operand of the row-sum wgmma, written once

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
                    _transpose_v_block(v_raw.at[slot], vt_plain.at[slot])
                plgpu.commit_smem()  # generic-proxy stores -> visible to the wgmma
                plgpu.barrier_arrive(v_bars.at[slot])

                @pl.when(i + stages < n_steps)
                def _():
                    issue_v(u0 + i + stages, slot)

    def entry(*refs):
        q_refs, (k_ref, vt_ref, sc_ref, bias_ref) = refs[:n_parts], refs[n_parts:n_parts + 4]
        rest = refs[n_parts + 4:]
        layer_ref, rest = (rest[0], rest[1:]) if stacked else (None, rest)
        mask_ref, out_ref, part_ref, lse_ref = rest
        sw = plgpu.SwizzleTransform(128)
        t8 = plgpu.TilingTransform((8, 128))
        t16 = plgpu.TilingTransform((8, 64))
        q_shape = (n_qbuf, COMPUTE_WGS, n_parts, BLOCK_Q, d)
        q_spec = plgpu.RefUnion(plgpu.SMEM(q_shape, F8, transforms=(t8, sw)),
                                plgpu.SMEM(q_shape, F8, transforms=(sw,)))
        # The plain alias sees the same bytes; _transpose_v_block applies the 128-byte
        # swizzle itself (for 128-byte rows the (8, 128) tiling is the identity).
        vt_spec = plgpu.RefUnion(plgpu.SMEM((stages, d, block_kv), F8, transforms=(t8, sw)),
                                 plgpu.SMEM((stages, d, block_kv), F8))
        lse_rows = BLOCK_Q if has_partials else 8  # stream-K partials' lse (unused else)
        o_spec = plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, d), out_dtype, transforms=(t16, sw))
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
            # [8, bkv] e4m3 ones, the B operand of the row-sum wgmma
            plgpu.RefUnion(plgpu.SMEM((8, block_kv), F8, transforms=(t8, sw)),
                           plgpu.SMEM((8, block_kv), F8)),
        )
        bars = (
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
             plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=n_parts + 1, num_barriers=n_qbuf * COMPUTE_WGS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),  # partial loads
            # untransposed V staging buffers and their TMA barriers
            (plgpu.SMEM((stages, block_kv, d), F8), plgpu.Barrier(num_barriers=stages)),
        )
        n_smem = len(smem)
        pl.run_scoped(
            lambda *scoped: kernel(q_refs, k_ref, vt_ref, sc_ref, bias_ref, out_ref,
                                   part_ref, lse_ref, (scoped[:n_smem], scoped[n_smem:]),
                                   layer_ref, mask_ref),
            *smem, *bars, collective_axes="wg")

    out, _, _ = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((tq_pad, h, d), out_dtype),
                  jax.ShapeDtypeStruct((n_part_slots, COMPUTE_WGS, BLOCK_Q, d), out_dtype),
                  jax.ShapeDtypeStruct((n_part_slots, COMPUTE_WGS, BLOCK_Q, 8), jnp.float32)),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*q8, k8, v8, scales, bias, *((layer,) if stacked else ()), block_masked)
    return out


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
    q8, scales, bias = _prepare_q_scales_bias(q, k_scale, v_scale, valid, tuning.block_kv)
    layer_arr = None if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = _fp8_attention_call(q8, k, v, scales, bias, block_masked, block_kv=tuning.block_kv,
                              stages=tuning.stages, num_ctas=num_ctas, out_dtype=jnp.bfloat16,
                              layer=layer_arr)
    return (out if padded_out else out[:tq]).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------


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


def _layer_of(x, layer):
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
        valid = _mask_valid(valid)
    if layer is not None and k.ndim != 4:
        raise ValueError(f"with layer, k and v must be [L, S, H, D] stacks, got {k.shape}")
    if impl in PALLAS_IMPLS:
        return attention_pallas(q, k, v, k_scale, v_scale, valid, layer,
                                padded_out=padded_out)
    if layer is not None:
        k, v = _layer_of(k, layer), _layer_of(v, layer)
    if impl == "reference":
        return attention_reference(q, k, v, k_scale, v_scale, valid)
    if impl in ("cudnn", "xla"):
        return attention_dot_product(q, k, v, k_scale, v_scale, valid, implementation=impl)
    raise ValueError(f"unknown attention impl {impl!r}")
