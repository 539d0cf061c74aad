"""The block input's norm + modulation + FP8 quantization at characters-57b's shape
(757 x 9216 bf16 -> 760 rows of e4m3): the fused Pallas kernel (``--warps`` variants)
against XLA's fusions of the same per-row math and of the per-tensor math.

Each variant runs 60 times inside one jitted ``lax.scan`` (as the block scan does), its
output carried to the next iteration through an optimization barrier with the input, so
every iteration's values are written; per call = scan time / 60, median of ``--repeats``
(host clock around ``block_until_ready``, after a warm-up call).

Run (one GPU):  PYTHONPATH=. python3 benchmarks/bench_row_quantize.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from characters_jax.model.dit import modulated_norm
from characters_jax.parallel.fp8_linear import quantize
from pallas_kernels import fp8_row_quantize as rq

M, D, ROWS, LAYERS, EPS = 757, 9216, 760, 60, 1e-6


def variants(warps):
    out = {f"pallas_w{w}": (lambda x, a, b, w=w: rq.norm_modulate_quantize(
        x, a, b, eps=EPS, rows_out=ROWS, impl="pallas", num_warps=w)) for w in warps}

    out["xla_row"] = lambda x, a, b: rq.reference(x, a, b, eps=EPS, rows_out=ROWS)

    def xla_tensor(x, a, b):
        q = quantize(modulated_norm(x, a, b, EPS), "tensor")
        return jnp.pad(q.values, ((0, ROWS - M), (0, 0))), q.scale
    out["xla_tensor"] = xla_tensor
    return out


def time_variant(fn, x, a, b, repeats):
    def scan(x, a, b):
        def body(carry, i):
            xi, _ = lax.optimization_barrier((x, carry))
            q, s = fn(xi, a, b)
            return (q, s.reshape(-1)[:1]), None
        init = (jnp.zeros((ROWS, D), rq.FP8), jnp.zeros((1,), jnp.float32))
        return lax.scan(body, init, jnp.arange(LAYERS))[0]
    f = jax.jit(scan)
    jax.block_until_ready(f(x, a, b))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, a, b))
        ts.append((time.perf_counter() - t0) / LAYERS * 1e6)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    kx, ka, kb = jax.random.split(jax.random.key(int(time.time()) % 2**31), 3)
    x = jax.random.normal(kx, (M, D)).astype(jnp.bfloat16)
    a, b = jax.random.normal(ka, (D,)) * 0.1, jax.random.normal(kb, (D,)) * 0.1
    res = {"device": str(jax.devices()[0]), "m": M, "d": D, "layers": LAYERS, "us": {}}
    for rnd in range(2):  # two rounds, interleaved: drift shows as a difference
        for name, fn in variants(args.warps).items():
            try:
                us = time_variant(fn, x, a, b, args.repeats)
            except Exception as e:  # noqa: BLE001
                us = float("nan")
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            res["us"].setdefault(name, []).append(us)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "row_quantize.json"), "w") as f:
        json.dump(res, f, indent=1)
    base = min(res["us"]["xla_row"])
    print(f"us per call, M={M} D={D} (two rounds), vs xla_row")
    for name, us in res["us"].items():
        print(f"{name:12s} {us[0]:8.1f} {us[1]:8.1f}   x{min(us) / base:.2f}")


if __name__ == "__main__":
    main()
