"""The attention kernel's inline register and shared-memory code (Mosaic GPU ``inline_mgpu``
and PTX), with the host-side twins the CPU tests emulate it with.

P's e4m3 codes straight from the logits' float bits (``p_codes_8bit_a``, and
``p_codes_reference`` for what they are as values), the conditional output rescale
(``rescale_rows_if_any``), and the memory warpgroup's V transpose into the wgmma's V^T
buffer with its keys permuted to the 8-bit register layout (``transpose_v_block``, its
address plan ``transpose_plan`` run on ints by the tests), plus the block of e4m3 ones the
row-sum wgmma reads (``fill_ones``).
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8_attention.schedule import BLOCK_Q
from pallas_kernels.numerics import FP8 as F8

P_LOG2_SCALE = 8.0  # P is quantized as 256 * exp2(s - m)
# P as e4m3 codes straight from the logits, no MUFU ex2 and no cvt: an e4m3 code is
# 8 x (biased exponent) + mantissa, so round(8 y + 56 + CODE_SHIFT) is the code of ~2^y
# (Schraudolph's linear mantissa on the e4m3 grid), y = log2 P <= 8.75. In the kernel:
# v = fma.sat(x, a, b) = clamp(code / 128, 0, 1), then fma(v, 128, CODE_MAGIC) puts
# round(128 v) in the low byte of its bits, and byte permutes pack four codes per 32-bit
# register in the 8-bit wgmma layout.
CODE_SHIFT = -0.25  # y <= 8.75: code <= 125.75 -> 126 (448), no NaN
CODE_MAGIC = 1.5 * 2**23  # 1 ulp = 1: fma(v, 128, magic) rounds 128 v into the low bits
# prmt selectors that pack the low bytes of four words a, b, c, d into [a, b, c, d]:
# lo = prmt(a, b, PAIR), hi = prmt(c, d, PAIR), word = prmt(lo, hi, QUAD).
PACK_PAIR_SEL, PACK_QUAD_SEL = 0x0040, 0x5410
# The running row max (log2 units) moves only past this margin, so P <= 2^(8 + margin)
# = 430 < 448 (e4m3's maximum; code 126).
LAZY_RESCALE = 0.75


def vec_elem(v, i: int):
    """Kernel code: element i (static) of an MLIR vector value."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector
    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def p_code_coefficients(xa, y_off):
    """Per-row coefficients (a, b) of the e4m3 P codes for y = x * xa + y_off (any shapes
    that broadcast), with which the kernel computes code / 128 = clamp(x a + b, 0, 1)."""
    return xa * (1.0 / 16.0), y_off * (1.0 / 16.0) + (56.0 + CODE_SHIFT) / 128.0


def p_codes_reference(x, xa, y_off):
    """What the kernel's P is, as e4m3 values (f32): the codes of
    :func:`p_code_coefficients` for y = x * xa + y_off, rounded half to even."""
    a, b = p_code_coefficients(xa, y_off)
    v = jnp.clip(x * a + b, 0.0, 1.0)
    code = jnp.round(v * 128.0).astype(jnp.uint8)
    return lax.bitcast_convert_type(code, F8).astype(jnp.float32)


def p_codes_8bit_a(x, coefs, block_kv: int):
    """Kernel code: e4m3 P codes (:func:`p_codes_reference`) of x [64, bkv] f32 (WGMMA
    layout) in the 8-bit wgmma A layout, no MUFU, no cvt. coefs: the
    :func:`p_code_coefficients` pair, each broadcast to x's shape. Per four elements of
    a row: four saturating FMAs, four rounding FMAs and three byte permutes, one inline
    PTX block. The register grouping is :func:`key_permutation`'s (pairs 2g and 2g + 1
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
        lines += [f"fma.rn.f32 t{i}, t{i}, {f32_hex(128.0)}, {f32_hex(CODE_MAGIC)};"
                  for i in range(4)]
        lines += [f"prmt.b32 lo, t0, t1, {PACK_PAIR_SEL:#06x};",
                  f"prmt.b32 hi, t2, t3, {PACK_PAIR_SEL:#06x};",
                  f"prmt.b32 $0, lo, hi, {PACK_QUAD_SEL:#06x};"]
        ptx = ("{\n\t.reg .f32 t0, t1, t2, t3, w0, w1, w2, w3;\n\t.reg .b32 lo, hi;\n\t"
               + "\n\t".join(lines) + "\n\t}")
        regs = xs.registers  # [1, bkv/8, 1, 1, 2, 1, 1, 1, 1] of vector<2xf32>
        new = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((BLOCK_Q, block_kv)), object)
        for rh in range(2):
            # each coefficient is constant along a row: any register of row half rh
            row = [vec_elem(c.registers[0, 0, 0, 0, rh, 0, 0, 0, 0], 0) for c in cs]
            for g in range(block_kv // 16):
                vals = [vec_elem(regs[0, 2 * g + k, 0, 0, rh, 0, 0, 0, 0], e)
                        for k in range(2) for e in range(2)]
                word = utils.inline_ptx(ptx, *vals, *row, result_types=i32)
                new[0, g, 0, 0, rh, 0, 0, 0, 0] = utils.bitcast(word, f8x4)
        return mgpu.FragmentedArray(_registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                    _is_signed=None)

    return codes(x, *coefs)


def rescale_rows_if_any(acc, alpha):
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
        ne = [arith.cmpf(arith.CmpFPredicate.UNE, vec_elem(r, 0), one) for r in rows]
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


def key_permutation(block_kv: int) -> np.ndarray:
    """perm[i] = local key index whose V row sits at position i of a V^T block.

    Within each 16-key group, the key 8h + 2t + v (h<2, t<4, v<2) goes to 4t + 2h + v:
    that is where the 8-bit wgmma A layout reads the P value that the f32 accumulator
    layout holds for that key.
    """
    idx = np.arange(block_kv).reshape(block_kv // 16, 2, 4, 2)  # (g, h, t, v)
    return idx.transpose(0, 2, 1, 3).reshape(-1)


class IntOps:
    """Integer arithmetic on Python ints (the CPU emulation's side of the V transpose's
    address plan; the kernel passes :class:`MlirOps`)."""
    add = staticmethod(operator.add)
    mul = staticmethod(operator.mul)
    xor = staticmethod(operator.xor)
    and_ = staticmethod(operator.and_)
    or_ = staticmethod(operator.or_)
    shr = staticmethod(operator.rshift)


class MlirOps:
    """The same operations as :class:`IntOps` on i32 MLIR values (ints become constants)."""

    def __init__(self):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith
        i32 = ir.IntegerType.get_signless(32)
        lift = lambda x: arith.constant(i32, x) if isinstance(x, int) else x
        for name, op in (("add", arith.addi), ("mul", arith.muli), ("xor", arith.xori),
                         ("and_", arith.andi), ("or_", arith.ori), ("shr", arith.shrui)):
            setattr(self, name, lambda a, b, op=op: op(lift(a), lift(b)))


def transpose_4x4(prmt, r0, r1, r2, r3):
    """Four 32-bit words (rows) -> their byte transpose: out[j] = (r0.b_j, r1.b_j, r2.b_j,
    r3.b_j), 8 prmt (prmt(a, b, sel): any function on ints or MLIR values)."""
    t01l, t01h = prmt(r0, r1, 0x5140), prmt(r0, r1, 0x7362)
    t23l, t23h = prmt(r2, r3, 0x5140), prmt(r2, r3, 0x7362)
    return (prmt(t01l, t23l, 0x5410), prmt(t01l, t23l, 0x7632),
            prmt(t01h, t23h, 0x5410), prmt(t01h, t23h, 0x7632))


def transpose_plan(o, warp, lane, it):
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


def transpose_v_block(raw_ref, vt_ref):
    """Memory-warpgroup code: V^T[slot] <- key-permuted transpose of a staged V block.

    raw_ref: [bkv=128, D=128] e4m3, plain (as TMA wrote it: row = key, 128 bytes).
    vt_ref: [D, bkv] e4m3, the plain alias of the wgmma's V^T buffer, whose bytes follow
    the 128-byte swizzle: byte (d, c) sits at d*128 + ((c // 16) ^ (d % 8))*16 + c % 16.
    Column c = 4t + 2h + v of a 16-key group g holds key 16g + 8h + 2t + v
    (:func:`key_permutation`), so each 32-bit store word (columns 4t..4t+3) gathers keys
    16g + (2t, 2t+1, 2t+8, 2t+9). Two iterations (:func:`transpose_plan`) of four
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
        ops = MlirOps()

        def prmt(a, b, sel):
            return utils.inline_ptx("prmt.b32 $0, $1, $2, $3;", a, b, c(sel),
                                    result_types=i32)

        # A loop, not unrolled: this runs in the memory warpgroup under 40 registers.
        @utils.fori(c(2), ())
        def _(it, carry):
            loads, stores = transpose_plan(ops, warp, lane, it)
            v4 = ir.VectorType.get((4,), i32)
            rows = [llvm.load(v4, utils.getelementptr(raw_p, [off], i8), alignment=16)
                    for off in loads]
            words = [[vec_elem(r, m) for r in rows] for m in range(4)]
            for quad, offs in zip(words, stores):
                for o_, off in zip(transpose_4x4(prmt, *quad), offs):
                    llvm.store(o_, utils.getelementptr(vt_p, [off], i8))
            return carry

    tr(raw_ref, vt_ref)


def fill_ones(ref):
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
