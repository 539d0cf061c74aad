"""Memory ordering shared by the Mosaic GPU kernels that hand partial results between
CTAs through global memory (the attention's and the stacked GEMM's stream-K schedules)."""

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
