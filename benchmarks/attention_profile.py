"""Where the FP8 attention kernel's time goes: a Mosaic GPU profiler trace per schedule.

Runs ``_fp8_attention_call`` at the model's shape with the Mosaic GPU profiler on (each
warpgroup records the begin/end times of the kernel's named scopes: qk, softmax, sync,
pv, q_wait, store, partial, merge, v_transpose), then sums each scope per warpgroup and
prints, per schedule, the CTA span and the compute warpgroups' time per scope (mean over
CTAs), per KV step and as a share of the span. Profiling adds ~12 cycles per event.
Units: the profiler's timestamps are SM clock cycles (its JSON calls them ns; on the H200
a 79.9 us kernel spans 159.5 k of them), so times here are in thousands of cycles (kcyc).

  python3 benchmarks/attention_profile.py --out $OUT/prof --heads 18 --schedules grid,stream_k
  python3 benchmarks/attention_profile.py --variant kv_split_s2   # GPU run 5's softmax
  python3 benchmarks/attention_profile.py --variant default --debug no_softmax  # the rest

--variant names the softmax options as bench_attention.py does ('default': the defaults of
``attention_pallas``); --schedules overrides its grid/stream-K choice.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import fp8_attention as fa  # noqa: E402
from benchmarks.bench_attention import _Variants  # noqa: E402
from benchmarks._common import summarize_mgpu_trace  # noqa: E402

TQ, S, D, BLOCK_KV = 757, 5788, 128, 128


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/attention_profile")
    ap.add_argument("--heads", default="18")
    ap.add_argument("--schedules", default="grid,stream_k")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--summarize", nargs="*", help="only summarize these trace files")
    ap.add_argument("--debug", default="",
                    help="comma-separated timing diagnostics of _fp8_attention_call "
                         "(no_v_transpose, no_softmax: wrong results, the kernel without "
                         "that part)")
    args = ap.parse_args()
    if args.summarize:
        for f in args.summarize:
            print(f, json.dumps(summarize_mgpu_trace(f, fa.COMPUTE_WGS + 1), indent=1))
        return 0
    results = []
    kw = _Variants()[args.variant]
    for h in (int(x) for x in args.heads.split(",")):
        kq, kk, kv = jax.random.split(jax.random.key(h), 3)
        q = jax.random.normal(kq, (TQ, h, D), jnp.float32).astype(jnp.bfloat16)
        k8, ks = fa.quantize_kv(jax.random.normal(kk, (S, h, D), jnp.float32))
        v8, vs = fa.quantize_kv(jax.random.normal(kv, (S, h, D), jnp.float32))
        valid = jnp.ones((S,), bool).at[1046:1246].set(False)
        q8, sc, bias = (fa._prepare_inputs_q_in_kernel(q, ks, vs, valid, BLOCK_KV)
                        if kw["q_in_kernel"] else
                        fa._prepare_inputs_v_in_kernel(q, ks, vs, valid, BLOCK_KV,
                                                       kw["q_split"]))
        vin = fa.transpose_v(v8) if kw.get("v_transposed") else v8  # '_vt': V^T as cached
        for sched in args.schedules.split(","):
            opts = fa.kernel_options(h, valid, tq=TQ, **{
                **kw, "persistent": sched == "stream_k", "v_in_kernel": True})
            pdir = os.path.abspath(f"{args.out}/h{h}_{sched}")
            os.makedirs(pdir, exist_ok=True)
            f = jax.jit(lambda a, b, c, d_, e, pdir=pdir, opts=opts: fa._fp8_attention_call(
                a, b, c, d_, e, out_dtype=jnp.bfloat16, clip_out=False, profile_dir=pdir,
                debug=tuple(x for x in args.debug.split(",") if x), **opts))
            for _ in range(3):
                jax.block_until_ready(f(q8, k8, vin, sc, bias))
            files = sorted(glob.glob(f"{pdir}/*.json"), key=os.path.getmtime)
            if not files:
                print(f"h={h} {sched}: no trace written in {pdir}")
                continue
            r = summarize_mgpu_trace(files[-1], fa.COMPUTE_WGS + 1)
            r.update(heads=h, schedule=sched, variant=args.variant, debug=args.debug,
                     trace=files[-1])
            results.append(r)
            units = h * -(-TQ // (fa.COMPUTE_WGS * fa.BLOCK_Q)) * -(-S // BLOCK_KV)
            steps = units / r["ctas"]
            print(f"\nheads {h} {sched}: {r['ctas']} CTAs, span {r['span_kcyc']:.1f} kcyc, "
                  f"{steps:.1f} KV steps per CTA")
            print(f"  {'scope':<12} {'kcyc/WG':>8} {'calls':>6} {'kcyc/step':>9} {'share':>6}")
            for name, us in sorted(r["compute_kcyc_per_wg"].items(), key=lambda x: -x[1]):
                print(f"  {name:<12} {us:8.2f} {r['compute_calls_per_wg'][name]:6.1f} "
                      f"{us / steps:9.3f} {us / r['span_kcyc']:6.1%}")
            for name, us in r["memory_kcyc"].items():
                print(f"  memory WG {name:<12} {us:8.2f} kcyc")
    with open(f"{args.out}/profile_summary.json", "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
