"""Benchmark: FP8 ring-cache attention (Pallas Mosaic GPU) vs cuDNN, XLA and PyTorch.

One attention call of characters-57b per GPU: Tq = 757 queries, S = 5,788 cache slots
(1,246 sink slots, the last 200 masked as an unused prompt bucket, then 6 x 757 ring
slots), head_dim 128, 18 / 36 / 72 heads. FLOPs counted: 4 * Tq * S * D * H.

Every contender is timed the same way: kernel durations read through CUPTI (jax's
Mosaic GPU profiler hook), summed over the kernels of one call, median over repeats.
PyTorch is also timed with CUDA events over back-to-back calls. Accuracy: relative
error against the float32 reference on fresh random inputs with outlier rows; the
kernel's output buffer is placed in freed NaN-filled memory first so that an element
the kernel does not write shows up as NaN.

Run (GPU machine):
  PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 benchmarks/bench_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8_attention as fa

TQ, S, D = 757, 5788, 128
SINK, SINK_MASKED = 1246, 200


def make_inputs(h, seed):
    kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (TQ, h, D), jnp.float32)
    rows = jax.random.randint(ko, (8,), 0, TQ)
    q = q.at[rows].multiply(6.0)  # outlier rows
    k = jax.random.normal(kk, (S, h, D), jnp.float32) * 1.5
    k = k.at[:40].multiply(4.0)
    v = jax.random.normal(kv, (S, h, D), jnp.float32)
    k8, ks = fa.quantize_kv(k)
    v8, vs = fa.quantize_kv(v)
    valid = np.ones((S,), bool)
    valid[SINK - SINK_MASKED:SINK] = False
    return q.astype(jnp.bfloat16), k8, v8, ks, vs, jnp.asarray(valid)


def cupti_times(fn, iters=30, sync=None):
    """Per-call kernel times through CUPTI: list of (total_us, {name: us}) per call."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    sync = sync or jax.block_until_ready
    sync(fn())  # warm-up / compile
    sync(fn())
    ext._cupti_init()
    try:
        outs = [fn() for _ in range(iters)]
        for o in outs:
            sync(o)
    finally:
        timings = ext._cupti_get_timings(True)
    per = len(timings) // iters
    calls = [timings[i * per:(i + 1) * per] for i in range(iters)]
    totals = [sum(t for _, t in c) * 1e3 for c in calls]
    med = statistics.median(totals)
    names = {}
    for c in calls:
        for n, t in c:
            names.setdefault(n[:60], []).append(t * 1e3)
    breakdown = {n: statistics.median(v) for n, v in names.items()}
    return med, breakdown, per


def rel_err(out, ref):
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def poisoned_call(fn, nbytes):
    """Fill and free NaN memory of the output's size, then call (unwritten -> NaN)."""
    junk = [jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16) for _ in range(4)]
    jax.block_until_ready(junk)
    del junk
    return jax.block_until_ready(fn())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", default="18,36,72")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default="kv_split_s3,wt_split_s3",
                    help="kv_*: V read as stored, transposed in the kernel; wt_*: V^T built "
                         "by XLA in the wrapper (GPU run 1's kernel); *_grid: one CTA per "
                         "(head, query tile) instead of the stream-K schedule")
    ap.add_argument("--contenders", type=int, default=1, help="also time cuDNN/XLA/PyTorch")
    ap.add_argument("--tag", default="")
    ap.add_argument("--log", default="", help="json-lines log (default: in --out)")
    ap.add_argument("--table", nargs="*", help="only print the table of these json files")
    args = ap.parse_args()
    if args.table is not None:
        rows = []
        for fn in args.table:
            try:
                rows += json.load(open(fn))
            except Exception as e:  # a stage that died leaves its log only
                print(f"(no results from {fn}: {e})")
        print_table(sorted(rows, key=lambda r: r["heads"]))
        return 0
    heads = [int(x) for x in args.heads.split(",")]
    print("devices:", jax.devices(), "jax", jax.__version__, flush=True)
    results = []
    os.makedirs(args.out, exist_ok=True)
    log = open(args.log or f"{args.out}/attention_bench_log{args.tag}.txt", "w")
    results_path = f"{args.out}/attention_results{args.tag}.json"

    def record(**r):
        """Logs one row and rewrites the results file, so a stage cut by its time limit
        keeps every row it finished."""
        results.append(r)
        line = json.dumps(r)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()
        with open(results_path, "w") as fh:
            json.dump(results, fh, indent=1)

    try:
        import torch  # noqa: F401
        have_torch = torch.cuda.is_available()
    except Exception:  # torch absent
        have_torch = False

    variants = _Variants()
    for h in heads:
        flops = 4 * TQ * S * D * h
        q, k8, v8, ks, vs, valid = make_inputs(h, seed=h)
        ref = jax.jit(fa.attention_reference)(q.astype(jnp.float32), k8, v8, ks, vs, valid)
        ref = jax.block_until_ready(ref)

        # --- Pallas FP8 kernel variants
        for vname in args.variants.split(","):
            kw = variants[vname]
            name = f"pallas_fp8_{vname}"
            try:
                f = jax.jit(lambda q, k, v, a, b, m, kw=kw: fa.attention_pallas(
                    q, k, v, a, b, m, **kw))
                # V as the kernel takes it: V^T (made once, as a cache would hold it) or V
                v_as = jax.jit(fa.transpose_v) if kw.get("v_transposed") else (lambda x: x)
                vin = jax.block_until_ready(v_as(v8))
                t0 = time.time()
                out = poisoned_call(lambda: f(q, k8, vin, ks, vs, valid), TQ * h * D * 2)
                comp = time.time() - t0
                # also the raw (padded) kernel output: every row must be finite
                if kw.get("q_in_kernel"):
                    q8, sc, bias = jax.jit(fa._prepare_inputs_q_in_kernel,
                                           static_argnums=(4,))(q, ks, vs, valid, 128)
                    vt = vin
                elif kw["v_in_kernel"]:
                    q8, sc, bias = jax.jit(fa._prepare_inputs_v_in_kernel,
                                           static_argnums=(4, 5))(
                        q, ks, vs, valid, 128, kw["q_split"])
                    vt = vin
                else:
                    q8, sc, bias, vt = jax.jit(fa._prepare_inputs, static_argnums=(5, 6))(
                        q, v8, ks, vs, valid, 128, kw["q_split"])
                opts = fa.kernel_options(h, valid, tq=TQ, **kw)
                ctas = opts["num_ctas"]
                raw_fn = jax.jit(lambda a, b, c, d_, e: fa._fp8_attention_call(
                    a, b, c, d_, e, out_dtype=jnp.bfloat16, clip_out=False, **opts))
                raw = poisoned_call(lambda: raw_fn(q8, k8, vt, sc, bias), 768 * h * D * 2)
                err = rel_err(out, ref)
                finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                raw_finite = bool(jnp.isfinite(raw.astype(jnp.float32)).all())
                # masked-slot independence on this shape
                m = ~valid[:, None, None]
                k2 = jnp.where(m, jnp.full_like(k8, 300.0), k8)
                v2 = jnp.where(m, jnp.full_like(v8, -300.0), v8)
                out2 = f(q, k2, v_as(v2), ks, vs, valid)
                mask_ok = bool((out2.astype(jnp.float32) == out.astype(jnp.float32)).all())
                tot, br, nk = cupti_times(lambda: f(q, k8, vin, ks, vs, valid), args.iters)
                kt, kbr, _ = cupti_times(lambda: raw_fn(q8, k8, vt, sc, bias), args.iters)
                record(heads=h, impl=name, us_total=tot, us_kernel=kt, ctas=ctas or h * -(-TQ // 128),
                       tflops_total=flops / tot / 1e6, tflops_kernel=flops / kt / 1e6,
                       rel_err=err, finite=finite, all_rows_written=raw_finite,
                       masked_no_influence=mask_ok, kernels_per_call=nk,
                       breakdown=br, compile_s=comp)
            except Exception as e:
                record(heads=h, impl=name, error=f"{type(e).__name__}: {str(e)[:1500]}")
                traceback.print_exc()

        if not args.contenders:
            continue
        # --- JAX cuDNN / XLA on bf16 K/V (dequantized once, outside the timing)
        kb = (k8.astype(jnp.float32) * ks[None, :, None]).astype(jnp.bfloat16)
        vb = (v8.astype(jnp.float32) * vs[None, :, None]).astype(jnp.bfloat16)
        mask = jnp.broadcast_to(valid[None, None, None, :], (1, 1, TQ, S))
        for impl, mk in (("cudnn", mask), ("xla", mask), ("cudnn", None)):
            try:
                f = jax.jit(lambda q, k, v, m, impl=impl: jax.nn.dot_product_attention(
                    q[None], k[None], v[None], mask=m, implementation=impl)[0])
                out = f(q, kb, vb, mk)
                err = rel_err(out, ref) if mk is not None else None
                tot, br, nk = cupti_times(lambda: f(q, kb, vb, mk), args.iters)
                tag = "" if mk is not None else "_nomask"
                record(heads=h, impl=f"jax_{impl}_bf16{tag}", us_total=tot,
                       us_kernel=attn_kernel_us(br), tflops_kernel=flops / attn_kernel_us(br) / 1e6,
                       tflops_total=flops / tot / 1e6, rel_err=err, breakdown=br,
                       kernels_per_call=nk)
            except Exception as e:
                record(heads=h, impl=f"jax_{impl}_bf16", error=f"{type(e).__name__}: {e}"[:1500])

        # --- PyTorch SDPA, cuDNN backend
        if have_torch:
            try:
                import torch
                from torch.nn.attention import SDPBackend, sdpa_kernel
                tq_ = torch.from_numpy(np.asarray(q.astype(jnp.float32))).cuda().bfloat16()
                tk_ = torch.from_numpy(np.asarray(kb.astype(jnp.float32))).cuda().bfloat16()
                tv_ = torch.from_numpy(np.asarray(vb.astype(jnp.float32))).cuda().bfloat16()
                tq_, tk_, tv_ = (x.permute(1, 0, 2).unsqueeze(0) for x in (tq_, tk_, tv_))
                tmask = torch.from_numpy(np.asarray(valid)).cuda()[None, None, None, :]
                tmask = tmask.expand(1, 1, TQ, S)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                for mname, mk in (("mask", tmask), ("nomask", None)):
                    try:
                        def call(mk=mk):
                            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                return sdpa(tq_, tk_, tv_, attn_mask=mk)
                        o = call()
                        torch.cuda.synchronize()
                        err = None
                        if mk is not None:
                            o_np = o[0].permute(1, 0, 2).float().cpu().numpy()
                            err = rel_err(o_np, ref)
                        tot, br, nk = cupti_times(
                            call, args.iters, sync=lambda _: torch.cuda.synchronize())
                        st, en = torch.cuda.Event(True), torch.cuda.Event(True)
                        st.record()
                        for _ in range(50):
                            call()
                        en.record()
                        torch.cuda.synchronize()
                        ev_us = st.elapsed_time(en) * 1e3 / 50
                        record(heads=h, impl=f"torch_cudnn_bf16_{mname}", us_total=tot,
                               us_kernel=attn_kernel_us(br),
                               tflops_kernel=flops / attn_kernel_us(br) / 1e6,
                               tflops_total=flops / tot / 1e6, us_events=ev_us,
                               rel_err=err, breakdown=br, kernels_per_call=nk)
                    except Exception as e:
                        record(heads=h, impl=f"torch_cudnn_bf16_{mname}",
                               error=f"{type(e).__name__}: {e}"[:800])
                del tq_, tk_, tv_, tmask
                torch.cuda.empty_cache()
            except Exception as e:
                record(heads=h, impl="torch", error=f"{type(e).__name__}: {e}"[:800])

    print_table(results)
    return 0


class _Variants(dict):
    """Kernel variant names: '{kv|wt}_{split|single}_s{stages}' then any of the flags
    '_grid' (one CTA per tile, not stream-K), '_np' (no ping-pong), '_lpv' (row sums from
    the tensor core), '_fast' (no bias on unmasked blocks), '_ov' / '_oq' (overlap='pv' /
    'qk', see _fp8_attention_call; imply '_np'; '_ov' needs no '_lpv'), '_bx' (exponentials from float bits), '_qik' (the
    kernel quantizes Q itself), '_pc' / '_pcl' (P's e4m3 codes from float bits, without /
    with the low-range line; need '_lpv'), '_lz' (lazy_rescale), '_ob' (overlap='batch',
    with the ping-pong unless '_np'), '_vw' (the wide V transpose), '_vt' (V^T as a cache
    would store it, from fa.transpose_v outside the timing: no transpose in the kernel); e.g.
    'kv_split_s2_lpv_fast_np' (the default of GPU runs 6-19); 'default': attention_pallas's
    own defaults (V as stored plain); 'default_vt': the same with V^T as a V^T cache
    (--v-cache transposed) stores it."""

    def __missing__(self, name):
        if name in ("default", "default_vt"):  # attention_pallas given no options
            defaults = dataclasses.asdict(fa.KernelOptions())
            opts = {k: defaults[k] for k in ("stages", "q_split", "v_in_kernel",
                                             "persistent", "pingpong", "l_in_pv",
                                             "fast_unmasked", "overlap", "bit_exp2",
                                             "q_in_kernel", "p_codes",
                                             "lazy_rescale", "wide_v_transpose",
                                             "v_transposed")}
            return {**opts, "v_transposed": name == "default_vt"}
        vk, qs, st, *flags = name.split("_") + ["", ""]
        flags = [f for f in flags if f]
        unknown = set(flags) - {"grid", "np", "lpv", "fast", "ov", "oq", "bx", "qik",
                                "pc", "pcl", "lz", "ob", "vw", "vt"}
        if vk not in ("kv", "wt") or qs not in ("split", "single") or not st[1:].isdigit() \
                or not st.startswith("s") or unknown:
            raise KeyError(f"bad variant {name!r} ({self.__doc__})")
        return dict(stages=int(st[1:]), q_split=qs == "split", v_in_kernel=vk == "kv",
                    persistent="grid" not in flags,
                    pingpong=not {"np", "ov", "oq"} & set(flags), l_in_pv="lpv" in flags,
                    fast_unmasked="fast" in flags,
                    overlap=("pv" if "ov" in flags else "qk" if "oq" in flags else
                             "batch" if "ob" in flags else ""),
                    bit_exp2="bx" in flags, q_in_kernel="qik" in flags,
                    p_codes=2 if "pcl" in flags else 1 if "pc" in flags else 0,
                    lazy_rescale="lz" in flags, wide_v_transpose="vw" in flags,
                    v_transposed="vt" in flags)


def attn_kernel_us(breakdown):
    """The attention kernel's own time in a breakdown (cuDNN's fprop kernel or ours); the
    whole SDPA kernel time for XLA's several kernels is not meaningful (returns total)."""
    ks = [v for n, v in breakdown.items() if "sdpa" in n or "mosaic" in n]
    return sum(ks) if ks else sum(breakdown.values())


def print_table(results):
    print("\nheads impl                           us_total  TF/s  us_kernel TF/s_k  rel_err  ok")
    for r in results:
        if "error" in r:
            print(f"{r['heads']:>5} {r['impl']:<30} ERROR {r['error'][:90]}")
            continue
        ok = all(r.get(x, True) for x in ("finite", "all_rows_written", "masked_no_influence"))
        print(f"{r['heads']:>5} {r['impl']:<30} {r['us_total']:8.1f} {r['tflops_total']:5.0f}"
              f"  {r.get('us_kernel', float('nan')):8.1f} {r.get('tflops_kernel', float('nan')):5.0f}"
              f"  {r.get('rel_err') if r.get('rel_err') is None else round(r['rel_err'], 4)!s:>7}  {ok}")


if __name__ == "__main__":
    sys.exit(main())
