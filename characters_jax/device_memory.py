"""This process's device memory, as its allocators report it."""

from __future__ import annotations


def device_memory() -> dict:
    """This process's device memory from the allocator, summed over its local devices:
    bytes_in_use, peak_bytes_in_use, bytes_limit (absent on backends that do not report
    them, such as the CPU). Host-side only: no device sync."""
    import jax

    out: dict = {}
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if key in stats:
                out[key] = out.get(key, 0) + int(stats[key])
    return out
