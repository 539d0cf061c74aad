"""Fused row-parallel FP8 GEMM + all-reduce (Pallas Mosaic GPU), its reference and fallback.

One process drives all the GPUs of the tensor-parallel mesh axis; the kernel runs
inside ``jax.shard_map``.  On each device a persistent grid (one block per SM)
computes the output tiles of the partial product

    P_d = (x_fp8 @ w_fp8.T) * scale (+ addend)          [M, N]

with wgmma on FP8 operands (both K-major: the weight is read as stored, (N, K)).
As soon as a tile's epilogue has written it to shared memory, the tile is copied
by the TMA engine to the device's own output and to a receive slot on every
peer (``plgpu.remote_ref``), and the warpgroups go on with their next tile while
the copies travel over NVLink.  When a block has finished its tiles and its
copies have landed, it signals each peer's semaphore; the kernel ends once every
block of every peer has signalled.  The sum of the own partial and the tp - 1
received ones is one fused elementwise pass after the kernel.  M is padded to the tile.

The exchange is point-to-point remote stores only (no NVLS), so any number of devices
works (2, 3, 4, ...).  Each device sends (tp - 1) * M * N elements: the same as a ring
all-reduce for tp = 2, more for larger tp.

Synchronization (the model calls the kernel 240 times a step, back to back in a scan):
  - Semaphores come from ``pl.get_global``.  In jax 0.11.2 they live in a GMEM scratch
    operand that the lowering zero-fills right at each call (a broadcast of 0 aliased
    into the custom call; XLA keeps a fresh zero per call, also inside loops, where a
    constant aliased into an in-place call gets a copy).  So every call starts at zero
    and the waits need not decrement (``tests/test_fp8_gemm_allreduce.py`` checks the
    lowered program for this).
  - done: each compute warpgroup of every block, once its copies have completed, signals
    every peer once; block 0 of each device waits for the 2 * num_sms * (tp - 1) signals
    of its peers, so when the kernel ends every tile sent to this device has landed.
  - entry: nothing may be written into a peer, nor signalled to it, before that peer's
    call has begun.  Until then its receive buffer is memory XLA may still use for other
    values of the preceding ops (or, for the previous call, the buffer the sum pass is
    still reading), and its zero-fill of the semaphores has not run, so an early signal
    would be erased (a hang).  The kernel does not rely on the runtime to line the
    devices up before the launch: block 0's first warpgroup signals each peer at the
    start (phase 1); every compute warpgroup, before its first remote store (after its
    first tile's main loop, so normally at no cost) and before its done signals, waits
    until every peer has signalled; block 0's first warpgroup, when it sees a peer,
    signals it again (phase 2).  A phase-1 signal can be erased by a peer that had not
    yet begun, but that peer's own phase 1 then reaches this device, which answers with
    phase 2 after seeing it, i.e. after the peer's zero-fill: every device passes, and
    every later signal (phase 2, done) comes from a device that has seen its target
    inside the call.  One semaphore per peer distance (slot j on a device counts the
    device j places behind it).

Shapes and dtypes (per device):
  x_fp8  [M, K]  float8_e4m3fn       (M is padded to the tile height internally)
  w_fp8  [N, K]  float8_e4m3fn       (K-major, as stored by ``Fp8Weight``), or a stack
         [L, N, K] read in place at block ``layer`` ([] int32, may be traced)
  scale  []      float32             (x scale * w scale, per tensor)
  addend [M, N]  out_dtype, optional (a partial computed elsewhere, reduced with it)
  out    [M, N]  out_dtype, the sum over devices, on every device
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import device
from pallas_kernels.gemm_common import Config, fits, pad_row_scales, smem_transforms  # noqa: F401  (fits: this kernel's tiling check, asked by callers)
from pallas_kernels.numerics import quantize_activation

FP8 = jnp.float8_e4m3fn
# Kernel names as profiler traces show them (``characters_jax.measure.profile`` classifies
# by them): the fused GEMM + all-reduce, and the same kernel on one device (a plain GEMM).
KERNEL_NAME = "fp8_gemm_allreduce"
GEMM_KERNEL_NAME = "fp8_gemm"


DEFAULT_CONFIG = Config()


class PeerSync:
    """The entry handshake and the done count of a kernel on ``tp`` devices that stores into
    its peers' memory (module docstring, "Synchronization").

    Build it inside the kernel body: it takes the semaphores (``pl.get_global``, zeroed by
    the lowering at every call) and this device's index on ``axis_name``.
      entry: the leader signals every peer at the start (``start``, phase 1); every writer
        calls ``enter`` before its first remote store and before its done signals: it
        returns once every peer has signalled; the leader then signals each peer it has
        seen again (phase 2), which no zero-fill can erase. Slot j counts the device j
        places behind.
      done: each writer, once its copies have completed, signals every peer once
        (``finish``); the leader waits for all the peers' signals, so when the kernel ends
        every tile sent to this device has landed.
    """

    def __init__(self, axis_name: str, tp: int):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.tp = tp
        self.dev = lax.axis_index(axis_name)
        self.done = pl.get_global(plgpu.SemaphoreType.REGULAR)
        # entry[j]: signals from the device j places behind (slot 0 unused)
        self.entry = [None] + [pl.get_global(plgpu.SemaphoreType.REGULAR)
                               for _ in range(1, tp)]

    def peer(self, j):
        """The device j places ahead (traced int32)."""
        return lax.rem(self.dev + j, self.tp)

    def start(self, leader):
        """Phase 1: the leader signals every peer's entry slot."""
        from jax.experimental import pallas as pl

        @pl.when(leader)
        def _phase1():
            for j in range(1, self.tp):
                pl.semaphore_signal(self.entry[j], 1, device_id=self.peer(j))

    def enter(self, is_leader):
        """Returns once every peer has entered this call; ``is_leader`` (traced bool, or None
        where the caller is never the leader) then sends phase 2 to each peer."""
        from jax.experimental import pallas as pl

        tp = self.tp
        for j in range(1, tp):
            pl.semaphore_wait(self.entry[j], 1, decrement=False)
            if is_leader is not None:
                @pl.when(is_leader)
                def _phase2(j=j):
                    pl.semaphore_signal(self.entry[tp - j], 1,
                                        device_id=lax.rem(self.dev - j + tp, tp))

    def finish(self, is_writer, leader, writers_per_device: int):
        """After this warpgroup's copies have completed: each writer (traced bool) enters
        (a writer without tiles has not checked yet) and signals every peer's done count;
        the leader waits for ``writers_per_device`` signals from each peer."""
        from jax.experimental import pallas as pl

        @pl.when(is_writer)
        def _signal():
            self.enter(None)
            for j in range(1, self.tp):
                pl.semaphore_signal(self.done, 1, device_id=self.peer(j))

        @pl.when(leader)
        def _wait():
            pl.semaphore_wait(self.done, value=writers_per_device * (self.tp - 1),
                              decrement=False)


def reference(x_fp8, w_fp8, scale, addend=None, *, axis_name="tp", out_dtype=jnp.bfloat16):
    """Plain-jnp/XLA reference: the FP8 dot, the scale, the addend, then ``lax.psum``."""
    y = _reference_partial(x_fp8, w_fp8, scale, None, False, None)
    if addend is not None:
        y = y + addend.astype(jnp.float32)
    return lax.psum(y.astype(out_dtype), axis_name)


def is_supported() -> bool:
    """The fused kernel needs NVIDIA Hopper (wgmma, TMA): sm_90."""
    return device.is_hopper()


def _kernel(x, w, scale, addend, *, axis_name, tp, out_dtype, config: Config,
            layer=None, num_sms=None, row_scale=None):
    """Launches the Mosaic GPU kernel: returns (own partial [Mx, N], received
    [tp - 1, Mx, N] or None at tp = 1).

    Operands (per device): x [Mx, K] e4m3 (M rounded up to the tile by the caller); w
    [N, K] e4m3, or a stack [L, N, K] with ``layer``; scale [1] f32 (the combined scale,
    broadcast), or [L] with a stack (each layer's, read at ``layer``); addend None or
    [Mx, N] out_dtype.

      layer: None, or a [1] int32 array; then ``w`` is a stack [L, N, K] and the kernel
        reads ``w[layer]`` (clamped to [0, L)) in place: the GMEM ref is indexed with
        the scalar before the TMA copies, so XLA never materializes the [N, K] slice.
      num_sms: the persistent grid size (default: the device's SM count).
      row_scale: None, or [R] float32 (1 <= R <= Mx; rows from R on scale by 0): x's
        per-row scales; each tile's epilogue multiplies its row m by row_scale[m] (with the
        scalar ``scale``). A compute warpgroup copies its tile's tile_m scales to shared
        memory by TMA before the main loop (bounded: rows from R on read as 0).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    stacked = layer is not None
    n = w.shape[-2]
    c = config
    cta_n = 2 * c.tile_n
    if (m % c.tile_m and tp > 1) or n % cta_n or k % c.tile_k:
        raise ValueError(f"shape M={m} N={n} K={k} does not fit tiles {c}")
    has_rows = row_scale is not None
    if has_rows:
        row_scale = pad_row_scales(row_scale, x.shape[0], c.tile_m)
    if scale.shape not in ((1,),) + (((w.shape[0],),) if stacked else ()):
        raise ValueError(f"scale must be [1]{' or [L]' if stacked else ''}, got {scale.shape}")
    if addend is not None and (addend.shape != (x.shape[0], n)
                             or jnp.dtype(addend.dtype) != jnp.dtype(out_dtype)):
        raise ValueError(f"addend must be [{x.shape[0]}, {n}] {jnp.dtype(out_dtype).name}, got "
                         f"{addend.shape} {addend.dtype}")
    m_iters, n_iters, k_iters = -(-m // c.tile_m), n // cta_n, k // c.tile_k
    if num_sms is None:
        num_sms = device.sm_count()
    in_transforms, out_transforms = smem_transforms(c, out_dtype)
    has_addend = addend is not None
    epi_per_wg = (c.tile_m // c.epi_m) * (c.tile_n // c.epi_n)

    def body(x_ref, w_ref, scale_ref, *refs):
        refs = list(refs)
        if stacked:
            layer_ref, *refs = refs
            # Clamped like lax.dynamic_slice; a [N, K] view of the stack: no copy.
            layer_idx = jnp.minimum(jnp.maximum(layer_ref[0], 0), w.shape[0] - 1)
            w_ref = w_ref.at[layer_idx]
        rows_ref = refs.pop(0) if has_rows else None
        if has_addend:
            addend_ref, *refs = refs
        out_ref, *recv = refs
        recv_ref = recv[0] if recv else None
        wg = lax.axis_index("wg")
        # Only a kernel that talks to peers may name the mesh axis: a mesh-axis
        # index marks the kernel as collective (and links NVSHMEM).
        sync = PeerSync(axis_name, tp) if tp > 1 else None
        dev = sync.dev if sync else None
        block = lax.axis_index("cluster_grid")
        leader = (wg == 0) & (block == 0)
        if sync:
            sync.start(leader)

        pipeline = functools.partial(
            plgpu.emit_pipeline_warp_specialized,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((c.tile_m, c.tile_k), lambda kk: (0, kk),
                                transforms=in_transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_n, c.tile_k), lambda kk: (0, kk),
                                transforms=in_transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=c.stages,
        )
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, compute_context=ignore).get_allocations(x_ref, w_ref),
            out_smem=plgpu.SMEM((2, 2, c.epi_m, c.epi_n), out_dtype, transforms=out_transforms),
            barriers=plgpu.Barrier(num_barriers=2),  # the addend's sub-tile per warpgroup
            # row_scale: each compute warpgroup's copy of its tile's rows' scales.
            **({"rows_smem": plgpu.SMEM((2, c.tile_m), jnp.float32),
                "rows_bar": plgpu.Barrier(num_barriers=2)} if has_rows else {}),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem, barriers, rows_smem=None, rows_bar=None):
            # The combined dequant scale, a scalar read once (a 16 KB shared-memory tile
            # would leave no room for a 4th stage of 128 x 256 tiles); with a stacked w it
            # may be the per-layer stack [L], read at the layer (no XLA slice per call).
            scale_val = scale_ref[0] if scale.shape[0] == 1 else scale_ref[layer_idx]

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(
                    lin, (m_iters, n_iters),
                    1 if c.grid_minor_n else 0, c.grid_tile_width)
                m_sl = pl.ds(mi * c.tile_m, c.tile_m)
                n_sl = pl.ds(ni * cta_n + wg * c.tile_n, c.tile_n)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                    def _acc(acc_ref):
                        if has_rows:  # lands while the main loop runs
                            plgpu.copy_gmem_to_smem(rows_ref.at[m_sl], rows_smem.at[wg],
                                                    rows_bar.at[wg])
                        eval_pipeline(acc_ref)
                        if has_rows:
                            plgpu.barrier_wait(rows_bar.at[wg])
                        acc = acc_ref[...]
                        if sync:
                            # The first remote store of this warpgroup waits for every peer
                            # to be inside this call (cheap: ~100 us of mainloop have passed).
                            @pl.when(info.local_index == 0)
                            def _first_tile():
                                sync.enter(leader)

                        for e in range(epi_per_wg):
                            em, en = divmod(e, c.tile_n // c.epi_n)
                            e_m = slice(em * c.epi_m, (em + 1) * c.epi_m)
                            e_n = slice(en * c.epi_n, (en + 1) * c.epi_n)
                            slot = e % 2
                            dst = (m_sl, n_sl)
                            # The slot's previous copies must have left shared memory.
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            y = acc[e_m, e_n] * scale_val
                            if has_rows:
                                rs = rows_smem[wg, pl.ds(em * c.epi_m, c.epi_m)]
                                y = y * lax.broadcast_in_dim(rs, y.shape, (0,))
                            if has_addend:
                                plgpu.copy_gmem_to_smem(
                                    addend_ref.at[dst].at[e_m, e_n], out_smem.at[wg, slot],
                                    barriers.at[wg])
                                plgpu.barrier_wait(barriers.at[wg])
                                y = y + out_smem[wg, slot].astype(jnp.float32)
                            out_smem[wg, slot] = y.astype(out_dtype)
                            plgpu.commit_smem()
                            src = out_smem.at[wg, slot]
                            plgpu.copy_smem_to_gmem(src, out_ref.at[dst].at[e_m, e_n],
                                                    commit_group=False)
                            for j in range(1, tp):
                                peer = lax.rem(dev + j, tp)
                                remote = plgpu.remote_ref(recv_ref.at[tp - 1 - j], peer)
                                plgpu.copy_smem_to_gmem(src, remote.at[dst].at[e_m, e_n],
                                                        commit_group=False)
                            plgpu.commit_smem_to_gmem_group()

                def mma(idxs, a_smem, b_smem, acc_ref):
                    b_wg = b_smem.at[pl.ds(wg * c.tile_n, c.tile_n)]
                    plgpu.wgmma(acc_ref, a_smem, b_wg.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline(mma, compute_context=compute_context)(
                    x_ref.at[m_sl, :],
                    w_ref.at[pl.ds(ni * cta_n, cta_n), :],
                    allocations=allocs,
                )

        # Every copy of this block has landed: tell each peer, then wait for all of theirs.
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        if sync:
            sync.finish(wg < 2, leader, writers_per_device=2 * num_sms)

    out_types = [jax.ShapeDtypeStruct((m, n), out_dtype)]
    if tp > 1:
        out_types.append(jax.ShapeDtypeStruct((tp - 1, m, n), out_dtype))
    operands = ((x, w, scale) + ((layer,) if stacked else ())
                + ((row_scale,) if has_rows else ())
                + ((addend,) if has_addend else ()))
    outs = plgpu.kernel(
        body,
        out_type=out_types,
        grid=(num_sms,),
        grid_names=("cluster_grid",),
        num_threads=3,
        thread_name="wg",
        cluster=(1,),
        cluster_names=("cluster",),
        kernel_name=KERNEL_NAME if tp > 1 else GEMM_KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*operands)
    return outs[0], (outs[1] if tp > 1 else None)


def _select_layer(w_fp8, layer):
    """w_fp8 [N, K], or [L, N, K] with layer [] int32: the [N, K] weight (an XLA slice)."""
    if layer is None:
        return w_fp8
    return lax.dynamic_index_in_dim(w_fp8, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def _kernel_scales(x, x_scale, w_fp8, w_scale, layer):
    """(x [M, K] e4m3, scale, rows, per_layer) as the kernels take them: x quantized per
    tensor when no x_scale is given; rows: per-row x's [R] float32 scales or None; scale:
    x's * w's, or with per-row x w's alone (a stack's [L] as it is: per_layer)."""
    per_layer = layer is not None and jnp.ndim(w_scale) == 1
    if jnp.ndim(w_scale) != 0 and not (per_layer and w_scale.shape == (w_fp8.shape[0],)):
        raise NotImplementedError("the fused kernel takes a per-tensor weight scale (or, for "
                                  "a stack, the stack's [L] of them)")
    if (layer is None) != (w_fp8.ndim == 2) or w_fp8.ndim not in (2, 3):
        raise ValueError(f"want w [N, K], or w [L, N, K] with a layer; got {w_fp8.shape}, "
                         f"layer={layer}")
    if x_scale is None:
        x, x_scale = quantize_activation(x)
    rows = None
    if jnp.ndim(x_scale) == 1:
        if not 1 <= x_scale.shape[0] <= x.shape[0]:
            raise ValueError(f"per-row x_scale must be [R], R <= M = {x.shape[0]}, got "
                             f"{x_scale.shape}")
        rows, x_scale = x_scale.astype(jnp.float32), None
    elif jnp.ndim(x_scale) != 0:
        raise ValueError(f"x_scale must be [] or [M], got shape {jnp.shape(x_scale)}")
    if per_layer and x_scale is not None:  # a per-tensor x: the product needs the layer's
        w_scale, per_layer = lax.dynamic_index_in_dim(w_scale, jnp.asarray(layer, jnp.int32),
                                                      0, keepdims=False), False
    scale = (w_scale if x_scale is None else x_scale * w_scale).astype(jnp.float32)
    return x, scale, rows, per_layer


def _reference_partial(x, w_fp8, scale, rows, per_layer, layer):
    """The scaled product on the reference path: [M, N] float32 (x's padding rows get 0)."""
    if per_layer:
        scale = _select_layer(scale, layer)
    if rows is not None:
        scale = jnp.pad(rows, (0, x.shape[0] - rows.shape[0]))[:, None] * scale
    return lax.dot_general(x, _select_layer(w_fp8, layer), (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32) * scale


def gemm_allreduce(x, w_fp8, w_scale, *, addend=None, layer=None, axis_name="tp",
                   out_dtype=jnp.bfloat16, x_scale=None, config: Config | None = None,
                   use_kernel: bool | None = None, num_sms: int | None = None):
    """All-reduced (over ``axis_name``) x @ w.T * scales (+ addend), inside shard_map.

    Args:
      x: [M, K] float activations (quantized here, per tensor, on the device), or
        FP8 activations whose scale is given as ``x_scale``: [] float32, or [R] float32
        per row (R <= M: rows from R on are zero padding), each device's own: every
        device scales its partial by its rows' scales before the sum.
      w_fp8: [N, K] float8_e4m3fn weight shard, or a stack [L, N, K] of them with
        ``layer`` ([] int32, may be traced; clamped like ``lax.dynamic_slice``): the kernel
        then reads block ``layer`` of the stack in place (no [N, K] copy).
      w_scale: [] float32, the scale of the (selected) weight; or, with ``layer``, the
        stack's [L] (the kernels read the layer's: no XLA slice; with per-tensor x the
        product needs the layer's scale, sliced here).
      addend: optional [M, N] partial of this device, reduced together with the product
        (cast to out_dtype; the kernel adds it in f32 in its epilogue).
      config: the kernel's tiling (default ``DEFAULT_CONFIG``).
      use_kernel: None picks the Pallas kernel where supported, else the XLA reference.
      num_sms: the kernel's persistent grid (default: every SM).
    Returns:
      [M, N] out_dtype, the same on every device.
    """
    config = config or DEFAULT_CONFIG
    x, scale, rows, per_layer = _kernel_scales(x, x_scale, w_fp8, w_scale, layer)
    if use_kernel is None:
        use_kernel = is_supported()
    if not use_kernel:
        y = _reference_partial(x, w_fp8, scale, rows, per_layer, layer)
        if addend is not None:
            y = y + addend.astype(jnp.float32)
        return lax.psum(y.astype(out_dtype), axis_name)
    tp = lax.axis_size(axis_name)
    m = x.shape[0]
    scale1 = scale if per_layer else jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))
    layer_arr = None if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    x, addend = _pad_rows(x, addend, config.tile_m, out_dtype)
    own, received = _kernel(x, w_fp8, scale1, addend, axis_name=axis_name, tp=tp,
                            out_dtype=out_dtype, config=config, layer=layer_arr,
                            num_sms=num_sms, row_scale=rows)
    total = own.astype(jnp.float32)
    if received is not None:
        total = total + received.astype(jnp.float32).sum(0)
    return total[:m].astype(out_dtype)


def _pad_rows(x, addend, multiple: int, out_dtype):
    """x [M, K] and addend [M, N] (or None, cast to out_dtype) with zero rows appended up to
    a multiple of ``multiple``."""
    pad = ((0, -x.shape[0] % multiple), (0, 0))
    x = jnp.pad(x, pad)
    if addend is not None:
        addend = jnp.pad(addend.astype(out_dtype), pad)
    return x, addend
