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


def summarize_mgpu_trace(trace_file: str, warpgroups: int) -> dict:
    """A Mosaic GPU profiler trace (``CompilerParams(profile_dir=...)``): per named scope
    the time per warpgroup role (the last of ``warpgroups`` per CTA is the memory
    warpgroup, the others compute), mean over CTAs; the mean CTA span; and how the CTAs
    line up: the kernel's span (first event to last), the spread of the CTAs' first events
    (launch skew) and of their last ones (the tail). Times in the trace's units (SM clock
    kcycles: the JSON calls them us)."""
    import collections
    import json

    events = json.load(open(trace_file))["traceEvents"]
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    per_role = collections.defaultdict(lambda: collections.defaultdict(float))
    spans = collections.defaultdict(lambda: [np.inf, -np.inf])
    counts = collections.defaultdict(lambda: collections.defaultdict(int))
    n_ctas = 0
    for tid, evs in by_tid.items():
        trace_idx = (tid - 1) % warpgroups
        cta = (tid - 1) // warpgroups
        n_ctas = max(n_ctas, cta + 1)
        role = "memory" if trace_idx == warpgroups - 1 else "compute"
        stack = []
        for e in evs:
            t = e["ts"]
            spans[cta][0] = min(spans[cta][0], t)
            spans[cta][1] = max(spans[cta][1], t)
            if e["ph"] == "B":
                stack.append((e["name"], t))
            elif stack:
                name, t0 = stack.pop()
                per_role[role][name] += t - t0
                counts[role][name] += 1
    n_compute = n_ctas * (warpgroups - 1)
    starts = np.array([a for a, _ in spans.values()])
    ends = np.array([b for _, b in spans.values()])
    return {
        "ctas": n_ctas,
        "span_kcyc": float(np.mean(ends - starts)),
        "kernel_span_kcyc": float(ends.max() - starts.min()),
        "start_spread_kcyc": float(starts.max() - starts.min()),
        "end_spread_kcyc": float(ends.max() - ends.min()),
        "compute_kcyc_per_wg": {k: v / n_compute for k, v in per_role["compute"].items()},
        "compute_calls_per_wg": {k: v / n_compute for k, v in counts["compute"].items()},
        "memory_kcyc": {k: v / n_ctas for k, v in per_role["memory"].items()},
    }
