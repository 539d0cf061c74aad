"""FP8 GEMMs and row-parallel GEMM + all-reduce at characters-57b per-GPU shapes (tp=2).

One run checks every variant against an f32 reference on fresh random inputs
(outputs land in memory first filled with NaN, so an unwritten element shows),
then times it inside one jitted ``lax.fori_loop`` (medians over repeats):

  gemm       XLA FP8 dot on pre-quantized operands, bf16 out (one device), scale forms:
             _f32 / _bf16: dot to f32 / bf16 then a multiply ('post', run 1);
             _dequant: dot(convert(x8)*a, convert(w8)*b) (cuBLASLt A/B scales, bf16 out);
             _dequant_m768: the same on x padded to 768 rows, [768, N] out (no pad/slice);
             _linear: ``fp8_linear.linear`` from bf16 x (amax + quantization included)
  allreduce  ``lax.psum`` of the bf16 [M, N] output (NCCL)
  gemm+ar    the two in sequence ('psum' method)
  ppermute   ring reduce-scatter over row chunks overlapped with the matmul, then all-gather
  fused      the Pallas Mosaic GPU fused GEMM + all-reduce kernel; configs: '' = run 1
             (reduce='xla'), _m64, _tma (in-kernel TMA reduce-add), _tma_m64
  torch      ``torch._scaled_mm`` and a NCCL all-reduce (torch.distributed, 2 processes)

hidden = (t_gemm + t_allreduce - t_fused) / t_allreduce.

Run (2 GPUs):
  PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 python3 benchmarks/bench_gemm_allreduce.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import rel_err  # noqa: E402

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLS stays off on the lent machines
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

T0 = time.time()  # the --budget-s clock starts at import
M = 757
D = 9216
# name: (K, N, row_parallel)
SHAPES = {
    "o": (4608, D, True),  # attention-out, K = 72 * 128 / 2
    "down": (16128, D, True),  # MLP-down, K = 32256 / 2
    "qkv": (D, 13824, False),  # column-parallel: 3 * 9216 / 2
    "up": (D, 16128, False),  # column-parallel: 32256 / 2
}


# ----------------------------------------------------------------------------- torch
def _torch_worker(rank, world, out_path, reps):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    res = {}

    def timed(fn, n=reps, repeats=5):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / n)
        return statistics.median(ts)

    for name, (k, n, row) in SHAPES.items():
        x = torch.randn(M, k, device=dev).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device=dev)).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.01, device=dev)
        sb = torch.tensor(0.02, device=dev)
        try:
            mm = lambda: torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            y = mm()
            ref = (x.float() @ w.float().t()) * 0.0002
            err = ((y.float() - ref).norm() / ref.norm()).item()
            res[f"{name}/torch_scaled_mm"] = {"us": timed(mm), "rel_err": err}
        except Exception as e:  # noqa: BLE001
            res[f"{name}/torch_scaled_mm"] = {"error": repr(e)[:300]}
            continue
        if row:
            buf = torch.randn(M, n, device=dev, dtype=torch.bfloat16)
            dist.barrier()
            res[f"{name}/torch_allreduce"] = {"us": timed(lambda: dist.all_reduce(buf))}

            def both():
                out = torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                dist.all_reduce(out)

            dist.barrier()
            res[f"{name}/torch_mm+allreduce"] = {"us": timed(both)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def run_torch(out_dir, reps):
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        return {"torch": {"error": "torch not installed"}}
    if torch.cuda.device_count() < 2:
        return {"torch": {"error": "needs 2 GPUs"}}
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "torch_raw.json")  # not under --out
    tmp.spawn(_torch_worker, args=(2, path, reps), nprocs=2, join=True)
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- jax
def _configs():
    from pallas_kernels.fp8_gemm_allreduce import Config

    return {"": Config(), "_tma": Config(reduce="tma_add"),
            "_tma_m64": Config(reduce="tma_add", tile_m=64, stages=4),
            "_m64": Config(tile_m=64, stages=4)}


def run_jax(reps, repeats, only=None, deadline=None, save=None):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from characters_jax.parallel import row_parallel
    from characters_jax.parallel.fp8_linear import (
        Fp8Weight, dequant_dot, fp8_dot, linear, quantize_weight)
    from pallas_kernels import fp8_gemm_allreduce as fused

    devs = jax.devices()
    tp = 2
    mesh = Mesh(np.array(devs[:tp]), ("tp",))
    mesh1 = Mesh(np.array(devs[:1]), ("tp",))
    res = {}
    CONFIGS = _configs()
    seed = int(time.time_ns() % 2**31)
    print(f"jax {jax.__version__} devices {devs} seed {seed}")

    def poison():
        """Fill (and free) device memory with NaN so unwritten outputs show."""
        for d in devs[:tp]:
            jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32), d).block_until_ready()

    def bench(fn, args):
        """Median microseconds per call of fn(*args), looped `reps` times in one jit."""
        def looped(*a):
            def body(i, carry):
                a2 = lax.optimization_barrier((a, i))[0]
                return fn(*a2)
            out0 = jax.eval_shape(fn, *a)
            init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
            return lax.fori_loop(0, reps, body, init)
        jf = jax.jit(looped)
        jax.block_until_ready(jf(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(jf(*args))
            ts.append((time.perf_counter() - t0) * 1e6 / reps)
        return statistics.median(ts)

    def record(key, fn, args, check=None):
        if deadline is not None and time.time() > deadline:
            res[key] = {"error": "skipped: out of time"}
            print(f"{key:32s} skipped (deadline)")
            return
        try:
            us = bench(fn, args)
            entry = {"us": us}
            if check is not None:
                poison()
                entry["rel_err"] = rel_err(jax.jit(fn)(*args), check)
            res[key] = entry
            print(f"{key:32s} {us:9.1f} us  {entry.get('rel_err', '')}")
        except Exception as e:  # noqa: BLE001
            res[key] = {"error": (type(e).__name__ + ": " + str(e))[:800]}
            print(f"{key:32s} FAILED {res[key]['error'][:400]}")
            traceback.print_exc(limit=3)
        if save is not None:
            save(res)

    key = jax.random.key(seed)
    for name, (k, n, row) in SHAPES.items():
        if only and name not in only:
            continue
        key, kx, kw = jax.random.split(key, 3)
        kk = k * tp if row else k
        x = jax.random.normal(kx, (M, kk), jnp.float32)
        w = jax.random.normal(kw, (n, kk), jnp.float32)
        x8 = (x * 16).astype(jnp.float8_e4m3fn)
        w8 = (w * 16).astype(jnp.float8_e4m3fn)
        sx = jnp.float32(1 / 16)
        sw = jnp.float32(1 / 32)
        scale = sx * sw
        flop = 2 * M * k * n

        def gemm(x8, w8, acc):
            return (fp8_dot(x8, w8, acc).astype(jnp.float32) * scale).astype(jnp.bfloat16)

        # Single-device GEMM on this device's shard.
        xl = jax.device_put(x8[:, :k], devs[0])
        wl = jax.device_put(w8[:, :k], devs[0])
        ref_local = (xl.astype(jnp.float32) @ wl.astype(jnp.float32).T) * scale
        a_bf, b_bf = jnp.bfloat16(1 / 16), jnp.bfloat16(1 / 32)  # exact in bf16
        record(f"{name}/xla_fp8_gemm_dequant",
               lambda a, b: dequant_dot(a, a_bf, b, b_bf, jnp.bfloat16), (xl, wl), ref_local)
        for acc_name, acc in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
            record(f"{name}/xla_fp8_gemm_{acc_name}", functools.partial(gemm, acc=acc),
                   (xl, wl), ref_local)
        xl768 = jnp.pad(xl, ((0, 768 - M), (0, 0)))
        record(f"{name}/xla_fp8_gemm_dequant_m768",
               lambda a, b: dequant_dot(a, a_bf, b, b_bf, jnp.bfloat16), (xl768, wl))
        xb = jax.device_put((x[:, :k] / 4).astype(jnp.bfloat16), devs[0])
        wq = Fp8Weight(values=wl, scale=jax.device_put(jnp.float32(0.0104), devs[0]))
        record(f"{name}/xla_fp8_gemm_linear", lambda a, w: linear(a, w), (xb, wq))
        res[f"{name}/flop"] = flop
        if row:
            for cname, cfg in list(CONFIGS.items())[:1]:
                record(f"{name}/pallas_fp8_gemm_tp1{cname}", jax.shard_map(
                    lambda a, b, cfg=cfg: fused.gemm_allreduce(a, b, sw, x_scale=sx, config=cfg,
                                                               use_kernel=True),
                    mesh=mesh1, in_specs=(P(), P()), out_specs=P(), check_vma=False),
                    (xl, wl), ref_local)
        if not row:
            continue

        # Row-parallel: shards over K on 2 devices.
        spec = NamedSharding(mesh, P(None, "tp"))
        xs = jax.device_put(x8, spec)
        ws = jax.device_put(w8, spec)
        ref = (x8.astype(jnp.float32) @ w8.astype(jnp.float32).T) * scale
        smap = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                                       out_specs=P(), check_vma=False)
        part = jax.device_put(jnp.zeros((M * tp, n), jnp.bfloat16) + 1, NamedSharding(mesh, P("tp")))
        record(f"{name}/allreduce_psum", jax.shard_map(
            lambda p: lax.psum(p, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P(),
            check_vma=False), (part,))
        record(f"{name}/gemm+psum", smap(
            lambda a, b: lax.psum(gemm(a, b, jnp.float32), "tp")), (xs, ws), ref)

        for cname, cfg in CONFIGS.items():
            record(f"{name}/fused_pallas{cname}", smap(
                lambda a, b, cfg=cfg: fused.gemm_allreduce(a, b, sw, x_scale=sx, config=cfg,
                                                           use_kernel=True)),
                (xs, ws), ref)
        def ring(a, b):
            mc = -(-M // tp)
            ap = jnp.pad(a, ((0, mc * tp - M), (0, 0)))
            chunk = lambda c: gemm(lax.dynamic_slice_in_dim(ap, c * mc, mc), b, jnp.float32)
            return row_parallel._ring_all_reduce_rows(chunk, M, tp, "tp")

        record(f"{name}/ppermute_ring", smap(ring), (xs, ws), ref)

    # One block: attention-out + MLP-down summed, one reduction, through the model's API
    # (activations quantized inside, per tensor, on the device).
    if not only or "block" in only:
        key, k1, k2, k3, k4 = jax.random.split(key, 5)
        ko, kd = SHAPES["o"][0] * tp, SHAPES["down"][0] * tp
        a = jax.random.normal(k1, (M, ko), jnp.bfloat16)
        b = jax.random.normal(k2, (M, kd), jnp.bfloat16)
        wo = quantize_weight(jax.random.normal(k3, (D, ko), jnp.float32) / 64)
        wd = quantize_weight(jax.random.normal(k4, (D, kd), jnp.float32) / 128)
        ref = (a.astype(jnp.float32) @ wo.dequantize().T + b.astype(jnp.float32) @ wd.dequantize().T)
        xsp = NamedSharding(mesh, P(None, "tp"))
        wsp = Fp8Weight(values=NamedSharding(mesh, P(None, "tp")), scale=NamedSharding(mesh, P()))
        args = (jax.device_put(a, xsp), jax.device_put(b, xsp),
                jax.device_put(wo, wsp), jax.device_put(wd, wsp))
        wspec = Fp8Weight(values=P(None, "tp"), scale=P())
        for method in ("psum", "pallas"):
            record(f"block/{method}", jax.shard_map(
                lambda a, b, wo, wd, method=method: row_parallel.row_parallel_matmul_reduce(
                    [(a, wo), (b, wd)], method=method),
                mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), wspec, wspec),
                out_specs=P(), check_vma=False), args, ref)
    return res


def summarize(res):
    rows = []
    for name, (k, n, row) in SHAPES.items():
        g = res.get(f"{name}/xla_fp8_gemm_f32", {}).get("us")
        gb = res.get(f"{name}/xla_fp8_gemm_bf16", {}).get("us")
        gd = res.get(f"{name}/xla_fp8_gemm_dequant", {}).get("us")
        t = res.get(f"{name}/torch_scaled_mm", {}).get("us")
        flop = 2 * M * k * n
        line = {"shape": f"{name} {M}x{k}x{n}", "xla_gemm_us": g, "xla_gemm_bf16_us": gb,
                "xla_gemm_dequant_us": gd,
                "xla_gemm_dequant_m768_us": res.get(f"{name}/xla_fp8_gemm_dequant_m768", {}).get("us"),
                "linear_api_us": res.get(f"{name}/xla_fp8_gemm_linear", {}).get("us"),
                "torch_mm_us": t}
        best = min([v for v in (g, gb, gd) if v] or [None]) if (g or gb or gd) else None
        if best and t:
            line["xla_over_torch"] = best / t
            line["xla_tflops"] = flop / best / 1e6
            line["torch_tflops"] = flop / t / 1e6
        if row:
            ar = res.get(f"{name}/allreduce_psum", {}).get("us")
            fused_keys = [kk for kk in res if kk.startswith(f"{name}/fused_pallas")]
            ok = [kk for kk in fused_keys if "us" in res[kk]]
            if ok:
                best_key = min(ok, key=lambda kk: res[kk]["us"])
                res[f"{name}/fused_best"] = dict(res[best_key], config=best_key)
            for v in ("gemm+psum", "ppermute_ring", "fused_pallas", "fused_best"):
                tv = res.get(f"{name}/{v}", {}).get("us")
                line[f"{v}_us"] = tv
                if tv and g and ar:
                    line[f"{v}_hidden"] = (g + ar - tv) / ar
            line["allreduce_us"] = ar
            line["fused_best_config"] = res.get(f"{name}/fused_best", {}).get("config")
            line["pallas_tp1_us"] = res.get(f"{name}/pallas_fp8_gemm_tp1", {}).get("us")
            line["torch_ar_us"] = res.get(f"{name}/torch_allreduce", {}).get("us")
            line["torch_mm+ar_us"] = res.get(f"{name}/torch_mm+allreduce", {}).get("us")
        rows.append(line)
    rows.append({"shape": "block o+down (API, quantize inside)",
                 **{f"{m}_us": res.get(f"block/{m}", {}).get("us")
                    for m in ("psum", "pallas")}})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--shrink", type=int, default=1, help="divide K and N (CPU smoke runs)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the remaining JAX variants after this many seconds")
    args = ap.parse_args()
    for name, (k, n, row) in list(SHAPES.items()):
        SHAPES[name] = (k // args.shrink, n // args.shrink, row)
    os.makedirs(args.out, exist_ok=True)
    res = {}
    if not args.skip_torch:
        try:
            res.update(run_torch(args.out, args.reps))
        except Exception as e:  # noqa: BLE001
            res["torch"] = {"error": repr(e)[:500]}
            traceback.print_exc()
    t_start = T0
    out_json = os.path.join(args.out, "gemm_allreduce.json")

    def save(partial):
        with open(out_json, "w") as f:
            json.dump({"raw": {**res, **partial}, "partial": True}, f, indent=1)

    deadline = t_start + args.budget_s if args.budget_s else None
    res.update(run_jax(args.reps, args.repeats, args.only, deadline=deadline, save=save))
    rows = summarize(res)
    with open(out_json, "w") as f:
        json.dump({"raw": res, "summary": rows}, f, indent=1)
    print("\n==== summary (microseconds; hidden = share of the psum all-reduce hidden) ====")
    for r in rows:
        print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    errs = {k: v["rel_err"] for k, v in res.items() if isinstance(v, dict) and "rel_err" in v}
    print("rel_err:", {k: round(v, 5) for k, v in errs.items()})
    fails = {k: v["error"][:120] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    print("failures:", fails)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
