"""The kernel's work and its schedule: a tile is one head and 128 query rows (two compute
warpgroups of ``BLOCK_Q`` rows), its work units its KV blocks; the persistent grid deals
the units out evenly over one CTA per SM (stream-K), a CTA's range cutting tiles.
``AttentionTuning`` holds the knobs: the KV block, the pipeline depth, the grid size."""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from pallas_kernels import device

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



def padded_queries(tq: int) -> int:
    """Tq' of the kernel's output and scales operand: Tq rounded up to a tile's rows."""
    return -(-tq // (COMPUTE_WGS * BLOCK_Q)) * (COMPUTE_WGS * BLOCK_Q)


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
