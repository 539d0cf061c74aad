"""Attention-out + MLP-down of one block: two stacked GEMMs chained through the addend
against one stream-K GEMM with attention-out leading (``stacked_fp8_matmul(lead=...)``).

Per-GPU shapes of characters-57b at each ``--tp`` (N = 9216; K = 9216 / tp and 32256 / tp),
M = 757 padded to 760 as in the model, per-row activation scales and [L] weight-scale
stacks, L = 60 layers in one jitted ``lax.scan`` (the traced index picks the layer; x and
the output go through optimization barriers). The two forms are timed in interleaved
rounds (one scan of each per round), median us per layer; the error of the last layer's
full output against float32 math, after the memory was filled with NaN.

Run (one H200):  PYTHONPATH=. python3 benchmarks/bench_out_down.py --out $OUT
CPU smoke run (tiny shapes, the kernels under the Mosaic GPU interpreter):  --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import per_gpu_shapes, rel_err  # noqa: E402


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels import fp8_gemm_stacked as st

    fp8 = jnp.float8_e4m3fn
    impl, m, layers = ("interpret", 40, 2) if args.smoke else ("pallas", 760, args.layers)
    seed = int(time.time_ns() % 2**31)
    key = jax.random.key(seed)
    res = {"meta": {"seed": seed, "m": m, "layers": layers, "device": str(jax.devices()[0])}}
    for tp in args.tp:
        shapes = per_gpu_shapes(tp)
        (ko, n, _), (kd, _, _) = shapes["o"], shapes["down"]
        if args.smoke:
            ko, kd, n = 256, 384, 512
        ks = jax.random.split(jax.random.fold_in(key, tp), 6)
        mk = jax.jit(lambda kk, shape: lax.map(
            lambda k1: (jax.random.normal(k1, shape[1:]) * 16).astype(fp8),
            jax.random.split(kk, shape[0])), static_argnums=1)
        xo, xd = mk(ks[0], (1, m, ko))[0], mk(ks[1], (1, m, kd))[0]
        wo, wd = mk(ks[2], (layers, n, ko)), mk(ks[3], (layers, n, kd))
        so = jax.random.uniform(ks[4], (layers,), minval=0.5, maxval=2) / 65536
        sd = so[::-1] / 2
        ro = jax.random.uniform(ks[5], (757 if not args.smoke else m,), minval=0.5, maxval=4)
        rd = ro[::-1] / 3
        kw = dict(impl=impl, num_sms=2 if args.smoke else None)

        # The operands go in as arguments (closed over, jit would embed the GBs as constants).
        operands = (xo, wo, xd, wd, so, sd, ro, rd)

        def chained(layer, xo, wo, xd, wd, so, sd, ro, rd):
            o = st.stacked_fp8_matmul(xo, wo, layer, so, row_scale=ro, **kw)
            return st.stacked_fp8_matmul(xd, wd, layer, sd, row_scale=rd, addend=o, **kw)

        def joined(layer, xo, wo, xd, wd, so, sd, ro, rd):
            return st.stacked_fp8_matmul(xd, wd, layer, sd, row_scale=rd,
                                         lead=st.Product(xo, wo, so, ro), **kw)

        def scanned(op):
            def f(*ops):
                def body(c, layer):
                    layer, _ = lax.optimization_barrier((layer, c))
                    y = lax.optimization_barrier(op(layer, *ops))
                    return c + y[layer % m, 0].astype(jnp.float32), None
                return lax.scan(body, jnp.float32(0), jnp.arange(layers, dtype=jnp.int32))[0]
            return jax.jit(f)

        ref = st.stacked_fp8_matmul(xd, wd, layers - 1, sd, row_scale=rd, impl="reference",
                                    lead=st.Product(xo, wo, so, ro), out_dtype=jnp.float32)
        forms = {"chained": chained, "joined": joined}
        row = {}
        for name, op in forms.items():
            jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()
            row[name] = {"rel_err": rel_err(jax.jit(op)(jnp.int32(layers - 1), *operands), ref)}
            print(f"tp={tp} {name}: rel err {row[name]['rel_err']:.2e}", flush=True)
        fns = {name: scanned(op) for name, op in forms.items()}
        for name, f in fns.items():
            t1 = time.time()
            jax.block_until_ready(f(*operands))
            print(f"tp={tp} {name}: compiled and ran in {time.time() - t1:.1f} s", flush=True)
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, f in fns.items():
                t1 = time.perf_counter()
                jax.block_until_ready(f(*operands))
                times[name].append((time.perf_counter() - t1) * 1e6 / layers)
        for name in fns:
            row[name].update(us=statistics.median(times[name]), all_us=times[name])
        row["joined_over_chained"] = row["joined"]["us"] / row["chained"]["us"]
        row["shape"] = {"m": m, "n": n, "k_out": ko, "k_down": kd}
        res[f"tp{tp}"] = row
        with open(os.path.join(args.out, "out_down.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"tp={tp} N={n} K_o={ko} K_down={kd}: chained {row['chained']['us']:.1f} us "
              f"(err {row['chained']['rel_err']:.2e}), joined {row['joined']['us']:.1f} us "
              f"(err {row['joined']['rel_err']:.2e}), ratio {row['joined_over_chained']:.3f}",
              flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/bench_out_down")
    p.add_argument("--tp", type=int, nargs="+", default=[4, 2, 3])
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run(args)  # writes out_down.json after each tp


if __name__ == "__main__":
    main()
