"""The FP8 attention kernel (Pallas Mosaic GPU, Hopper), in named stages.

A CTA runs two compute warpgroups of 64 query rows each and one memory warpgroup that
feeds K, the slot bias and V through TMA into a ring of ``stages`` shared-memory stages
(V staged untransposed, then written transposed into the wgmma's V^T buffer). The work
is H * n_qtiles tiles (tile t: head t // n_qtiles, query rows 128 * (t % n_qtiles) ...)
of nb KV blocks each, nb * H * n_qtiles units in all, in that order; CTA c takes units
[c * W // C, (c + 1) * W // C). With as many CTAs as tiles each CTA runs whole tiles.
With fewer (one per SM: stream-K) a CTA's range cuts tiles: the CTA that holds a tile's
first KV block (its "owner"; that segment is the last of its range) finishes the tile;
the others (each a CTA's first segment, so done early) write a bf16 partial output,
normalized, with its log2-sum-exp per row, and signal a semaphore; the owner waits for
them (no wait in practice), merges and stores. Every CTA must be resident at once
(num_ctas <= SMs, one CTA per SM by its shared memory).

Per KV block a compute warpgroup issues Q.K^T (two wgmmas, one per Q part) into a fresh
accumulator and waits; the softmax (``block_masked`` picks the bias-free form for blocks
without a masked slot) turns the logits into P's e4m3 codes (``inline.p_codes_8bit_a``)
with the lazy rescale (the running max moves only past ``inline.LAZY_RESCALE``; a warp
whose rows all keep their max skips the rescale of its output); then P.V and P times a
block of e4m3 ones (the row sums of the P actually multiplied, in a fresh [64, 8]
accumulator) are issued together and waited for.

Stages: ``plan_call`` (the static sizes), ``_shared_memory`` (buffers and barriers),
``_compute_warpgroup`` -> ``_tile_segment`` -> ``_kv_block`` / ``_softmax`` and
``_finish_segment``, ``_memory_warpgroup``.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8_attention.inline import (LAZY_RESCALE, P_LOG2_SCALE, fill_ones,
                                                 p_code_coefficients, p_codes_8bit_a,
                                                 rescale_rows_if_any, transpose_v_block)
from pallas_kernels.fp8_attention.schedule import (BLOCK_Q, COMPUTE_WGS, padded_queries,
                                                   stream_k_cta_of, stream_k_ranges)
from pallas_kernels.mgpu_sync import fence_proxy_async_global
from pallas_kernels.numerics import FP8 as F8

# The kernel's name as profiler traces show it ('fp8_attention_mosaic_gpu_kernel').
KERNEL_NAME = "fp8_attention"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of one call: heads, head_dim, Tq' (queries rounded up to a tile),
    the K/V stack's layers (None: one layer's K/V), the KV blocks of ``block_kv`` keys
    (nb), the work units, the CTAs and whether their ranges cut tiles (partials), the Q
    buffers per warpgroup (2: the next tile's Q is prefetched), the output dtype."""

    heads: int
    head_dim: int
    tq_pad: int
    layers: int | None
    block_kv: int
    stages: int
    nb: int
    n_qtiles: int
    units: int
    num_ctas: int
    has_partials: bool
    n_qbuf: int
    out_dtype: object
    n_parts: int = 2  # Q's hi and lo

    @property
    def n_tiles(self) -> int:
        return self.heads * self.n_qtiles

    @property
    def n_part_slots(self) -> int:
        return self.num_ctas if self.has_partials else 1


def plan_call(tq: int, heads: int, head_dim: int, slots: int, layers: int | None, *,
              block_kv: int, stages: int, num_ctas: int, out_dtype) -> Plan:
    """The ``Plan`` of a call on Tq queries and S = ``slots`` cache slots; checks what the
    kernel handles."""
    tq_pad = padded_queries(tq)
    nb = -(-slots // block_kv)
    stages = min(stages, nb)
    n_qtiles = tq_pad // (COMPUTE_WGS * BLOCK_Q)
    n_tiles = heads * n_qtiles
    units = n_tiles * nb
    num_ctas = int(num_ctas)
    if not 1 <= num_ctas <= units:
        raise ValueError(f"num_ctas must be in [1, {units}], got {num_ctas}")
    if units * (num_ctas + 1) >= 2**31:
        raise ValueError(f"{units} work units x {num_ctas} CTAs overflow int32")
    ranges = stream_k_ranges(units, num_ctas)
    # Partials exist when some CTA starts inside a tile.
    has_partials = bool(np.any(ranges[:-1] % nb != 0))
    if has_partials and np.any(np.diff(ranges) < 1):
        raise ValueError("every CTA needs at least one KV block")
    if head_dim != 128 or block_kv != 128:
        raise NotImplementedError(f"the FP8 kernel handles head_dim 128 and KV blocks of "
                                  f"128, got {head_dim} and {block_kv}")
    # Q of a CTA's next tile is prefetched into a second buffer while the current one
    # runs, where a CTA has several tiles and the shared memory allows it.
    kb, n_parts = 1024, 2
    smem_one_q = (COMPUTE_WGS * n_parts * BLOCK_Q * head_dim + COMPUTE_WGS * BLOCK_Q * head_dim * 2
                  + 3 * stages * block_kv * head_dim + 8 * kb)
    n_qbuf = 2 if (num_ctas != n_tiles and
                   smem_one_q + COMPUTE_WGS * n_parts * BLOCK_Q * head_dim <= 224 * kb) else 1
    return Plan(heads=heads, head_dim=head_dim, tq_pad=tq_pad, layers=layers,
                block_kv=block_kv, stages=stages, nb=nb, n_qtiles=n_qtiles, units=units,
                num_ctas=num_ctas, has_partials=has_partials, n_qbuf=n_qbuf,
                out_dtype=out_dtype)


def _shared_memory(p: Plan):
    """(shared-memory buffers, barriers) of a CTA, in the order ``_cta`` unpacks them."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    d, bkv, stages = p.head_dim, p.block_kv, p.stages
    sw = plgpu.SwizzleTransform(128)
    t8 = plgpu.TilingTransform((8, 128))
    t16 = plgpu.TilingTransform((8, 64))
    q_shape = (p.n_qbuf, COMPUTE_WGS, p.n_parts, BLOCK_Q, d)
    q_spec = plgpu.RefUnion(plgpu.SMEM(q_shape, F8, transforms=(t8, sw)),
                            plgpu.SMEM(q_shape, F8, transforms=(sw,)))
    # The plain alias sees the same bytes; transpose_v_block applies the 128-byte
    # swizzle itself (for 128-byte rows the (8, 128) tiling is the identity).
    vt_spec = plgpu.RefUnion(plgpu.SMEM((stages, d, bkv), F8, transforms=(t8, sw)),
                             plgpu.SMEM((stages, d, bkv), F8))
    lse_rows = BLOCK_Q if p.has_partials else 8  # stream-K partials' lse (unused else)
    o_spec = plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, d), p.out_dtype, transforms=(t16, sw))
    smem = (
        q_spec,
        o_spec,
        plgpu.SMEM((p.n_qbuf, COMPUTE_WGS, 2, BLOCK_Q), jnp.float32),
        # K: TMA writes through an untiled view (the (8, 128) tiling of 128-byte
        # rows is the identity, so no S % 8 == 0 requirement on the cache) and the
        # wgmma reads the tiled view of the same bytes.
        plgpu.RefUnion(plgpu.SMEM((stages, bkv, d), F8, transforms=(t8, sw)),
                       plgpu.SMEM((stages, bkv, d), F8, transforms=(sw,))),
        vt_spec,
        plgpu.SMEM((stages, bkv), jnp.float32),
        plgpu.SMEM((COMPUTE_WGS, lse_rows, 8), jnp.float32),
        # [8, bkv] e4m3 ones, the B operand of the row-sum wgmma
        plgpu.RefUnion(plgpu.SMEM((8, bkv), F8, transforms=(t8, sw)),
                       plgpu.SMEM((8, bkv), F8)),
    )
    bars = (
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_arrivals=p.n_parts + 1, num_barriers=p.n_qbuf * COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),  # partial loads
        # untransposed V staging buffers and their TMA barriers
        (plgpu.SMEM((stages, bkv, d), F8), plgpu.Barrier(num_barriers=stages)),
    )
    return smem, bars


def _cta(p: Plan, refs, smem, bars):
    """The CTA's refs, buffers, barriers and range, as one namespace: c.k_ref, c.q_smem2,
    c.k_bars, c.u0, c.wg, ... (the names of the stages below)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    c = SimpleNamespace(**refs)
    if c.layer_ref is not None:
        # Views of layer `li` of the stacks (clamped like lax.dynamic_slice): no copy.
        li = jnp.minimum(jnp.maximum(c.layer_ref[0], 0), p.layers - 1)
        c.k_ref, c.vt_ref = c.k_ref.at[li], c.vt_ref.at[li]
    c.cta = lax.axis_index("ctas")
    c.u0 = lax.div(c.cta * p.units, p.num_ctas)
    c.u1 = lax.div((c.cta + 1) * p.units, p.num_ctas)
    c.n_steps = c.u1 - c.u0
    c.wg = lax.axis_index("wg")
    (q_smem2, c.o_smem2, c.sc_smem2, (c.k_smem, c.k_smem_tma), v_smem, c.b_smem,
     c.lse_smem2, (c.ones_smem, c.ones_plain)) = smem
    (c.k_bars, c.v_bars, c.q_bars), (c.k_done, c.v_done), c.p_bars, (c.v_raw, c.v_raw_bars) = bars
    c.t_first, c.t_last = lax.div(c.u0, p.nb), lax.div(c.u1 - 1, p.nb)
    # A CTA whose first segment is a partial signals it after the next segment's first
    # KV step (its TMA store has long completed by then), or at once if it has no other.
    c.signal_step = (c.t_first + 1) * p.nb - c.u0
    c.defer_signal = jnp.logical_and(c.u0 - c.t_first * p.nb > 0, c.signal_step < c.n_steps)
    # q_smem2 = (tiled view for the wgmma, untiled view for the TMA)
    c.q_smem2, c.q_smem2_tma = q_smem2
    # v_smem = (tiled V^T for the wgmma, plain alias for the transpose)
    c.v_smem, c.vt_plain = v_smem
    c.sems = (pl.get_global(plgpu.SemaphoreType.REGULAR((p.num_ctas * COMPUTE_WGS,)))
              if p.has_partials else None)
    return c


def _head_block(p: Plan, unit):
    """(head, KV block) of a work unit."""
    tile = lax.div(unit, p.nb)
    return lax.div(tile, p.n_qtiles), unit - tile * p.nb


def _compute_warpgroup(p: Plan, c):
    """A compute warpgroup: its 64 rows of every tile segment in the CTA's range."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.set_max_registers(232, action="increase")
    c.o_smem, c.lse_smem = c.o_smem2.at[c.wg], c.lse_smem2.at[c.wg]

    def tile_rows(t):
        head = lax.div(t, p.n_qtiles)
        return head, ((t - head * p.n_qtiles) * COMPUTE_WGS + c.wg) * BLOCK_Q

    def issue_q(t, buf):
        """Q (both parts) and the row scales of tile t into buffer ``buf``."""
        head, q0 = tile_rows(t)
        bar = c.q_bars.at[buf * COMPUTE_WGS + c.wg]
        for part in range(p.n_parts):
            # rows past Tq are zero-filled by TMA (no padded copy of Q)
            plgpu.copy_gmem_to_smem(c.q_refs[part].at[pl.ds(q0, BLOCK_Q), head],
                                    c.q_smem2_tma.at[buf, c.wg, part], bar)
        plgpu.copy_gmem_to_smem(c.sc_ref.at[head, :, pl.ds(q0, BLOCK_Q)],
                                c.sc_smem2.at[buf, c.wg], bar)

    def signal_partial():
        plgpu.wait_smem_to_gmem(0)  # the partial is written, not only read
        fence_proxy_async_global()
        plgpu.semaphore_signal(c.sems.at[c.cta * COMPUTE_WGS + c.wg], 1, memory_scope="gpu")

    c.tile_rows, c.issue_q, c.signal_partial = tile_rows, issue_q, signal_partial
    if p.n_qbuf == 2:
        issue_q(c.t_first, 0)
    plgpu.barrier_wait(c.k_bars.at[0])
    pl.loop(c.t_first, c.t_last + 1)(functools.partial(_tile_segment, p, c))
    plgpu.wait_smem_to_gmem(0)


def _tile_segment(p: Plan, c, t):
    """The CTA's KV blocks of tile t ([jb, je) of its nb): Q in, the online softmax over
    the blocks, then the tile's output, or its partial, or the merge of the others'."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    head, q0 = c.tile_rows(t)
    jb = jnp.maximum(c.u0 - t * p.nb, 0)
    je = jnp.minimum(c.u1 - t * p.nb, p.nb)
    buf = lax.rem(t - c.t_first, p.n_qbuf)
    if p.n_qbuf == 1:
        c.issue_q(t, 0)
    with jax.named_scope("q_wait"):
        plgpu.barrier_wait(c.q_bars.at[buf * COMPUTE_WGS + c.wg])
    if p.n_qbuf == 2:
        # buffer 1 - buf was the previous tile's: its wgmmas have completed
        pl.when(t < c.t_last)(lambda: c.issue_q(t + 1, 1 - buf))
    q_smem, sc_smem = c.q_smem2.at[buf, c.wg], c.sc_smem2.at[buf, c.wg]
    row_scale = plgpu.load(sc_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))

    m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((BLOCK_Q, p.head_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)
    # The row sums ride as a [64, 8] tile (all columns equal: no cross-thread reduction
    # per block), reduced once after the segment.
    l_i = plgpu.layout_cast(jnp.full((BLOCK_Q, 8), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    kv_block = functools.partial(_kv_block, p, c, t, q_smem, row_scale)
    acc, m_i, l_i = lax.fori_loop(jb, je, kv_block, (acc, m_i, l_i))
    l_i = l_i.max(axis=1)
    _finish_segment(p, c, t, jb, head, q0, sc_smem, acc, m_i, l_i)


def _kv_block(p: Plan, c, t, q_smem, row_scale, j, carry):
    """KV block j of tile t: Q.K^T, wait, softmax, P.V and the row sums, wait."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    acc, m_i, l_i = carry
    step = t * p.nb + j - c.u0  # this CTA's pipeline step
    slot = lax.rem(step, p.stages)
    flag = c.mask_ref[j]  # read before the wgmma wait, so its latency hides

    def qk(s_ref):
        for part in range(p.n_parts):  # s = (q_hi + q_lo) . k
            plgpu.wgmma(s_ref, q_smem.at[part], c.k_smem.at[slot].T)
        return s_ref[...]

    with jax.named_scope("qk"):
        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, p.block_kv), jnp.float32))
    if p.has_partials:  # the deferred partial signal, if this step is due for it
        pl.when(jnp.logical_and(c.defer_signal, step == c.signal_step))(c.signal_partial)
    with jax.named_scope("softmax"):
        softmax = functools.partial(_softmax, p, c, row_scale)
        p8, m_new, _, acc, l_i = lax.cond(
            flag != 0, functools.partial(softmax, masked=True),
            functools.partial(softmax, masked=False), s, m_i, l_i, acc, slot)
    with jax.named_scope("sync"):
        plgpu.barrier_wait(c.v_bars.at[slot])

    def pv(refs):
        acc_ref, sums_ref = refs
        plgpu.wgmma(acc_ref, p8, c.v_smem.at[slot].T)
        plgpu.wgmma(sums_ref, p8, c.ones_smem.T)  # this block's row sums
        nxt = step + 1

        @pl.when(nxt < c.n_steps)
        def _():
            plgpu.barrier_wait(c.k_bars.at[lax.rem(nxt, p.stages)])

    def fresh_sums():
        """A zeroed [64, 8] f32 wgmma accumulator."""
        return plgpu.ACC.init(plgpu.layout_cast(
            jnp.full((BLOCK_Q, 8), 0.0, jnp.float32), plgpu.Layout.WGMMA))

    with jax.named_scope("pv"):
        acc, sums = pl.run_state(pv)((plgpu.ACC.init(acc), fresh_sums()))
    plgpu.barrier_arrive(c.v_done.at[slot])
    return acc, m_new, l_i + sums


def _softmax(p: Plan, c, row_scale, s, m_i, l_i, acc, slot, masked):
    """Online softmax of one block: (p8, m_new, alpha, acc, l_i); m in the log2 domain,
    P = 256 exp2(s - m_new) as e4m3 codes in the 8-bit wgmma layout. m moves only when
    the block's row max passes it by more than LAZY_RESCALE (else alpha = 1, P up to
    2^8.75); acc and l_i are rescaled by alpha = exp2(m_i - m_new), acc only by the warps
    whose rows moved. Releases the K stage (K and the bias) once the bias is read."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if masked:  # x = logits with the bias, y = x + 8 - m_new
        rs = lax.broadcast_in_dim(row_scale, s.shape, [0])
        b = plgpu.load(c.b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        plgpu.barrier_arrive(c.k_done.at[slot])
        x = s * rs + lax.broadcast_in_dim(b, s.shape, [1])
        m_blk = x.max(axis=1)
    else:  # no bias: the row factor is > 0, so max(s * f) = f max(s)
        plgpu.barrier_arrive(c.k_done.at[slot])
        x = s
        m_blk = s.max(axis=1) * row_scale
    moved = m_blk > m_i + LAZY_RESCALE
    m_new = jnp.where(moved, jnp.maximum(m_i, m_blk), m_i)
    # P's codes from x: y = x * xa + (8 - m_new)
    xa = (plgpu.layout_cast(jnp.full((BLOCK_Q,), 1.0, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
          if masked else row_scale)
    coefs = tuple(lax.broadcast_in_dim(co, s.shape, [0])
                  for co in p_code_coefficients(xa, P_LOG2_SCALE - m_new))
    p8 = p_codes_8bit_a(x, coefs, p.block_kv)
    alpha = jnp.where(moved, jnp.exp2(m_i - m_new), 1.0)
    acc = rescale_rows_if_any(acc, alpha)
    l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [0])
    return lax.optimization_barrier((p8, m_new, alpha, acc, l_i))


def _finish_segment(p: Plan, c, t, jb, head, q0, sc_smem, acc, m_i, l_i):
    """A segment's end: the whole tile's output stored; or (stream-K) a later segment's
    normalized partial and log2-sum-exp written and signalled, or the owner's merge of the
    CTAs after it, then the store."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    o_smem, lse_smem = c.o_smem, c.lse_smem

    @jax.named_scope("store")
    def store_output(acc, l_i):
        out_scale = plgpu.load(sc_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
        # l_i = 0 (no valid slot): acc is 0
        acc = acc * lax.broadcast_in_dim(out_scale / jnp.maximum(l_i, 1e-30), acc.shape, [0])
        o_smem[...] = acc.astype(p.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, c.out_ref.at[pl.ds(q0, BLOCK_Q), head])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if not p.has_partials:
        store_output(acc, l_i)
        return

    @pl.when(jb > 0)
    @jax.named_scope("partial")
    def _write_partial():
        # Normalized partial output (bf16) and its log2-sum-exp per row.
        lse = m_i + jnp.log2(l_i)  # -inf for an all-masked range: weight 0
        o_smem[...] = (acc * lax.broadcast_in_dim(1.0 / jnp.maximum(l_i, 1e-30),
                                                  acc.shape, [0])).astype(p.out_dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, (BLOCK_Q, 8), [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, c.part_ref.at[c.cta, c.wg])
        plgpu.copy_smem_to_gmem(lse_smem, c.lse_ref.at[c.cta, c.wg])
        pl.when(jnp.logical_not(c.defer_signal))(c.signal_partial)

    @pl.when(jb == 0)
    def _finish():
        @jax.named_scope("merge")
        def merge(c2, carry):
            acc, m_i, l_i = carry
            plgpu.semaphore_wait(c.sems.at[c2 * COMPUTE_WGS + c.wg], 1,
                                 decrement=False, memory_scope="gpu")
            fence_proxy_async_global()
            # o_smem: a partial is loaded and the output stored with the same layout, so
            # each thread reads and writes the same addresses.
            plgpu.copy_gmem_to_smem(c.part_ref.at[c2, c.wg], o_smem, c.p_bars.at[c.wg])
            plgpu.copy_gmem_to_smem(c.lse_ref.at[c2, c.wg], lse_smem, c.p_bars.at[c.wg])
            plgpu.barrier_wait(c.p_bars.at[c.wg])
            lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA).max(axis=1)
            m_new = jnp.maximum(m_i, lse)
            a_own = jnp.exp2(m_i - m_new)
            a_part = jnp.exp2(lse - m_new)
            o_part = o_smem[...].astype(jnp.float32)
            acc = (acc * lax.broadcast_in_dim(a_own, acc.shape, [0])
                   + o_part * lax.broadcast_in_dim(a_part, acc.shape, [0]))
            return acc, m_new, l_i * a_own + a_part

        # Partials of this tile: the CTAs after this one up to the tile's end.
        last = stream_k_cta_of(t * p.nb + p.nb - 1, p.units, p.num_ctas, lax.div)
        acc2, _, l2 = lax.fori_loop(c.cta + 1, last + 1, merge, (acc, m_i, l_i))
        store_output(acc2, l2)


def _memory_warpgroup(p: Plan, c):
    """The memory warpgroup: K and the bias of each step by TMA, V staged by TMA and
    written transposed (keys permuted) into the wgmma's V^T stage, ``stages`` ahead."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bkv, stages = p.block_kv, p.stages
    # 232 + 232 + 40 = 504 = 3 x 168, the registers the CTA is launched with.
    plgpu.set_max_registers(40, action="decrease")

    def issue_k(unit, slot):
        """K and the slot bias of work unit `unit` into stage `slot` (rows past S: TMA
        zeros, masked by the bias)."""
        head, j = _head_block(p, unit)
        plgpu.copy_gmem_to_smem(c.k_ref.at[pl.ds(j * bkv, bkv), head],
                                c.k_smem_tma.at[slot], c.k_bars.at[slot])
        plgpu.copy_gmem_to_smem(c.bias_ref.at[pl.ds(j * bkv, bkv)],
                                c.b_smem.at[slot], c.k_bars.at[slot])

    def issue_v(unit, slot):
        head, j = _head_block(p, unit)
        plgpu.copy_gmem_to_smem(c.vt_ref.at[pl.ds(j * bkv, bkv), head],
                                c.v_raw.at[slot], c.v_raw_bars.at[slot])

    for i in range(stages):
        @pl.when(i < c.n_steps)
        def _(i=i):
            issue_k(c.u0 + i, i)
            issue_v(c.u0 + i, i)

    fill_ones(c.ones_plain)  # the ones operand of the row-sum wgmma, written once

    @pl.loop(0, c.n_steps)
    def _(i):
        # K of step i - 1 + stages once both warpgroups' Q.K of step i - 1 is done; first,
        # so that a K load never waits behind a transpose.
        @pl.when(jnp.logical_and(i >= 1, i - 1 + stages < c.n_steps))
        def _():
            ps = lax.rem(i - 1, stages)
            plgpu.barrier_wait(c.k_done.at[ps])
            issue_k(c.u0 + i - 1 + stages, ps)

        slot = lax.rem(i, stages)
        plgpu.barrier_wait(c.v_raw_bars.at[slot])

        @pl.when(i >= stages)
        def _():  # the P.V of step i - stages has finished reading V^T[slot]
            plgpu.barrier_wait(c.v_done.at[slot])

        with jax.named_scope("v_transpose"):
            transpose_v_block(c.v_raw.at[slot], c.vt_plain.at[slot])
        plgpu.commit_smem()  # generic-proxy stores -> visible to the wgmma
        plgpu.barrier_arrive(c.v_bars.at[slot])

        @pl.when(i + stages < c.n_steps)
        def _():
            issue_v(c.u0 + i + stages, slot)


def fp8_attention_call(q8, k8, v8, scales, bias, block_masked, *, block_kv, stages,
                       num_ctas, out_dtype, layer=None):
    """The Pallas kernel (module docstring). q8: Q's two e4m3 parts [Tq, H, D]; k8, v8
    [S, H, D] e4m3 as the cache stores them (V transposed in the kernel); scales
    [H, 2, Tq'] f32; bias [S'] f32; block_masked [nb] int32 -> [Tq', H, D] out_dtype
    (Tq' = ``padded_queries``; rows past Tq are padding).

    layer: None, or a [1] int32 array; then k8 and v8 are the whole cache stacks
    [L, S, H, D] and the kernel reads layer ``layer`` (clamped to [0, L)) in place: it
    indexes the GMEM refs with it before the TMA copies, so XLA never copies the layer's
    K/V out of the stack.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental import mosaic as _mosaic  # noqa: F401
    import jax.experimental.mosaic.gpu as mgpu  # noqa: F401

    q8 = tuple(q8)
    if len(q8) != 2:
        raise ValueError(f"the kernel takes Q as its two e4m3 parts, got {len(q8)}")
    tq, h, d = q8[0].shape
    stacked = layer is not None
    p = plan_call(tq, h, d, k8.shape[-3], k8.shape[0] if stacked else None,
                  block_kv=block_kv, stages=stages, num_ctas=num_ctas, out_dtype=out_dtype)

    def entry(*refs):
        q_refs, (k_ref, vt_ref, sc_ref, bias_ref) = refs[:2], refs[2:6]
        rest = refs[6:]
        layer_ref, rest = (rest[0], rest[1:]) if stacked else (None, rest)
        mask_ref, out_ref, part_ref, lse_ref = rest
        named = dict(q_refs=q_refs, k_ref=k_ref, vt_ref=vt_ref, sc_ref=sc_ref, bias_ref=bias_ref,
                     out_ref=out_ref, part_ref=part_ref, lse_ref=lse_ref, layer_ref=layer_ref,
                     mask_ref=mask_ref)
        smem, bars = _shared_memory(p)
        n_smem = len(smem)

        def body(*scoped):
            c = _cta(p, named, scoped[:n_smem], scoped[n_smem:])
            pl.when(c.wg < COMPUTE_WGS)(lambda: _compute_warpgroup(p, c))
            pl.when(c.wg == COMPUTE_WGS)(lambda: _memory_warpgroup(p, c))

        pl.run_scoped(body, *smem, *bars, collective_axes="wg")

    out, _, _ = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((p.tq_pad, h, d), out_dtype),
                  jax.ShapeDtypeStruct((p.n_part_slots, COMPUTE_WGS, BLOCK_Q, d), out_dtype),
                  jax.ShapeDtypeStruct((p.n_part_slots, COMPUTE_WGS, BLOCK_Q, 8), jnp.float32)),
        grid=(p.num_ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*q8, k8, v8, scales, bias, *((layer,) if stacked else ()), block_masked)
    return out
