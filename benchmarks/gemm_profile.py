"""Where the stream-K FP8 GEMM's time goes: a Mosaic GPU profiler trace per projection.

Runs ``fp8_gemm_stream_k.kernel`` at M = 760 (757 rows padded to 8) on one weight of each
characters-57b tp = 2 projection with the profiler on: each warpgroup records its named
scopes (``PROFILE_SCOPES``: every segment's K loop, the partial's stores, a whole tile's
store, the owner's wait for its neighbour's partial and the load, the merged store, the
final wait for the TMA stores). Prints per shape the CTAs' span, the kernel's span, the
spread of the CTAs' starts (launch skew) and ends (the tail), and the compute warpgroups'
time per scope (mean over CTAs), with the K loop's cost per step. Times in SM clock
kcycles; the clock under dense FP8 GEMMs is not the boost clock (BUILD_NOTES, "Where the
stream-K GEMM's time goes": 1.34-1.44 GHz implied), so no conversion to us is made. What
the span holds outside the K loop is the kernel's fixed cost per call.

  python3 benchmarks/gemm_profile.py --out $OUT/gemm_prof --shapes out,qkv
  python3 benchmarks/gemm_profile.py --summarize TRACE.json ...
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import summarize_mgpu_trace  # noqa: E402
from benchmarks.bench_gemm_stacked import SHAPES  # noqa: E402

M8 = 760


def profile_shape(name: str, out_dir: str, config_spec: str) -> dict:
    """Profiles the stream-K kernel at projection ``name``; returns the trace summary."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_gemm_stacked import parse_config
    from pallas_kernels import fp8_gemm_allreduce as ga
    from pallas_kernels import fp8_gemm_stacked as st
    from pallas_kernels import fp8_gemm_stream_k as sk

    n, k = SHAPES[name]
    config = parse_config(config_spec) if config_spec else st.pick_config(n, k, m=M8)
    if not config.stream_k:
        raise ValueError(f"{config} is not a stream-K config")
    kx, kw = jax.random.split(jax.random.key(0))
    x = (jax.random.normal(kx, (M8, k), jnp.float32) * 2).astype(sk.FP8)
    w = (jax.random.normal(kw, (1, n, k), jnp.float32) * 2).astype(sk.FP8)
    sms = ga.device_sm_count()
    m_iters, n_iters = -(-M8 // config.tile_m), n // (2 * config.tile_n)
    teams = sk.num_teams(m_iters, n_iters, sms)
    pdir = os.path.abspath(f"{out_dir}/{name}")
    os.makedirs(pdir, exist_ok=True)
    f = jax.jit(lambda a, b: sk.kernel(a, b, jnp.ones((1,), jnp.float32), None,
                                       jnp.zeros((1,), jnp.int32), out_dtype=jnp.bfloat16,
                                       config=config, teams=teams, profile_dir=pdir))
    for _ in range(3):  # warm: compiled, the weight's pages touched
        out = jax.block_until_ready(f(x, w))
    for old in glob.glob(f"{pdir}/*.json"):  # the profiler writes a trace once per path:
        os.remove(old)  # the warm-up's (cold) one goes, the next call's stays
    out = jax.block_until_ready(f(x, w))
    ref = jnp.dot(x.astype(jnp.float32), w[0].astype(jnp.float32).T)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    files = sorted(glob.glob(f"{pdir}/*.json"), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"{name}: no trace written in {pdir}")
    r = summarize_mgpu_trace(files[-1], sk.COMPUTE_WGS + 1)
    units = n_iters * (k // config.tile_k)
    r.update(shape=name, n=n, k=k, config=repr(config), teams=teams,
             k_steps_per_block=units / teams, rel_err=err, trace=files[-1])
    return r


def report(r: dict) -> str:
    c = r["compute_kcyc_per_wg"]
    loop = c.get("mainloop", 0.0)
    steps = r.get("k_steps_per_block")
    lines = [f"{r.get('shape', '?')}: {r['ctas']} CTAs, span {r['span_kcyc']:.1f} kcyc "
             f"(kernel {r['kernel_span_kcyc']:.1f}; starts spread {r['start_spread_kcyc']:.1f}, "
             f"ends {r['end_spread_kcyc']:.1f})"
             + (f", rel_err {r['rel_err']:.2e}" if "rel_err" in r else "")]
    for scope, t in sorted(c.items(), key=lambda kv: -kv[1]):
        calls = r["compute_calls_per_wg"].get(scope, 0)
        lines.append(f"  {scope:<12} {t:8.2f} kcyc/wg  {calls:5.2f} calls  "
                     f"{100 * t / r['span_kcyc']:5.1f}% of span")
    if steps:
        lines.append(f"  K loop per step {loop / steps:.3f} kcyc ({steps:.1f} steps per block); "
                     f"span outside the K loop {r['span_kcyc'] - loop:.1f} kcyc")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/gemm_profile")
    ap.add_argument("--shapes", default="out,qkv", help=f"comma-separated of {sorted(SHAPES)}")
    ap.add_argument("--config", default="", help="a stream-K spec as bench_gemm_stacked "
                    "takes it (e.g. m128n64s6k); default: pick_config's")
    ap.add_argument("--summarize", nargs="*", help="only summarize these trace files")
    args = ap.parse_args()
    if args.summarize:
        for f in args.summarize:
            print(report(summarize_mgpu_trace(f, 3)))
        return 0
    results = []
    for name in args.shapes.split(","):
        r = profile_shape(name, args.out, args.config)
        results.append(r)
        print(report(r), flush=True)
    with open(f"{args.out}/gemm_profile.json", "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
