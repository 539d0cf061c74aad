"""Stream-K schedule of the stacked FP8 GEMM (Pallas Mosaic GPU, one device).

A data-parallel GEMM gives each of the persistent grid's blocks whole output tiles, so
the last wave decides the time: at M = 757 the characters-57b projections have 216-378
tiles of 128 x 256 for 132 SMs (1.64-2.86 waves), and a block computes 2 or 3 tiles where
1.64 or 2.45 would do. Stream-K cuts the work finer, along N and K, in teams.

A team is m_iters blocks, one per M tile (block c: team g = c // m_iters, M tile
mi = c % m_iters); the members run the same schedule on their own rows, so they read the
same weight tile at about the same time and it comes from HBM once (single tiles dealt
out to neighbours read different K offsets of ~54 weight slabs at once, more than L2
holds). A team's work unit is one K step of one weight slab (cta_n columns); the
``n_iters * k_iters`` units are dealt out in order, team g taking the contiguous range
[g * U // G, (g + 1) * U // G) of the U units (G teams). Slab t's units are t * k_iters
... t * k_iters + k_iters - 1, so a range is: the end of one slab (its first segment),
whole slabs, the start of another (its last segment). One software pipeline runs
through the whole range (the memory warpgroup's TMA copies do not stop at tile
boundaries). With G <= n_iters every range holds at least k_iters units, so a tile is
cut at most once, between the blocks of neighbouring teams that own the same M tile
(c and c + m_iters):

  - the other block holds the rest of the tile as its first segment: it scales its piece
    and stores it as bf16 (no addend), early in its run, then signals a semaphore;
  - the block that holds the tile's first K step ("owner", its last segment) waits for
    the signal (no wait in practice) and stores its own piece, with the addend, by TMA
    reduce-add (``cp.reduce.async.bulk .add``) onto it. The cut tiles round twice,
    bf16(bf16(a) + bf16(b)). The interpreter has no TMA reduction: there the owner reads
    the piece and adds it.

Shapes and dtypes:
  x      [Mx, K]    float8_e4m3fn, Mx a multiple of 8 (the last M tile is TMA-bounded)
  w      [L, N, K]  float8_e4m3fn (K-major), read in place at ``layer`` ([1] int32)
  scale  [1] or [L] float32 (x scale * w scale, or w's with row scales; read once as a
                    scalar, the layer's of a stack: no shared memory, which leaves room for
                    4 stages of 128 x 256 tiles)
  row_scale None or [R] float32, R <= Mx: per-row scales of x, applied with
                    ``scale`` in the epilogue (each block's 128 rows, 512 bytes, copied
                    once to shared memory: a block only ever works on one M tile); rows
                    from R on are out of the copy's bounds and scaled by 0
  addend None or [Mx, N] out_dtype
  lead   None or a ``Product`` (x [Mx, K1], w [L, N, K1], scale, row_scale as above): a
         second product summed in the same accumulator, its K steps first (below)
  out    [Mx, N]    out_dtype

A leading product (``lead``): out = lead.x @ lead.w[layer].T * (lead's scales) + x @
w[layer].T * (scales) (+ addend), in one K loop over K1 + K steps (the attention-out and
MLP-down projections of a block, which are summed before their all-reduce: one kernel, no
bf16 [Mx, N] written by the first and read back as the second's addend). The memory
warpgroup reads step kk from lead's operands below K1 / tile_k and from x, w past it. The
two products have their own scales, so the accumulator is kept in the second's units:
where a segment's K steps cross from lead's to x's (or end inside lead's), the compute
warpgroups multiply it by lead's scale over x's, per row with row scales
(lead.row_scale[m] * lead.scale / (row_scale[m] * scale); 0 on rows whose scale is 0, the
padding rows), and the epilogue applies x's scales as without a lead. The cut tiles'
pieces are then in the same units as their owners'.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.gemm_common import COMPUTE_WGS, pad_row_scales, smem_transforms
from pallas_kernels.mgpu_sync import fence_proxy_async_global

FP8 = jnp.float8_e4m3fn
KERNEL_NAME = "fp8_gemm_stream_k"


class Product(NamedTuple):
    """One FP8 product's operands (the ``lead`` of ``kernel``): x [Mx, K] e4m3, w [L, N, K]
    e4m3 (read at the kernel's layer), scale [1] or [L] float32, row_scale None or [R]
    float32 (R <= Mx)."""

    x: jax.Array
    w: jax.Array
    scale: jax.Array
    row_scale: jax.Array | None = None


# The ratio of two rows' scales is 0 where the divisor is below this (the zero scales of
# padding rows; a real row's scale is at least fp8_linear.AMAX_FLOOR / 448 times w's).
RATIO_FLOOR = float(np.finfo(np.float32).tiny)


def scoped(name: str, fn):
    """fn run inside jax.named_scope(name) (a profiler range in the kernel)."""
    def run():
        with jax.named_scope(name):
            fn()
    return run


def num_teams(m_iters: int, n_iters: int, num_sms: int) -> int:
    """Teams of m_iters blocks: as many as the SMs hold, never more than the weight's
    slabs (so that every team's range holds a slab's K steps and a tile is cut at most
    once). One team when M has more tiles than there are SMs."""
    return max(1, min(n_iters, num_sms // m_iters))


def teams_for(m: int, n: int, config, num_sms: int) -> int:
    """``num_teams`` for an [m, K] x [n, K] product with ``config``'s tiles (m rows, as the
    kernel takes them: a multiple of 8)."""
    return num_teams(-(-m // config.tile_m), n // (COMPUTE_WGS * config.tile_n), num_sms)


def team_range(team, units: int, teams: int, div=operator.floordiv):
    """[u0, u1): the work units of ``team`` (ints, or traced int32 with div=lax.div)."""
    return div(team * units, teams), div((team + 1) * units, teams)


def segment(u0, u1, t, k_iters: int, maximum=max, minimum=min):
    """[kb, ke): the K steps of slab t that the range [u0, u1) holds (kb < ke when it holds
    any). kb > 0: the later piece of a cut slab (the team's first segment); kb == 0 and
    ke < k_iters: the owner's cut slab (the team's last segment), finished onto the next
    team's piece."""
    return maximum(u0 - t * k_iters, 0), minimum(u1 - t * k_iters, k_iters)


def plan(slabs: int, k_iters: int, teams: int) -> list[list[tuple[int, int, int]]]:
    """Per team, its segments (slab, kb, ke) in order, from the functions the kernel runs
    (every block of the team runs them on its M tile; for tests)."""
    units = slabs * k_iters
    out = []
    for c in range(teams):
        u0, u1 = team_range(c, units, teams)
        segs = []
        for t in range(u0 // k_iters, (u1 - 1) // k_iters + 1):
            kb, ke = segment(u0, u1, t, k_iters)
            segs.append((t, kb, ke))
        out.append(segs)
    return out


def has_partials(slabs: int, k_iters: int, teams: int) -> bool:
    """Whether any team boundary cuts a slab."""
    r = (np.arange(teams + 1, dtype=np.int64) * slabs * k_iters) // teams
    return bool(np.any(r % k_iters))


def kernel(x, w, scale, addend, layer, *, out_dtype, config, teams: int,
           interpret: bool = False, row_scale=None, lead: Product | None = None):
    """Launches the stream-K kernel: ``teams`` (``num_teams``) x m_iters blocks; returns
    [Mx, N].

    config: the tiling (``gemm_common.Config``: tile_m, tile_n per compute
    warpgroup, tile_k, stages, epi_m, epi_n; the grid order does not apply).
    interpret: the Mosaic GPU interpreter (CPU). It has no semaphores and runs the blocks
    one after another: there the last block runs first and the semaphore operations are
    left out, so every piece is written before its owner adds onto it (the fences and
    semaphores themselves are checked on the GPU only).
    lead: None or a ``Product`` summed into the same accumulator, its K steps first (module
    docstring); it has row scales exactly when x has.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c = config
    mx, k = x.shape
    n = w.shape[-2]
    cta_n = COMPUTE_WGS * c.tile_n
    if mx % 8 or n % cta_n or k % c.tile_k:
        raise ValueError(f"shape M={mx} N={n} K={k} does not fit tiles {c}")
    if c.tile_n % c.epi_n or c.tile_m % c.epi_m:
        raise ValueError(f"epilogue sub-tiles do not divide the tile: {c}")
    has_lead = lead is not None
    lead_k = lead.x.shape[1] if has_lead else 0
    if has_lead:
        if lead.x.shape[0] != mx or lead.w.shape != (w.shape[0], n, lead_k):
            raise ValueError(f"lead product x {lead.x.shape}, w {lead.w.shape} does not match "
                             f"[{mx}, K1] and [{w.shape[0]}, {n}, K1]")
        if lead_k % c.tile_k or not lead_k:
            raise ValueError(f"lead K={lead_k} is not a positive multiple of {c.tile_k}")
        if (lead.row_scale is None) != (row_scale is None):
            raise ValueError("lead has row scales exactly when x has")
    lead_iters = lead_k // c.tile_k  # the K steps read from lead's operands (they come first)
    m_iters, n_iters, k_iters = -(-mx // c.tile_m), n // cta_n, lead_iters + k // c.tile_k
    units = n_iters * k_iters
    if not 1 <= teams <= n_iters:
        raise ValueError(f"stream-K needs 1 <= teams <= N tiles ({n_iters}), got {teams}")
    ctas = teams * m_iters
    partials = has_partials(n_iters, k_iters, teams)
    stages = c.stages
    num_layers = w.shape[0]
    has_addend = addend is not None
    has_rows = row_scale is not None
    if has_rows:
        row_scale = pad_row_scales(row_scale, mx, c.tile_m)
        if has_lead:
            lead = lead._replace(row_scale=pad_row_scales(lead.row_scale, mx, c.tile_m))
    in_tf, out_tf = smem_transforms(c, out_dtype)
    epi = [(em, en) for em in range(c.tile_m // c.epi_m) for en in range(c.tile_n // c.epi_n)]

    def body(x_ref, w_ref, scale_ref, layer_ref, *refs):
        refs = list(refs)
        rows_ref = refs.pop(0) if has_rows else None
        addend_ref = refs.pop(0) if has_addend else None
        lx_ref, lw_ref, lscale_ref = (refs.pop(0) for _ in range(3)) if has_lead else [None] * 3
        lrows_ref = refs.pop(0) if has_lead and has_rows else None
        out_ref, (x_smem, w_smem), out_smem, (full, empty, misc), *row_bufs = refs
        rows_smem, rows_bar, lrows_smem = (row_bufs + [None])[:3] if has_rows else [None] * 3
        layer_idx = jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)
        w_l = w_ref.at[layer_idx]
        lw_l = lw_ref.at[layer_idx] if has_lead else None
        wg = lax.axis_index("wg")
        cta = lax.axis_index("ctas")
        if interpret:  # blocks run in turn: the owners (lower numbers) after the pieces
            cta = ctas - 1 - cta
        team = lax.div(cta, m_iters)
        mi = cta - team * m_iters
        u0, u1 = team_range(team, units, teams, lax.div)
        n_steps = u1 - u0
        t_first, t_last = lax.div(u0, k_iters), lax.div(u1 - 1, k_iters)
        sems = (pl.get_global(plgpu.SemaphoreType.REGULAR((ctas * COMPUTE_WGS,)))
                if partials and not interpret else None)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(i, slot):
                ni = lax.div(u0 + i, k_iters)
                kk = u0 + i - ni * k_iters

                def copy(xr, wr, step):
                    ks = pl.ds(step * c.tile_k, c.tile_k)
                    plgpu.copy_gmem_to_smem(xr.at[pl.ds(mi * c.tile_m, c.tile_m), ks],
                                            x_smem.at[slot], full.at[slot])
                    plgpu.copy_gmem_to_smem(wr.at[pl.ds(ni * cta_n, cta_n), ks],
                                            w_smem.at[slot], full.at[slot])

                if not has_lead:
                    copy(x_ref, w_l, kk)
                    return
                pl.when(kk < lead_iters)(lambda: copy(lx_ref, lw_l, kk))
                pl.when(kk >= lead_iters)(lambda: copy(x_ref, w_l, kk - lead_iters))

            if has_rows:  # this block's rows' scales (and lead's), once
                tile_rows = pl.ds(mi * c.tile_m, c.tile_m)
                plgpu.copy_gmem_to_smem(rows_ref.at[tile_rows], rows_smem, rows_bar)
                if has_lead:
                    plgpu.copy_gmem_to_smem(lrows_ref.at[tile_rows], lrows_smem, rows_bar)
            for i in range(stages):
                pl.when(i < n_steps)(lambda i=i: issue(i, i))

            @pl.loop(0, jnp.maximum(n_steps - stages, 0))
            def _refill(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(empty.at[slot])
                issue(i + stages, slot)

            # The last stages' releases: observed, so that every barrier phase is (the
            # interpreter checks this; on the GPU it only delays this warpgroup's exit).
            @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
            def _drain(i):
                plgpu.barrier_wait(empty.at[lax.rem(i, stages)])

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            # One scale, or the layer's of a per-layer stack (no XLA slice per call).
            scale = scale_ref[0] if scale_ref.shape[0] == 1 else scale_ref[layer_idx]
            if has_rows:
                plgpu.barrier_wait(rows_bar)

            # A block whose first segment is a cut tile's later piece signals it after the
            # next segment's first K step (its TMA stores have long completed by then).
            first_partial = u0 - t_first * k_iters > 0
            signal_step = (t_first + 1) * k_iters - u0
            defer_signal = jnp.logical_and(first_partial, signal_step < n_steps)

            def signal_partial():
                plgpu.wait_smem_to_gmem(0)  # written, not only read
                if interpret:
                    return
                fence_proxy_async_global()
                plgpu.semaphore_signal(sems.at[cta * COMPUTE_WGS + wg], 1, memory_scope="gpu")

            def lead_ratio():
                """lead's scales over x's: [tile_m, tile_n] (per row), or a scalar."""
                lscale = lscale_ref[0] if lscale_ref.shape[0] == 1 else lscale_ref[layer_idx]
                if not has_rows:
                    return lscale / jnp.maximum(scale, RATIO_FLOOR)
                den = rows_smem[...] * scale
                r = jnp.where(den >= RATIO_FLOOR, lrows_smem[...] * lscale / jnp.maximum(
                    den, RATIO_FLOOR), 0.0)
                return lax.broadcast_in_dim(r, (c.tile_m, c.tile_n), (0,))

            def mainloop(t, kb, ke):
                """The K steps [kb, ke) of slab t: the accumulator [tile_m, tile_n] float32,
                in x's units (lead's steps rescaled, module docstring)."""
                if not has_lead:
                    return pl.run_scoped(lambda acc_ref: steps(acc_ref, t, kb, ke),
                                         plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                km = jnp.minimum(jnp.maximum(kb, lead_iters), ke)  # where x's steps begin
                acc = pl.run_scoped(lambda acc_ref: steps(acc_ref, t, kb, km),
                                    plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                if interpret:  # no run_state there: x's steps on their own, then the sum
                    return acc * lead_ratio() + pl.run_scoped(
                        lambda acc_ref: steps(acc_ref, t, km, ke),
                        plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                # One accumulator (a second would not fit in the registers): x's steps go on
                # from lead's, rescaled.
                return pl.run_state(lambda acc_ref: steps(acc_ref, t, km, ke, read=False))(
                    plgpu.ACC.init(acc * lead_ratio()))

            def steps(acc_ref, t, kb, ke, read=True):
                """The wgmmas of K steps [kb, ke) of slab t onto acc_ref (then its value)."""
                @pl.loop(kb, ke)
                def _step(kk):
                    i = t * k_iters + kk - u0
                    slot = lax.rem(i, stages)
                    plgpu.barrier_wait(full.at[slot])
                    w_half = w_smem.at[slot].at[pl.ds(wg * c.tile_n, c.tile_n)]
                    plgpu.wgmma(acc_ref, x_smem.at[slot], w_half.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[slot])
                    if partials:
                        pl.when(jnp.logical_and(defer_signal, i == signal_step))(
                            signal_partial)
                return acc_ref[...] if read else None

            def store_tile(acc, ni, with_addend=True, add=False):
                """Scales the tile (plus the addend unless with_addend=False) and stores
                it; add: TMA reduce-add onto what the output holds (the neighbour's piece;
                the interpreter reads it and adds)."""
                m_sl = pl.ds(mi * c.tile_m, c.tile_m)
                n_sl = pl.ds(ni * cta_n + wg * c.tile_n, c.tile_n)
                for e, (em, en) in enumerate(epi):
                    rows = slice(em * c.epi_m, (em + 1) * c.epi_m)
                    cols = slice(en * c.epi_n, (en + 1) * c.epi_n)
                    dst = out_ref.at[m_sl, n_sl].at[rows, cols]
                    slot = e % 2
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    y = acc[rows, cols]
                    y = y * scale
                    if has_rows:
                        rs = rows_smem[pl.ds(em * c.epi_m, c.epi_m)]
                        y = y * lax.broadcast_in_dim(rs, y.shape, (0,))
                    if has_addend and with_addend:
                        plgpu.copy_gmem_to_smem(addend_ref.at[m_sl, n_sl].at[rows, cols],
                                                out_smem.at[wg, slot], misc.at[wg])
                        plgpu.barrier_wait(misc.at[wg])
                        y = y + out_smem[wg, slot].astype(jnp.float32)
                    if add and interpret:  # bf16(old + bf16(y)), as the TMA unit adds
                        plgpu.copy_gmem_to_smem(dst, out_smem.at[wg, slot], misc.at[wg])
                        plgpu.barrier_wait(misc.at[wg])
                        y = (y.astype(out_dtype).astype(jnp.float32)
                             + out_smem[wg, slot].astype(jnp.float32))
                    out_smem[wg, slot] = y.astype(out_dtype)
                    plgpu.commit_smem()
                    red = {"reduction_op": "add"} if add and not interpret else {}
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst, **red)

            def store_first_piece(acc, t):
                # The cut tile's later K steps, scaled and stored as bf16 (the owner adds
                # its piece and the addend onto it), then signalled.
                store_tile(acc, t, with_addend=False)
                pl.when(jnp.logical_not(defer_signal))(signal_partial)

            def add_onto_first_piece(acc, t):
                # No shared memory changes hands, so no barrier between the warpgroups:
                # each waits for its neighbour's stored piece and adds its own.
                with jax.named_scope("merge_wait"):
                    if not interpret:
                        src = cta + m_iters  # the next team's block on the same M tile
                        plgpu.semaphore_wait(sems.at[src * COMPUTE_WGS + wg], 1,
                                             decrement=False, memory_scope="gpu")
                        fence_proxy_async_global()
                with jax.named_scope("merge_store"):
                    store_tile(acc, t, add=True)

            @pl.loop(t_first, t_last + 1)
            def _segment(t):
                kb, ke = segment(u0, u1, t, k_iters, jnp.maximum, jnp.minimum)
                with jax.named_scope("mainloop"):
                    acc = mainloop(t, kb, ke)
                if not partials:
                    with jax.named_scope("store"):
                        store_tile(acc, t)
                    return
                pl.when(kb > 0)(scoped("partial", lambda: store_first_piece(acc, t)))
                pl.when(jnp.logical_and(kb == 0, ke == k_iters))(
                    scoped("store", lambda: store_tile(acc, t)))
                pl.when(jnp.logical_and(kb == 0, ke < k_iters))(
                    lambda: add_onto_first_piece(acc, t))

            with jax.named_scope("drain"):
                plgpu.wait_smem_to_gmem(0)

    x_st = plgpu.SMEM((stages, c.tile_m, c.tile_k), FP8, transforms=in_tf)
    w_st = plgpu.SMEM((stages, cta_n, c.tile_k), FP8, transforms=in_tf)
    out_st = plgpu.SMEM((COMPUTE_WGS, 2, c.epi_m, c.epi_n), out_dtype, transforms=out_tf)
    bars = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # full: x and w landed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # empty
            plgpu.Barrier(num_barriers=COMPUTE_WGS))  # the addend's sub-tile per wg

    # The row scales of the block's M tile and their arrival.
    # (lead's, with a lead: both copies on the one barrier).
    row_bufs = ((plgpu.SMEM((c.tile_m,), jnp.float32), plgpu.Barrier(num_arrivals=1 + has_lead))
                + ((plgpu.SMEM((c.tile_m,), jnp.float32),) if has_lead else ())
                if has_rows else ())

    def entry(*refs):
        n_in = 4 + has_addend + has_rows + (3 + has_rows if has_lead else 0)
        ins, outs = refs[:n_in], refs[n_in:]
        pl.run_scoped(lambda *scoped: body(*ins, *outs, *scoped),
                      (x_st, w_st), out_st,
                      bars, *row_bufs,
                      collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((mx, n), out_dtype),
        grid=(ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )(x, w, scale, layer, *((row_scale,) if has_rows else ()), *((addend,) if has_addend else ()),
      *((lead.x, lead.w, lead.scale) + ((lead.row_scale,) if has_rows else ())
        if has_lead else ()))
