"""FP8 ring-cache attention: the Pallas kernel against cuDNN, XLA and PyTorch SDPA.

One attention call of a config per GPU at each tensor-parallel size of ``--tp`` (heads =
num_heads / tp): Tq new queries (characters-57b: 757) over the cache's S slots (5,788: the
sink, whose prompt slots past a 298-token prompt are masked, then the ring; ``_common.Shapes``), head_dim D.
FLOPs counted: 4 Tq S D H.

  pallas        ``attention_pallas`` (FP8 K/V as the cache stores them; NVIDIA sm_90 only)
  cudnn, xla    ``jax.nn.dot_product_attention`` on bf16 K/V (dequantized once, outside
                the timing), the slot mask as a boolean mask
  torch_cudnn   PyTorch SDPA, cuDNN backend, on the same bf16 K/V and mask
  reference     float32 jnp (``attention_reference``; only with ``--impls reference``)

Time: the kernels' device time per call through CUPTI (jax's Mosaic GPU profiler hook),
summed over the kernels of one call, median over ``--repeats`` calls; the host clock where
CUPTI is missing (CPU). Checks against the float32 reference on fresh random inputs with
outlier rows: relative error, and for the kernel that masked slots have no influence (their
K/V replaced by large values, the output must not change) and that every output is finite.

    python3 benchmarks/bench_attention.py --config characters-57b --tp 1,2,4 --out $OUT
    python3 benchmarks/bench_attention.py --smoke        # CPU: tiny config, xla and reference
"""

from __future__ import annotations

import statistics
import sys
import time

from _common import (Results, Shapes, default_out, finish, load_shapes, names_of, parser, rel_err,
                     torch_cuda_missing)

IMPLS = ("pallas", "cudnn", "xla", "torch_cudnn", "reference")


def make_inputs(s: Shapes, seed: int):
    """(q [Tq, H, D] bf16, k8, v8 [S, H, D] e4m3, k_scale, v_scale [H] f32, valid [S] bool)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import fp8_attention as fa

    kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (s.tokens, s.heads, s.head_dim), jnp.float32)
    q = q.at[jax.random.randint(ko, (8,), 0, s.tokens)].multiply(6.0)  # outlier rows
    k = jax.random.normal(kk, (s.slots, s.heads, s.head_dim), jnp.float32) * 1.5
    k = k.at[:40].multiply(4.0)
    v = jax.random.normal(kv, (s.slots, s.heads, s.head_dim), jnp.float32)
    k8, ks = fa.quantize_kv(k)
    v8, vs = fa.quantize_kv(v)
    valid = np.ones((s.slots,), bool)
    valid[s.sink_slots - s.masked_slots:s.sink_slots] = False
    return q.astype(jnp.bfloat16), k8, v8, ks, vs, jnp.asarray(valid)


def device_time_us(fn, iters: int, sync=None) -> float:
    """Median per-call device time (us) of ``fn()``: the CUPTI kernel durations of each call
    summed; the host clock (each call to completion) where CUPTI is not available."""
    import jax

    sync = sync or jax.block_until_ready
    sync(fn())
    sync(fn())
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
    except Exception:  # noqa: BLE001 - no CUPTI hook here (CPU, or a jaxlib without it)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            sync(fn())
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    try:
        for o in [fn() for _ in range(iters)]:
            sync(o)
    finally:
        timings = ext._cupti_get_timings(True)
    per = max(1, len(timings) // iters)
    return statistics.median(sum(t for _, t in timings[i * per:(i + 1) * per]) * 1e3
                             for i in range(iters))


def run_case(res: Results, s: Shapes, impls, iters: int, seed: int) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import device
    from pallas_kernels import fp8_attention as fa

    case = f"{s.heads} heads (tp={s.tp})"
    flop = s.attention_flop()
    q, k8, v8, ks, vs, valid = make_inputs(s, seed)
    ref = jax.block_until_ready(jax.jit(fa.attention_reference)(q.astype(jnp.float32), k8, v8, ks, vs, valid))
    kb = (k8.astype(jnp.float32) * ks[None, :, None]).astype(jnp.bfloat16)
    vb = (v8.astype(jnp.float32) * vs[None, :, None]).astype(jnp.bfloat16)
    mask = jnp.broadcast_to(valid[None, None, None, :], (1, 1, s.tokens, s.slots))

    def timed(f, *operands, **checks):
        out = jax.block_until_ready(f(*operands))
        return {"us": device_time_us(lambda: f(*operands), iters), "flop": flop,
                "rel_err": rel_err(out, ref), "finite": bool(jnp.isfinite(out.astype(jnp.float32)).all()),
                **checks}

    def pallas():
        f = jax.jit(fa.attention_pallas)
        out = f(q, k8, v8, ks, vs, valid)
        m = ~valid[:, None, None]
        k2 = jnp.where(m, jnp.full_like(k8, 300.0), k8)
        v2 = jnp.where(m, jnp.full_like(v8, -300.0), v8)
        same = bool((f(q, k2, v2, ks, vs, valid) == out).all())
        return timed(f, q, k8, v8, ks, vs, valid, masked_no_influence=same)

    def dot_product(implementation):
        f = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
            q[None], k[None], v[None], mask=m, implementation=implementation)[0])
        return lambda: timed(f, q, kb, vb, mask)

    for impl in impls:
        if impl == "pallas":
            if not device.is_hopper():
                res.skip(case, impl, "needs an NVIDIA sm_90 GPU")
                continue
            res.measure(case, impl, pallas)
        elif impl in ("cudnn", "xla"):
            if impl == "cudnn" and not device.is_nvidia_gpu():
                res.skip(case, impl, "needs an NVIDIA GPU")
                continue
            res.measure(case, impl, dot_product(impl))
        elif impl == "reference":
            res.measure(case, impl, lambda: timed(jax.jit(fa.attention_reference),
                                                  q.astype(jnp.float32), k8, v8, ks, vs, valid))
        elif impl == "torch_cudnn":
            why = torch_cuda_missing()
            if why:
                res.skip(case, impl, why)
                continue
            res.measure(case, impl, lambda: torch_sdpa(q, kb, vb, valid, ref, iters, flop))


def torch_sdpa(q, kb, vb, valid, ref, iters: int, flop: int) -> dict:
    """PyTorch SDPA (cuDNN backend) on the bf16 K/V and mask, timed like the JAX rows."""
    import numpy as np
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def to_torch(x):  # [T, H, D] -> [1, H, T, D] bf16 on the GPU
        return torch.from_numpy(np.asarray(x, np.float32)).cuda().bfloat16().permute(1, 0, 2)[None]

    tq, tk, tv = to_torch(q), to_torch(kb), to_torch(vb)
    tmask = torch.from_numpy(np.asarray(valid)).cuda()[None, None, None, :].expand(1, 1, tq.shape[2], tk.shape[2])

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)

    out = call()[0].permute(1, 0, 2)
    torch.cuda.synchronize()
    us = device_time_us(call, iters, sync=lambda _: torch.cuda.synchronize())
    return {"us": us, "flop": flop, "rel_err": rel_err(out, ref)}


def main(argv=None) -> int:
    p = parser(__doc__, "1,2,4", "tensor-parallel sizes whose per-GPU heads are timed",
               "CPU check: tiny config, tp 1, xla and reference, 2 iterations")
    p.add_argument("--impls", default=None, help=f"comma-separated, of {IMPLS} (default all but reference)")
    p.set_defaults(repeats=30)  # calls timed
    a = p.parse_args(argv)
    if a.smoke:
        a.config, a.tp, a.repeats = "tiny", "1", 2
        a.impls = a.impls or "xla,reference"
    impls = names_of(a.impls or "pallas,cudnn,xla,torch_cudnn", IMPLS, "bench_attention: impls")
    if impls is None:
        return 2
    import jax

    shapes = [load_shapes(a.config, int(t)) for t in a.tp.split(",")]
    res = Results(a.out or default_out(), "attention",
                  {"config": a.config, "seed": a.seed, "calls": a.repeats, "jax": jax.__version__,
                   "device": jax.devices()[0].device_kind, "tokens": shapes[0].tokens,
                   "slots": shapes[0].slots, "masked_slots": shapes[0].masked_slots})
    for s in shapes:
        run_case(res, s, impls, a.repeats, a.seed + s.tp)
    return finish(res)


if __name__ == "__main__":
    sys.exit(main())
