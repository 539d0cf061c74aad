"""Synchronization helpers shared by the Mosaic GPU kernels: memory ordering for partials in
GMEM (stream-K), and the cross-device protocol of a kernel that writes into its peers'
memory (the fused GEMM + all-reduce, at any schedule)."""

from __future__ import annotations


def fence_proxy_async_global():
    """Orders this thread's generic-proxy accesses to global memory with async-proxy (TMA)
    ones: after a semaphore wait, before TMA reads of what the signaller wrote, and after
    TMA writes have completed, before the signal. Call inside a Mosaic GPU kernel."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    fence()


class PeerSync:
    """The entry handshake and the done count of a kernel on ``tp`` devices that stores into
    its peers' memory (``fp8_gemm_allreduce``'s module docstring, "Synchronization").

    Build it inside the kernel body: it takes the semaphores (``pl.get_global``, zeroed by
    the lowering at every call) and this device's index on ``axis_name``.
      entry (``entry_sync``): nothing may be written into a peer, nor signalled to it,
        before that peer's call has begun. The leader signals every peer at the start
        (``start``, phase 1); every writer calls ``enter`` before its first remote store
        and before its done signals: it returns once every peer has signalled; the
        leader then signals each peer it has seen again (phase 2), which no zero-fill
        can erase. Slot j counts the device j places behind.
      done: each writer, once its copies have completed, signals every peer once
        (``finish``); the leader waits for all the peers' signals, so when the kernel ends
        every tile sent to this device has landed.
    """

    def __init__(self, axis_name: str, tp: int, entry_sync: bool):
        from jax import lax
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.tp, self.entry_sync = tp, entry_sync
        self.dev = lax.axis_index(axis_name)
        self.done = pl.get_global(plgpu.SemaphoreType.REGULAR)
        # entry[j]: signals from the device j places behind (slot 0 unused)
        self.entry = ([None] + [pl.get_global(plgpu.SemaphoreType.REGULAR)
                                for _ in range(1, tp)] if entry_sync else None)

    def peer(self, j):
        """The device j places ahead (traced int32)."""
        from jax import lax

        return lax.rem(self.dev + j, self.tp)

    def start(self, leader):
        """Phase 1: the leader signals every peer's entry slot."""
        from jax.experimental import pallas as pl

        if not self.entry_sync:
            return

        @pl.when(leader)
        def _phase1():
            for j in range(1, self.tp):
                pl.semaphore_signal(self.entry[j], 1, device_id=self.peer(j))

    def enter(self, is_leader):
        """Returns once every peer has entered this call; ``is_leader`` (traced bool, or None
        where the caller is never the leader) then sends phase 2 to each peer."""
        from jax import lax
        from jax.experimental import pallas as pl

        if not self.entry_sync:
            return
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
