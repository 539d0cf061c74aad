"""One characters-57b block at tp=2 per-GPU shapes: PyTorch (cuBLASLt, cuDNN, NCCL) vs JAX.

The same block on both stacks, per GPU (M = 757 new tokens, d = 9216, 36 local heads x 128,
MLP 16128 local columns, 5,788 cache slots):

    h = rmsnorm(x) * (1 + scale) + shift                      bf16 [M, d]
    q, k, v = linear(h, W_qkv)                                FP8 GEMM [M, 9216] x [13824, 9216]^T
    q, k = rmsnorm(q) * g_q, rmsnorm(k) * g_k; rope(q), rope(k)
    cache[offset : offset + M] = k, v                         torch: bf16 copy; JAX: FP8 with per-head scales
    o = attention(q, cache)                                    [36, 757 x 5788]: torch cuDNN SDPA bf16;
                                                              JAX cuDNN (bf16 dequantized) or Pallas FP8
    y = linear(o, W_out) + linear(gelu(linear(h, W_up)), W_down)   FP8 GEMMs
    y = all_reduce(y)                                          757 x 9216 bf16 over 2 GPUs (NCCL)
    x = x + gate * y

`linear` quantizes its activation to e4m3 with a per-tensor scale from its absolute maximum
(on the device) and runs one FP8 GEMM with the weight stored (N, K): PyTorch
`torch._scaled_mm(x8, w8.t(), ...)` (b column-major), JAX `characters_jax.parallel.fp8_linear.linear`.

Timing. PyTorch: CUDA events around `iters` back-to-back calls, after a warm-up, median over
`reps`; the all-reduce and the block run in 2 processes (torch.multiprocessing spawn, NCCL,
NCCL_NVLS_ENABLE=0), one per GPU. JAX: each op runs `iters` times inside one jitted
`lax.fori_loop` (a carried dependency keeps XLA from hoisting it), median over `reps`; the
psum and the block run under `shard_map` over the GPUs. PyTorch runs first, in its own
processes, then JAX in this one (never both at once).

Prints JAX/PyTorch time ratios per component and for the block and writes
`$OUT/block_reference.json` (or --json). Without torch (or CUDA) the torch side is skipped.
`--dry-run`: small shapes, few iterations, CPU is fine (FP8 / cuDNN / NCCL parts fall back
and say so in the JSON).

    python3 benchmarks/torch_block_reference.py                 # GPU machine, 2 GPUs
    python3 benchmarks/torch_block_reference.py --dry-run       # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

F8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-GPU shapes of one block. tokens M, model width d, local heads x head_dim, local MLP
    columns, cache slots S (the new tokens go to slots [offset, offset + M))."""

    tokens: int = 757
    d_model: int = 9216
    heads: int = 36
    head_dim: int = 128
    mlp: int = 16128
    slots: int = 5788
    offset: int = 5788 - 757

    @property
    def qkv_n(self) -> int:
        return self.heads * 3 * self.head_dim

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    def gemms(self) -> dict[str, tuple[int, int, int]]:
        """name -> (M, K, N)."""
        m, d = self.tokens, self.d_model
        return {"qkv": (m, d, self.qkv_n), "out": (m, self.attn_width, d), "up": (m, d, self.mlp), "down": (m, self.mlp, d)}

    def flops(self) -> dict[str, float]:
        f = {k: 2.0 * m * k_ * n for k, (m, k_, n) in self.gemms().items()}
        f["attention"] = 4.0 * self.tokens * self.slots * self.heads * self.head_dim
        return f


DRY_SHAPES = Shapes(tokens=40, d_model=256, heads=2, head_dim=128, mlp=512, slots=300, offset=260)


def _median(xs):
    return float(statistics.median(xs)) if xs else None


# ==========================================================================================
# PyTorch side (runs in spawned worker processes, one per GPU)
# ==========================================================================================


def _torch_components(rank: int, world: int, sh: Shapes, iters: int, reps: int, warmup: int, on_gpu: bool) -> dict:
    """Times every component and the block on this rank; returns {name: ms per call} and notes."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dev = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    bf16 = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator(device=dev).manual_seed(rank + 1)
    notes: list[str] = []

    def randn(*shape, dtype=bf16, std=1.0):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * std).to(dtype)

    fp8 = getattr(torch, "float8_e4m3fn", None)
    one = torch.ones((), device=dev, dtype=torch.float32)

    def scaled_mm_ok() -> bool:
        if fp8 is None:
            return False
        try:
            a = torch.zeros(16, 32, device=dev).to(fp8)
            b = torch.zeros(16, 32, device=dev).to(fp8)
            torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=bf16)
            return True
        except Exception as e:  # no FP8 GEMM on this device / build
            notes.append(f"_scaled_mm unavailable ({type(e).__name__}): GEMMs in {bf16}")
            return False

    use_fp8 = scaled_mm_ok()
    weights = {}
    for name, (_, k, n) in sh.gemms().items():
        w = randn(n, k, dtype=torch.float32)  # (N, K) row-major: K-major
        weights[name] = (w.to(fp8), one * (k**-0.5)) if use_fp8 else (w.to(bf16) * (k**-0.5), None)

    def quantize(x):
        scale = x.abs().amax().float().clamp(min=1e-12) / F8_MAX
        return (x.float() / scale).clamp(-F8_MAX, F8_MAX).to(fp8), scale

    def gemm8(x8, sx, name):
        w, sw = weights[name]
        return torch._scaled_mm(x8, w.t(), scale_a=sx, scale_b=sw, out_dtype=bf16)

    def linear(x, name):
        w, sw = weights[name]
        if not use_fp8:
            return x @ w.t()
        x8, sx = quantize(x)
        return gemm8(x8, sx, name)

    m, d, hh, hd = sh.tokens, sh.d_model, sh.heads, sh.head_dim
    x0 = randn(m, d)
    mod = randn(3, d, dtype=torch.float32, std=0.1)
    g_q = torch.ones(hd, device=dev, dtype=bf16)
    g_k = torch.ones(hd, device=dev, dtype=bf16)
    ang = torch.rand(m, hd // 2, generator=gen, device=dev) * 6.28
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    k_cache = randn(sh.slots, hh, hd)
    v_cache = randn(sh.slots, hh, hd)

    def rms(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def rope(x):
        xf = x.float()
        x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)

    sdpa_ctx = None
    if on_gpu:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            sdpa_ctx = lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)  # noqa: E731
        except Exception as e:
            notes.append(f"cuDNN SDPA backend not selectable ({e}); default SDPA backend")
    else:
        notes.append("CPU: default SDPA backend")

    cudnn_ok = [sdpa_ctx is not None]

    def attention(q):
        """q [M, H, D] over the cache [S, H, D] (all slots valid: no mask) -> [M, H, D]."""
        qh = q.transpose(0, 1)[None]  # [1, H, M, D], strided views as torch users write them
        kh, vh = k_cache.transpose(0, 1)[None], v_cache.transpose(0, 1)[None]
        if cudnn_ok[0]:
            try:
                with sdpa_ctx():
                    return F.scaled_dot_product_attention(qh, kh, vh)[0].transpose(0, 1)
            except RuntimeError as e:  # cuDNN refused these operands: say so, use the default
                cudnn_ok[0] = False
                notes.append(f"cuDNN SDPA failed ({str(e)[:200]}); default SDPA backend")
        return F.scaled_dot_product_attention(qh, kh, vh)[0].transpose(0, 1)

    def all_reduce(y):
        if world > 1:
            dist.all_reduce(y)
        return y

    def pre(x):
        return (rms(x).float() * (1 + mod[1]) + mod[0]).to(bf16)

    def qk_prep(qkv):
        qkv = qkv.view(m, hh, 3, hd)
        q = rope(rms(qkv[:, :, 0]) * g_q)
        k = rope(rms(qkv[:, :, 1]) * g_k)
        return q, k, qkv[:, :, 2]

    def block(x):
        h = pre(x)
        q, k, v = qk_prep(linear(h, "qkv"))
        k_cache[sh.offset : sh.offset + m].copy_(k)
        v_cache[sh.offset : sh.offset + m].copy_(v)
        o = attention(q).reshape(m, -1)
        y = linear(o, "out") + linear(F.gelu(linear(h, "up"), approximate="tanh"), "down")
        y = all_reduce(y)
        return (x.float() + mod[2] * y.float()).to(bf16)

    # Inputs of the single components.
    h0 = pre(x0)
    qkv0 = linear(h0, "qkv")
    q0, k0, v0 = qk_prep(qkv0)
    o0 = attention(q0).reshape(m, -1)
    up0 = F.gelu(linear(h0, "up"), approximate="tanh")
    y0 = randn(m, d, std=1e-3)
    x8, sx = quantize(h0) if use_fp8 else (None, None)

    def elementwise():
        h = pre(x0)
        q, k, v = qk_prep(qkv0)
        g = F.gelu(up0, approximate="tanh")
        return h, q, k, g, (x0.float() + mod[2] * y0.float()).to(bf16)

    def cache_write():
        k_cache[sh.offset : sh.offset + m].copy_(k0)
        v_cache[sh.offset : sh.offset + m].copy_(v0)

    state = {"x": x0.clone()}

    def block_step():
        state["x"] = block(state["x"])

    cases = {
        "qkv": lambda: linear(h0, "qkv"),
        "out": lambda: linear(o0, "out"),
        "up": lambda: linear(h0, "up"),
        "down": lambda: linear(up0, "down"),
        "attention": lambda: attention(q0),
        "elementwise": elementwise,
        "cache_write": cache_write,
        "block": block_step,
    }
    if use_fp8:
        cases["qkv_gemm_only"] = lambda: gemm8(x8, sx, "qkv")
    if world > 1:
        cases["all_reduce"] = lambda: all_reduce(y0)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(dev)

    results = {}
    for name, fn in cases.items():
        try:
            for _ in range(warmup):
                fn()
            sync()
            if world > 1:
                dist.barrier()
            times = []
            for _ in range(reps):
                if on_gpu:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(iters):
                        fn()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / iters)
                else:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    times.append((time.perf_counter() - t0) * 1e3 / iters)
            results[name] = _median(times)
        except Exception as e:  # keep the other components (the ranks fail alike; a hang is cut by the timeout)
            notes.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    return {"ms": results, "notes": notes, "fp8": use_fp8, "dtype": str(bf16), "world": world,
            "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu"}


def _torch_worker(rank: int, world: int, shapes: dict, iters: int, reps: int, warmup: int, port: int, out_path: str, on_gpu: bool):
    import torch
    import torch.distributed as dist

    try:
        if on_gpu:
            torch.cuda.set_device(rank)
        if world > 1:
            dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        res = _torch_components(rank, world, Shapes(**shapes), iters, reps, warmup, on_gpu)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(res))


def run_torch(sh: Shapes, iters: int, reps: int, warmup: int, timeout_s: float, tmp_dir: pathlib.Path) -> dict:
    """The PyTorch side in `world` spawned processes (one per GPU, at most 2). {} if torch is missing."""
    try:
        import torch
        import torch.multiprocessing as mp
    except Exception as e:
        return {"skipped": f"torch not importable: {e}"}
    on_gpu = torch.cuda.is_available()
    world = min(2, torch.cuda.device_count()) if on_gpu else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = tmp_dir / "torch_rank0.json"
    out_path.unlink(missing_ok=True)
    ctx = mp.spawn(_torch_worker, args=(world, dataclasses.asdict(sh), iters, reps, warmup, port, str(out_path), on_gpu),
                   nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                return {"error": f"torch workers timed out after {timeout_s:.0f} s"}
    except Exception as e:  # a worker died
        if not out_path.exists():
            return {"error": f"torch workers failed: {type(e).__name__}: {e}"}
    return json.loads(out_path.read_text()) if out_path.exists() else {"error": "no result from rank 0"}


# ==========================================================================================
# JAX side (this process)
# ==========================================================================================


def run_jax(sh: Shapes, iters: int, reps: int, warmup: int, attention_impls: tuple[str, ...], gemm: str = "auto") -> dict:
    """Times the same components with the project's pieces; returns {"ms": {...}, "notes": [...]}.

    gemm: 'xla' (XLA's FP8 GEMM on an [N, K] weight) | 'stacked' (the Pallas FP8 GEMM the
    model's scan uses, on a one-layer stack [1, N, K], layer 0) | 'auto' (stacked on Hopper)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from characters_jax.model.dit import rms_norm
    from characters_jax.model.rope import apply_rope
    from characters_jax.parallel.fp8_linear import Fp8Weight, fp8_dot, linear, quantize_activation
    from pallas_kernels.fp8_attention import attention, quantize_kv

    notes: list[str] = []
    on_gpu = jax.default_backend() == "gpu"
    devs = jax.devices()[:2]
    mesh = Mesh(devs, ("tp",))
    bf16 = jnp.bfloat16
    f8 = jnp.float8_e4m3fn
    m, d, hh, hd = sh.tokens, sh.d_model, sh.heads, sh.head_dim
    keys = iter(jax.random.split(jax.random.key(0), 32))

    def randn(shape, dtype=bf16, std=1.0):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    if gemm == "auto":
        from pallas_kernels import fp8_gemm_stacked

        gemm = "stacked" if fp8_gemm_stacked.is_supported() else "xla"
    notes.append(f"JAX FP8 GEMMs: {gemm}")
    if gemm == "stacked":
        weights = {name: Fp8Weight(values=randn((1, n, k), f8), scale=jnp.full((1,), k**-0.5, jnp.float32), layer=jnp.int32(0))
                   for name, (_, k, n) in sh.gemms().items()}
    else:
        weights = {name: Fp8Weight(values=randn((n, k), f8), scale=jnp.float32(k**-0.5)) for name, (_, k, n) in sh.gemms().items()}
    x0 = randn((m, d))
    mod = randn((3, d), jnp.float32, 0.1)
    g = jnp.ones((hd,), bf16)
    positions = jnp.stack([jnp.full((m,), 7), jnp.arange(m) // 34, jnp.arange(m) % 34], 1).astype(jnp.int32)
    from characters_jax.model.rope import rope_frequencies

    freqs = jnp.asarray(rope_frequencies(hd, (hd // 8, 3 * hd // 16, 3 * hd // 16), 10000.0))
    k8, k_scale = quantize_kv(randn((sh.slots, hh, hd)))
    v8, v_scale = quantize_kv(randn((sh.slots, hh, hd)))
    valid = jnp.ones((sh.slots,), bool)
    k_bf, v_bf = randn((sh.slots, hh, hd)), randn((sh.slots, hh, hd))

    def pre(x, mod):
        return (rms_norm(x).astype(jnp.float32) * (1.0 + mod[1]) + mod[0]).astype(bf16)

    def qk_prep(qkv):
        qkv = qkv.reshape(m, hh, 3, hd)
        q = apply_rope(rms_norm(qkv[:, :, 0]) * g, positions, freqs)
        k = apply_rope(rms_norm(qkv[:, :, 1]) * g, positions, freqs)
        return q, k, qkv[:, :, 2]

    def write(cache, scale, new):
        new8 = (new.astype(jnp.float32) / scale[None, :, None]).clip(-F8_MAX, F8_MAX).astype(f8)
        return jax.lax.dynamic_update_slice(cache, new8, (sh.offset, 0, 0))

    def touch(c, y):
        """c with one element nudged by 0 * y: a carried dependency that XLA cannot hoist."""
        if not jnp.issubdtype(c.dtype, jnp.floating) or c.dtype == f8:
            return c
        y0 = jax.tree.leaves(y)[0].reshape(-1)[0].astype(jnp.float32)
        idx = (0,) * c.ndim
        return c.at[idx].set((c[idx].astype(jnp.float32) + 0.0 * y0).astype(c.dtype))

    def loop_timer(op, inputs, consts, *, sharded=False, recurrent=False):
        """ms per call of op(inputs, consts), `iters` calls per jitted fori_loop, median of `reps`.

        The loop carries (inputs, last output): every output is materialized, and each call's
        inputs depend on the previous output (one element, times 0). recurrent: op's output is
        the next call's inputs (the block)."""
        if recurrent:
            def run(carry, consts):
                return jax.lax.fori_loop(0, iters, lambda i, c: op(c, consts), carry)
        else:
            def run(carry, consts):
                def body(i, c):
                    x, _ = c
                    y = op(x, consts)
                    return jax.tree.map(lambda a: touch(a, y), x), y
                return jax.lax.fori_loop(0, iters, body, carry)

        if sharded:
            run = jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        fn = jax.jit(run)
        if recurrent:
            carry = inputs
        else:
            shape_fn = jax.shard_map(op, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False) if sharded else op
            y_shape = jax.eval_shape(shape_fn, inputs, consts)
            carry = (inputs, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), y_shape))
        if sharded:
            carry, consts = jax.device_put((carry, consts), NamedSharding(mesh, P()))
        for _ in range(warmup):
            jax.block_until_ready(fn(carry, consts))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(carry, consts))
            times.append((time.perf_counter() - t0) * 1e3 / iters)
        return _median(times)

    h0 = pre(x0, mod)
    qkv0 = linear(h0, weights["qkv"])
    q0, kn0, vn0 = qk_prep(qkv0)
    o0 = randn((m, sh.attn_width))
    up0 = jax.nn.gelu(linear(h0, weights["up"]), approximate=True)
    y0 = randn((m, d), std=1e-3)

    def lin_case(name, x):
        return lambda: loop_timer(lambda x, w: linear(x, w), x, weights[name])

    def attn_case(impl):
        def op(c, kv):
            q, ks, vs = c
            return attention(q, kv[0], kv[1], ks, vs, valid, impl=impl)

        return lambda: loop_timer(op, (q0, k_scale, v_scale), (k8, v8))

    def attn_bf16_op(q, kv):
        impl = "cudnn" if on_gpu else "xla"
        return jax.nn.dot_product_attention(q[None], kv[0][None], kv[1][None], implementation=impl)[0]

    def qkv_gemm_only_op(c, w):
        x8, sx = c
        if w.stacked:
            from pallas_kernels.fp8_gemm_stacked import stacked_fp8_matmul

            return stacked_fp8_matmul(x8, w.values, w.layer, sx * w.scale[0])
        return (fp8_dot(x8, w.values, jnp.float32) * (sx * w.scale)).astype(bf16)

    def elementwise_op(c, mod_):
        """Pre-norm + modulation, q/k RMSNorm + RoPE, GELU, residual add (the block's non-GEMM math)."""
        x, qkv, up = c
        h = pre(x, mod_)
        q, k, v = qk_prep(qkv)
        gl = jax.nn.gelu(up, approximate=True)
        res = (x.astype(jnp.float32) + mod_[2] * h.astype(jnp.float32)).astype(bf16)
        return h, q, k, gl, res

    def cache_write_op(c, _):
        """In place, as in the step: the caches are the carry; the new K/V are nudged by them."""
        kc, vc, kn, vn = c
        kc, vc = write(kc, k_scale, kn), write(vc, v_scale, vn)
        return kc, vc, touch(kn, kc), touch(vn, vc)

    def psum_op(y, _):
        return jax.lax.psum(y, "tp")

    def block_op(c, consts, impl):
        x, kc, vc = c
        w, mod_ = consts
        h = pre(x, mod_)
        q, k, v = qk_prep(linear(h, w["qkv"]))
        kc, vc = write(kc, k_scale, k), write(vc, v_scale, v)
        o = attention(q, kc, vc, k_scale, v_scale, valid, impl=impl).reshape(m, -1)
        y = (linear(o, w["out"], jnp.float32) + linear(jax.nn.gelu(linear(h, w["up"]), approximate=True), w["down"], jnp.float32)).astype(bf16)
        if len(devs) > 1:
            y = jax.lax.psum(y, "tp")
        return (x.astype(jnp.float32) + mod_[2] * y.astype(jnp.float32)).astype(bf16), kc, vc

    x8, sx = quantize_activation(h0)
    cases = {}
    for impl in [i for i in attention_impls if i in ("cudnn", "pallas")] or list(attention_impls[:1]):
        cases[f"block_{impl}"] = (lambda impl=impl: loop_timer(
            lambda c, k: block_op(c, k, impl), (x0, k8, v8), (weights, mod), sharded=len(devs) > 1, recurrent=True))
    cases.update({
        "qkv": lin_case("qkv", h0),
        "out": lin_case("out", o0),
        "up": lin_case("up", h0),
        "down": lin_case("down", up0),
        "qkv_gemm_only": lambda: loop_timer(qkv_gemm_only_op, (x8, sx), weights["qkv"]),
        "attention_bf16kv": lambda: loop_timer(attn_bf16_op, q0, (k_bf, v_bf)),
        "elementwise": lambda: loop_timer(elementwise_op, (x0, qkv0, up0), mod),
        "cache_write": lambda: loop_timer(cache_write_op, (k8, v8, kn0, vn0), None, recurrent=True),
    })
    for impl in attention_impls:
        cases[f"attention_{impl}"] = attn_case(impl)
    if len(devs) > 1:
        cases["all_reduce"] = lambda: loop_timer(psum_op, y0, jnp.zeros(()), sharded=True)
    else:
        notes.append("one device: no psum, the block has no all-reduce")
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = fn()
        except Exception as e:  # keep the other components
            notes.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    return {"ms": results, "notes": notes, "backend": jax.default_backend(), "devices": [dv.device_kind for dv in devs], "jax": jax.__version__}


# ==========================================================================================
# Report
# ==========================================================================================

# JAX row -> the PyTorch row it is compared with.
PAIRS = {
    "qkv": "qkv", "out": "out", "up": "up", "down": "down", "qkv_gemm_only": "qkv_gemm_only",
    "attention_bf16kv": "attention", "attention_cudnn": "attention", "attention_pallas": "attention",
    "attention_xla": "attention", "attention_reference": "attention",
    "elementwise": "elementwise", "cache_write": "cache_write", "all_reduce": "all_reduce",
    "block_cudnn": "block", "block_pallas": "block", "block_xla": "block", "block_reference": "block",
}


def report(result: dict) -> str:
    jx, tt = result["jax"].get("ms", {}), result["torch"].get("ms", {})
    flops = result["flops"]
    rows = [f"{'component':<18} {'JAX ms':>9} {'torch ms':>9} {'JAX/torch':>9}  {'JAX TFLOP/s':>11}"]
    for name in sorted(jx, key=lambda n: list(PAIRS).index(n) if n in PAIRS else 99):
        t = tt.get(PAIRS.get(name, name))
        r = result["ratios"].get(name)
        f = flops.get(name.split("_")[0] if name.startswith(("qkv", "out", "up", "down")) else ("attention" if name.startswith("attention") else ""), 0)
        tf = f"{f / (jx[name] * 1e-3) / 1e12:11.1f}" if f and jx[name] else " " * 11
        rows.append(f"{name:<18} {jx[name]:9.4f} {t if t is not None else float('nan'):9.4f} {r if r is not None else float('nan'):9.3f}  {tf}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="small shapes, few iterations (CPU smoke test)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed batch / loop (default 50; dry-run 2)")
    p.add_argument("--reps", type=int, default=None, help="timed batches, median taken (default 7; dry-run 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention", default=None, help="JAX attention impls, comma-separated (default cudnn,pallas on GPU, xla on CPU)")
    p.add_argument("--no-torch", action="store_true", help="JAX side only")
    p.add_argument("--jax-gemm", choices=("auto", "xla", "stacked"), default="auto", help="JAX FP8 GEMM path (auto: the Pallas stacked GEMM on Hopper, as the model)")
    p.add_argument("--torch-timeout", type=float, default=240.0, help="seconds for the PyTorch workers")
    p.add_argument("--json", default=None, help="output path (default $OUT/block_reference.json)")
    a = p.parse_args(argv)

    if a.dry_run and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    sh = DRY_SHAPES if a.dry_run else Shapes()
    iters = a.iters or (2 if a.dry_run else 50)
    reps = a.reps or (2 if a.dry_run else 7)
    out = pathlib.Path(a.json or pathlib.Path(os.environ.get("OUT", "out")) / "block_reference.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        torch_res = {"skipped": "--no-torch"} if a.no_torch else run_torch(sh, iters, reps, a.warmup, a.torch_timeout, pathlib.Path(tmp))
    print(f"[block] torch side in {time.perf_counter() - t0:.1f} s: {torch_res.get('error') or torch_res.get('skipped') or 'ok'}", flush=True)
    if torch_res.get("traceback"):
        print(torch_res["traceback"], file=sys.stderr)

    import jax

    impls = tuple(a.attention.split(",")) if a.attention else (("cudnn", "pallas") if jax.default_backend() == "gpu" else ("xla",))
    t0 = time.perf_counter()
    try:
        jax_res = run_jax(sh, iters, reps, a.warmup, impls, a.jax_gemm)
    except Exception as e:
        jax_res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(jax_res["traceback"], file=sys.stderr)
    print(f"[block] JAX side in {time.perf_counter() - t0:.1f} s", flush=True)

    jx, tt = jax_res.get("ms", {}), torch_res.get("ms", {})
    ratios = {n: jx[n] / tt[PAIRS.get(n, n)] for n in jx if jx[n] and tt.get(PAIRS.get(n, n))}
    result = {
        "shapes": dataclasses.asdict(sh),
        "dry_run": a.dry_run,
        "iters": iters,
        "reps": reps,
        "flops": sh.flops(),
        "torch": torch_res,
        "jax": jax_res,
        "ratios": ratios,
        "pairs": PAIRS,
        "env": {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
    }
    out.write_text(json.dumps(result, indent=2))
    print(report(result))
    for n in ("block_cudnn", "block_pallas"):
        if n in ratios:
            print(f"block JAX/PyTorch ({n.split('_')[1]} attention): {ratios[n]:.3f}  (target <= 1.0)")
    for note in jax_res.get("notes", []) + torch_res.get("notes", []):
        print(f"note: {note}")
    print(f"wrote {out}")
    return 0 if jx else 1


if __name__ == "__main__":
    sys.exit(main())
