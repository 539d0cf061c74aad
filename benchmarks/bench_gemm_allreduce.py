"""FP8 GEMMs and row-parallel GEMM + all-reduce at characters-57b per-GPU shapes (tp=2; --tp N).

One run checks every variant against an f32 reference on fresh random inputs
(outputs land in memory first filled with NaN, so an unwritten element shows),
then times it inside one jitted ``lax.fori_loop`` (medians over repeats):

  GEMM alone, one device, pre-quantized operands, bf16 out, every shape (o, down, qkv, up):
    xla_fp8_gemm_f32           XLA FP8 dot to f32, then the scale multiply (the model's
                               form)
    pallas_fp8_gemm            the Pallas kernel alone (the tp = 1 path of the fused
                               kernel, ``stacked_fp8_matmul`` on a [1, N, K] stack): x
                               padded 757 -> 760 and the output sliced back, in the loop
    pallas_fp8_gemm_m760       the same on 760 rows, [760, N] out (no pad / slice: the
                               in-model cost when they fuse into the neighbours)
    torch_scaled_mm            ``torch._scaled_mm`` (cuBLASLt), in the same run
    The summary gives pallas / torch (issue 5's target: within 10%).
  Row-parallel (o, down; K sharded over the --tp GPUs, 2 by default):
    allreduce_psum             ``lax.psum`` of the bf16 [M, N] output (NCCL)
    gemm+psum                  the two in sequence ('psum' method)
    fused_pallas               the fused Pallas GEMM + all-reduce (default Config: entry
                               handshake on)
    fused_pallas_run1sync      the same kernel with run 1's synchronization (no entry
                               handshake): the handshake's cost is the difference
    fused_pallas_s4            the default kernel with 4 pipeline stages instead of 3
    fused_pallas_sk            the fused exchange on the stream-K schedule
                               (``fp8_gemm_allreduce.STREAM_K_CONFIG``: the stacked GEMM's
                               kernel, each finished tile also sent to the peers)
    torch_mm+allreduce         ``_scaled_mm`` then a NCCL all-reduce (torch.distributed)
    gemm+psum+residual         gemm+psum, then the block's consumer as the model has it:
                               x + gate * y (bf16 residual, f32 [N] gate; ``dit.Block``)
    fused_pallas+residual      the fused call, then the same consumer: the kernel's own +
                               received partials sum inside the consumer's pass, as in the
                               model's step
  Block (attention-out + MLP-down, one reduction, the model's API, quantization inside):
    block/psum, block/pallas                   per-layer [N, K] weights
    block/psum_stacked                         stacked [L, N, K] weights read in place, the
                                               two products chained through the epilogue
                                               addend (bf16), then psum
    block/psum_stacked_f32sum                  the previous stacked psum path: two f32
                                               products, an XLA add, bf16, psum (768 rows)
    block/pallas_stacked                       the fused kernel reading the down stack in
                                               place, attention-out as its addend
    block/pallas_stacked_sk                    the same on the stream-K schedule
                                               (method 'pallas-stream-k')
  --full adds: XLA _bf16 (the dot writes bf16) and _linear (``fp8_linear.linear``,
  activations quantized inside), fused configs _m64 / _tma / _tma_m64, the ppermute ring.

hidden = (t_gemm + t_allreduce - t_fused) / t_allreduce, with t_gemm the XLA FP8 GEMM
(``_hidden``) and the Pallas GEMM alone, on the same 757 rows with its pad and slice
(``_hidden_vs_pallas``; the table's "hidden" columns). That GEMM is the stream-K kernel
(the stacked GEMM's default), so the share is like for like for fused_pallas_sk; the
data-parallel fused kernels run a slower GEMM, which their share absorbs.
With the consumer: hidden_in_block = (t[gemm+psum+residual] - t[fused_pallas+residual]) /
t_allreduce, the all-reduce time the block saves (its XLA GEMM replaced by the Pallas one
inside the fused kernel, so read it next to the GEMMs' ratio).

Run (2 GPUs; `--tp 3` / `--tp 4` on a 4-GPU machine, the shapes per GPU follow):
  PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 python3 benchmarks/bench_gemm_allreduce.py --out $OUT
CPU smoke run (small shapes, 2 CPU devices, the Pallas GEMM under the Mosaic GPU
interpreter, the fused variants on their XLA fallback):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python3 \
    benchmarks/bench_gemm_allreduce.py --smoke --skip-torch --out /tmp/bench
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
from _common import MODEL_WIDTH, cuda_event_times_us, per_gpu_shapes, rel_err  # noqa: E402

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLS stays off on the lent machines
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

T0 = time.time()  # the --budget-s clock starts at import
M = 757
M_PAD8 = 760  # the Pallas kernel's row count (TMA tiling: a multiple of 8)
D = MODEL_WIDTH
D_BLOCK = D  # N of the block variants (the model width)
TP = 2  # GPUs of the row-parallel variants (--tp)


SHAPES = per_gpu_shapes(TP)


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
        return statistics.median(cuda_event_times_us(lambda _: fn(), n, repeats))

    for name, (k, n, row) in per_gpu_shapes(world).items():
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
    if torch.cuda.device_count() < TP:
        return {"torch": {"error": f"needs {TP} GPUs"}}
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "torch_raw.json")  # not under --out
    tmp.spawn(_torch_worker, args=(TP, path, reps), nprocs=TP, join=True)
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- jax
def _configs(full):
    from pallas_kernels.fp8_gemm_allreduce import CONFIG_NO_ENTRY_SYNC, STREAM_K_CONFIG, Config

    # _s4: 4 stages of 128 x 256, which fit since the scale is a scalar (BUILD_NOTES)
    # In the order they are timed (a cut budget keeps the first): the default, the stream-K
    # exchange, then the comparisons.
    cfgs = {"": Config(), "_sk": STREAM_K_CONFIG, "_s4": Config(stages=4),
            "_run1sync": CONFIG_NO_ENTRY_SYNC}
    if full:
        cfgs.update({"_tma": Config(reduce="tma_add"),
                     "_tma_m64": Config(reduce="tma_add", tile_m=64, stages=4),
                     "_m64": Config(tile_m=64, stages=4)})
    return cfgs


def run_jax(reps, repeats, only=None, deadline=None, save=None, full=False, smoke=False):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from characters_jax.parallel import row_parallel
    from characters_jax.parallel.fp8_linear import (
        Fp8Weight, fp8_dot, linear, quantize_weight)
    from pallas_kernels import fp8_gemm_allreduce as fused
    from pallas_kernels import fp8_gemm_stacked as stk

    devs = jax.devices()
    tp = TP
    mesh = Mesh(np.array(devs[:tp]), ("tp",))
    res = {}
    CONFIGS = _configs(full)
    on_gpu = fused.is_supported()
    kimpl = "pallas" if on_gpu else "interpret"  # the Pallas GEMM alone
    seed = int(time.time_ns() % 2**31)
    res["meta"] = {"jax": jax.__version__, "devices": [str(d) for d in devs[:tp]], "seed": seed,
                   "m": M, "smoke": smoke, "pallas_gemm_impl": kimpl,
                   "fused_impl": "pallas" if on_gpu else "XLA fallback (no Hopper GPU)"}
    print(f"jax {jax.__version__} devices {devs} seed {seed} pallas gemm: {kimpl}")

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

    def record(key, fn, args, check=None, rows=None):
        """check: the f32 reference of fn's output (its first `rows` rows if given)."""
        if deadline is not None and time.time() > deadline:
            res[key] = {"error": "skipped: out of time"}
            print(f"{key:34s} skipped (deadline)")
            return
        try:
            us = bench(fn, args)
            entry = {"us": us}
            if check is not None:
                poison()
                out = jax.jit(fn)(*args)
                entry["rel_err"] = rel_err(out if rows is None else out[:rows], check)
            res[key] = entry
            print(f"{key:34s} {us:9.1f} us  {entry.get('rel_err', '')}")
        except Exception as e:  # noqa: BLE001
            res[key] = {"error": (type(e).__name__ + ": " + str(e))[:800]}
            print(f"{key:34s} FAILED {res[key]['error'][:400]}")
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
        res[f"{name}/flop"] = 2 * M * k * n

        def gemm(x8, w8, acc):
            return (fp8_dot(x8, w8, acc).astype(jnp.float32) * scale).astype(jnp.bfloat16)

        # One device, this device's shard.
        xl = jax.device_put(x8[:, :k], devs[0])
        wl = jax.device_put(w8[:, :k], devs[0])
        ref_local = (xl.astype(jnp.float32) @ wl.astype(jnp.float32).T) * scale
        xl760 = jnp.pad(xl, ((0, -M % 8), (0, 0)))  # 760 rows
        w1 = wl[None]  # [1, N, K]: the stacked kernel's operand (a copy, outside the timing)
        record(f"{name}/xla_fp8_gemm_f32", functools.partial(gemm, acc=jnp.float32),
               (xl, wl), ref_local)
        record(f"{name}/pallas_fp8_gemm",
               lambda a, b: stk.stacked_fp8_matmul(a, b, 0, scale, impl=kimpl), (xl, w1),
               ref_local)
        record(f"{name}/pallas_fp8_gemm_m760",
               lambda a, b: stk.stacked_fp8_matmul(a, b, 0, scale, impl=kimpl), (xl760, w1),
               ref_local, rows=M)
        if full:
            record(f"{name}/xla_fp8_gemm_bf16", functools.partial(gemm, acc=jnp.bfloat16),
                   (xl, wl), ref_local)
            xb = jax.device_put((x[:, :k] / 4).astype(jnp.bfloat16), devs[0])
            wq = Fp8Weight(values=wl, scale=jax.device_put(jnp.float32(0.0104), devs[0]))
            record(f"{name}/xla_fp8_gemm_linear", lambda a, w: linear(a, w), (xb, wq))
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
                                                           use_kernel=on_gpu)),
                (xs, ws), ref)
        # The block's consumer, x + gate * y, after each reduction (module docstring).
        key, kr, kg = jax.random.split(key, 3)
        resid = jax.device_put(jax.random.normal(kr, (M, n), jnp.bfloat16),
                               NamedSharding(mesh, P()))
        gate = jax.device_put(1.0 + 0.1 * jax.random.normal(kg, (n,), jnp.float32),
                              NamedSharding(mesh, P()))
        ref_res = resid.astype(jnp.float32) + gate * ref
        smap_res = lambda f: jax.shard_map(  # noqa: E731
            lambda a, b, r, g: (r.astype(jnp.float32) + g * f(a, b).astype(jnp.float32)
                                ).astype(jnp.bfloat16),
            mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(), P()), out_specs=P(),
            check_vma=False)
        record(f"{name}/gemm+psum+residual", smap_res(
            lambda a, b: lax.psum(gemm(a, b, jnp.float32), "tp")), (xs, ws, resid, gate),
            ref_res)
        for cname, cfg in (("", None), ("_sk", fused.STREAM_K_CONFIG)):
            record(f"{name}/fused_pallas{cname}+residual", smap_res(
                lambda a, b, cfg=cfg: fused.gemm_allreduce(a, b, sw, x_scale=sx, config=cfg,
                                                           use_kernel=on_gpu)),
                (xs, ws, resid, gate), ref_res)
        if full:
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
        wo = quantize_weight(jax.random.normal(k3, (D_BLOCK, ko), jnp.float32) / 64)
        wd = quantize_weight(jax.random.normal(k4, (D_BLOCK, kd), jnp.float32) / 128)
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

        # Stacked weights: a 2-layer stack whose block 1 is the weight above (the kernels
        # read it in place at layer 1; layer 0 is other data).
        def stack2(w):
            vals = jnp.stack([jnp.flip(w.values, 0), w.values])
            return Fp8Weight(values=vals, scale=jnp.stack([w.scale * 2, w.scale]))
        ssp = Fp8Weight(values=NamedSharding(mesh, P(None, None, "tp")),
                        scale=NamedSharding(mesh, P()))
        sargs = (args[0], args[1], jax.device_put(stack2(wo), ssp), jax.device_put(stack2(wd), ssp))
        sspec = Fp8Weight(values=P(None, None, "tp"), scale=P())
        at1 = lambda w: Fp8Weight(values=w.values, scale=w.scale, layer=jnp.int32(1))  # noqa: E731

        def psum_f32sum(a, b, wo, wd):
            """The stacked psum path before the addend chain: two f32 outputs, add, bf16."""
            m16 = -(-M // row_parallel.ROW_ALIGN) * row_parallel.ROW_ALIGN  # 768
            pairs = [(row_parallel._pad_rows(a, m16), at1(wo)), (row_parallel._pad_rows(b, m16), at1(wd))]
            acc = None
            for x_, w_ in pairs:
                y = linear(x_, w_, out_dtype=jnp.float32)
                acc = y if acc is None else acc + y
            return lax.psum(acc.astype(jnp.bfloat16), "tp")[:M]

        variants = {
            "psum_stacked": lambda a, b, wo, wd: row_parallel.row_parallel_matmul_reduce(
                [(a, at1(wo)), (b, at1(wd))], method="psum"),
            "psum_stacked_f32sum": psum_f32sum,
            "pallas_stacked": lambda a, b, wo, wd: row_parallel.row_parallel_matmul_reduce(
                [(a, at1(wo)), (b, at1(wd))], method="pallas"),
            "pallas_stacked_sk": lambda a, b, wo, wd: row_parallel.row_parallel_matmul_reduce(
                [(a, at1(wo)), (b, at1(wd))], method="pallas-stream-k"),
        }
        for vname, fn in variants.items():
            record(f"block/{vname}", jax.shard_map(
                fn, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), sspec, sspec),
                out_specs=P(), check_vma=False), sargs, ref)
    return res


def summarize(res):
    rows = []
    us = lambda k: (res.get(k) or {}).get("us")  # noqa: E731
    for name, (k, n, row) in SHAPES.items():
        t = us(f"{name}/torch_scaled_mm")
        flop = 2 * M * k * n
        line = {"shape": f"{name} {M}x{k}x{n}", "torch_mm_us": t,
                "xla_post_f32_us": us(f"{name}/xla_fp8_gemm_f32"),
                "pallas_us": us(f"{name}/pallas_fp8_gemm"),
                "pallas_m760_us": us(f"{name}/pallas_fp8_gemm_m760")}
        for v in ("xla_post_f32", "pallas", "pallas_m760"):
            if line[f"{v}_us"] and t:
                line[f"{v}_over_torch"] = line[f"{v}_us"] / t
        if line["pallas_us"]:
            line["pallas_tflops"] = flop / line["pallas_us"] / 1e6
        if t:
            line["torch_tflops"] = flop / t / 1e6
        if row:
            g, gp = line["xla_post_f32_us"], line["pallas_us"]
            ar = us(f"{name}/allreduce_psum")
            for v in ("gemm+psum", "fused_pallas", "fused_pallas_run1sync", "fused_pallas_sk"):
                tv = us(f"{name}/{v}")
                line[f"{v}_us"] = tv
                if tv and g and ar:
                    line[f"{v}_hidden"] = hidden(g, ar, tv)
                if tv and gp and ar and v != "gemm+psum":
                    line[f"{v}_hidden_vs_pallas"] = hidden(gp, ar, tv)
            line["allreduce_us"] = ar
            line["torch_mm+ar_us"] = us(f"{name}/torch_mm+allreduce")
            tu = us(f"{name}/gemm+psum+residual")
            line["gemm+psum+residual_us"] = tu
            for cname in ("", "_sk"):
                tf = us(f"{name}/fused_pallas{cname}+residual")
                line[f"fused_pallas{cname}+residual_us"] = tf
                if tu and tf and ar:
                    line[f"hidden_in_block{cname}"] = (tu - tf) / ar
        rows.append(line)
    rows.append({"shape": "block o+down (API, quantize inside)",
                 **{f"{m}_us": us(f"block/{m}")
                    for m in ("psum", "pallas", "psum_stacked", "psum_stacked_f32sum",
                              "pallas_stacked", "pallas_stacked_sk")}})
    return rows


def hidden(t_gemm, t_allreduce, t_fused):
    """The share of the all-reduce that the fused call hides: (t_gemm + t_ar - t_fused) / t_ar."""
    return (t_gemm + t_allreduce - t_fused) / t_allreduce


def table(res):
    """The short table printed last (also written by gpu_gemm_check.sh)."""
    us = lambda k: (res.get(k) or {}).get("us")  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    r = lambda a, b: "-" if not a or not b else f"{a / b:.2f}"  # noqa: E731
    out = ["GEMM alone (us) | torch _scaled_mm | XLA post f32 | Pallas | Pallas m760 | "
           "Pallas/torch | Pallas m760/torch"]
    for s in SHAPES:
        t = us(f"{s}/torch_scaled_mm")
        p, p760 = us(f"{s}/pallas_fp8_gemm"), us(f"{s}/pallas_fp8_gemm_m760")
        out.append(f"{s} | {f(t)} | {f(us(f'{s}/xla_fp8_gemm_f32'))} | {f(p)} | {f(p760)} | "
                   f"{r(p, t)} | {r(p760, t)}")
    out.append("row-parallel (us) | psum | GEMM+psum | fused | fused run1 sync | fused stream-K | "
               "torch mm+AR | hidden vs Pallas GEMM: fused | run1 sync | stream-K")
    pc = lambda *t: "-" if None in t else f"{hidden(*t):.0%}"  # noqa: E731
    for s in [s for s, (_, _, row) in SHAPES.items() if row]:
        gp, ar = us(f"{s}/pallas_fp8_gemm"), us(f"{s}/allreduce_psum")
        out.append(f"{s} | " + " | ".join(f(us(f"{s}/{v}")) for v in (
            "allreduce_psum", "gemm+psum", "fused_pallas", "fused_pallas_run1sync",
            "fused_pallas_sk", "torch_mm+allreduce")) + " | " + " | ".join(
            pc(gp, ar, us(f"{s}/fused_pallas{v}")) for v in ("", "_run1sync", "_sk")))
    out.append("with the consumer x + gate * y (us) | GEMM+psum+residual | fused+residual | "
               "fused stream-K+residual | hidden in the block: fused | stream-K")
    for s in [s for s, (_, _, row) in SHAPES.items() if row]:
        tu, ar = us(f"{s}/gemm+psum+residual"), us(f"{s}/allreduce_psum")
        tfs = [us(f"{s}/fused_pallas{v}+residual") for v in ("", "_sk")]
        out.append(f"{s} | {f(tu)} | " + " | ".join(f(t) for t in tfs) + " | " + " | ".join(
            "-" if None in (tu, t, ar) else f"{(tu - t) / ar:.0%}" for t in tfs))
    out.append("block o+down (us) | psum | pallas | psum stacked (addend chain) | "
               "psum stacked (f32 sum, before) | pallas stacked | pallas stacked stream-K")
    out.append("block | " + " | ".join(f(us(f"block/{v}")) for v in (
        "psum", "pallas", "psum_stacked", "psum_stacked_f32sum", "pallas_stacked",
        "pallas_stacked_sk")))
    errs = {k: round(v["rel_err"], 5) for k, v in res.items()
            if isinstance(v, dict) and "rel_err" in v}
    bad = {k: e for k, e in errs.items() if not (e < (3e-2 if k.startswith("block") else 1e-2))}
    out.append(f"rel_err max {max(errs.values()) if errs else '-'}; over bound: "
               f"{bad if bad else 'none'}")
    fails = {k: v["error"][:100] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    out.append(f"failures: {fails if fails else 'none'}")
    return "\n".join(out)


def main():
    global M, D_BLOCK, TP
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--tp", type=int, default=2, help="GPUs of the row-parallel variants (shapes per GPU follow)")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--full", action="store_true", help="also the secondary variants")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: small tileable shapes, M = 37, 2 reps, Pallas GEMM interpreted")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the remaining JAX variants after this many seconds")
    args = ap.parse_args()
    TP = args.tp
    SHAPES.update(per_gpu_shapes(TP))
    if args.smoke:
        M, D_BLOCK = 37, 256
        SHAPES.update({"o": (128, 256, True), "down": (256, 256, True),
                       "qkv": (128, 512, False), "up": (128, 256, False)})
        args.reps, args.repeats = min(args.reps, 2), min(args.repeats, 1)
    os.makedirs(args.out, exist_ok=True)
    res = {}
    if not args.skip_torch:
        try:
            res.update(run_torch(args.out, args.reps))
        except Exception as e:  # noqa: BLE001
            res["torch"] = {"error": repr(e)[:500]}
            traceback.print_exc()
    out_json = os.path.join(args.out, "gemm_allreduce.json")

    def save(partial):
        with open(out_json, "w") as f:
            json.dump({"raw": {**res, **partial}, "partial": True}, f, indent=1)

    deadline = T0 + args.budget_s if args.budget_s else None
    res.update(run_jax(args.reps, args.repeats, args.only, deadline=deadline, save=save,
                       full=args.full, smoke=args.smoke))
    rows = summarize(res)
    tab = table(res)
    with open(out_json, "w") as f:
        json.dump({"raw": res, "summary": rows, "table": tab}, f, indent=1)
    print("\n==== summary (microseconds; hidden = share of the psum all-reduce hidden) ====")
    for r in rows:
        print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print(f"\n==== FP8 GEMM + all-reduce ({time.time() - T0:.0f} s) ====")
    print(tab)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
