"""Helpers shared by the benchmark scripts (run as `python3 benchmarks/NAME.py`)."""

from __future__ import annotations

import numpy as np

MODEL_WIDTH = 9216  # characters-57b d_model
ATTENTION_WIDTH = 72 * 128  # heads x head_dim
MLP_WIDTH = 32256


def per_gpu_shapes(tp: int) -> dict[str, tuple[int, int, bool]]:
    """name: (K, N, row_parallel) of one GPU's share of each characters-57b projection at
    tensor-parallel size tp (o and down split K, qkv and up split N)."""
    return {
        "o": (ATTENTION_WIDTH // tp, MODEL_WIDTH, True),
        "down": (MLP_WIDTH // tp, MODEL_WIDTH, True),
        "qkv": (MODEL_WIDTH, 3 * ATTENTION_WIDTH // tp, False),
        "up": (MODEL_WIDTH, MLP_WIDTH // tp, False),
    }


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the host; NaN if `out` has a non-finite value."""
    import jax

    out = np.asarray(jax.device_get(out), np.float64)
    ref = np.asarray(jax.device_get(ref), np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def cuda_event_times_us(call, n_calls: int, repeats: int, warmup: int = 3) -> list[float]:
    """PyTorch on CUDA: microseconds per call of ``call(i)``, i = 0..n_calls-1 back to back
    between two CUDA events, once per repeat, after ``warmup`` calls (i = 0, 1, ...)."""
    import torch

    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n_calls):
            call(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    return times
