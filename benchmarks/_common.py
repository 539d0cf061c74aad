"""Helpers shared by the benchmark scripts (run as `python3 benchmarks/NAME.py`)."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the host; NaN if `out` has a non-finite value."""
    import jax

    out = np.asarray(jax.device_get(out), np.float64)
    ref = np.asarray(jax.device_get(ref), np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
