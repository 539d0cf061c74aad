"""The stacked FP8 GEMM (weights [L, N, K] read in place at the scan's layer) against XLA's
FP8 dot and PyTorch's ``_scaled_mm``, at one GPU's projections of a config at ``--tp``.

Cases: qkv, out, up, down (one GPU's [N, K] of each), and out+down (attention-out and
MLP-down in one kernel, the lead product's partial summed into the other's, as the step
runs them at tp = 1). The activations are ``rows`` (M rounded up to 8) e4m3 rows with the
config's activation scales (per row: the first M rows' scales, padding rows scaled by 0;
per tensor: one scale), weights N(0, 16^2) in e4m3 with one scale per layer.

  xla              ``fp8_dot(x, w[layer])`` to float32, scaled, bf16 (the model's XLA form:
                   XLA slices the layer, i.e. copies [N, K] every call)
  kernel           ``stacked_fp8_matmul`` with its default tiling (``pick_config``;
                   NVIDIA sm_90 only, or the Mosaic GPU interpreter with ``--smoke``)
  torch_scaled_mm  ``torch._scaled_mm`` (cuBLASLt) on L distinct [N, K] weights, the
                   activations' scales as the config has them (rowwise: [M, 1] x [1, N])

Time: the JAX rows run L calls (one per layer) in one jitted scan (``_common.looped``),
median over ``--repeats`` of scan time / L; torch L calls back to back between CUDA events.
Error: the last layer's output against a float32 reference (relative norm); memory is
filled with NaN first so that an unwritten element shows.

    python3 benchmarks/bench_gemm_stacked.py --config characters-57b --tp 4 --out $OUT
    python3 benchmarks/bench_gemm_stacked.py --smoke      # CPU: small config, interpreter
"""

from __future__ import annotations

import os
import statistics
import sys

from _common import (Results, Shapes, cuda_event_times_us, default_out, finish, fp8_stack, load_shapes, looped,
                     median_us, names_of, parser, rel_err, torch_cuda_missing, torch_fp8_operands)

CASES = ("qkv", "out", "up", "down", "out+down")


def make_stack(key, layers: int, n: int, k: int):
    """([L, N, K] e4m3 weights, [L] f32 scales, one a layer)."""
    import jax.numpy as jnp

    return fp8_stack(key, layers, n, k), jnp.full((layers,), 1 / 32, jnp.float32) * (1 + jnp.arange(layers) / layers)


def make_activation(key, s: Shapes, k: int):
    """(x [rows, K] e4m3 (rows past M zero), scale: [M] f32 per row, or [] per tensor)."""
    import jax
    import jax.numpy as jnp

    kx, ks = jax.random.split(key)
    x = (jax.random.normal(kx, (s.tokens, k), jnp.float32) * 16).astype(jnp.float8_e4m3fn)
    x = jnp.pad(x, ((0, s.rows - s.tokens), (0, 0)))
    if s.activation_scale == "row":
        return x, jax.random.uniform(ks, (s.tokens,), jnp.float32, 0.5, 2.0) / 16
    return x, jnp.float32(1 / 16)


def row_scales(scale, rows: int):
    import jax.numpy as jnp

    return jnp.pad(scale, (0, rows - scale.shape[0]))[:, None] if scale.ndim else scale


def reference(products, layer: int):
    """float32 sum over (x, x_scale, w, w_scale) of x @ w[layer].T * scales."""
    import jax.numpy as jnp
    from jax import lax

    out = 0
    for x, xs, w, ws in products:
        y = jnp.matmul(x.astype(jnp.float32), w[layer].astype(jnp.float32).T,
                       precision=lax.Precision.HIGHEST)
        out = out + y * row_scales(xs, x.shape[0]) * ws[layer]
    return out


def xla_op(products, i):
    """The model's XLA form at layer i: each product to f32, scaled, summed, bf16."""
    import jax.numpy as jnp

    from characters_jax.parallel.fp8_linear import fp8_dot

    out = 0
    for x, xs, w, ws in products:
        out = out + fp8_dot(x, w[i], jnp.float32) * row_scales(xs, x.shape[0]) * ws[i]
    return out.astype(jnp.bfloat16)


def kernel_op(impl: str):
    """``stacked_fp8_matmul`` at layer i: one product, or the first as the lead of the second."""
    from pallas_kernels import fp8_gemm_stacked as st
    from pallas_kernels.fp8_gemm_stream_k import Product

    def op(products, i):
        (x, xs, w, ws) = products[-1]
        row = xs.ndim == 1
        lead = None
        if len(products) == 2:
            lx, lxs, lw, lws = products[0]
            lead = Product(lx, lw, lws if row else lws * lxs, lxs if row else None)
        return st.stacked_fp8_matmul(x, w, i, ws if row else ws * xs, impl=impl,
                                     row_scale=xs if row else None, lead=lead)
    return op


def run_case(res: Results, s: Shapes, case: str, key, impl: str, repeats: int, with_torch: bool):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_gemm_stacked as st

    proj = s.projections()
    names = case.split("+")
    keys = jax.random.split(key, 2 * len(names))
    products = []
    for j, name in enumerate(names):
        n, k, _ = proj[name]
        x, xs = make_activation(keys[2 * j], s, k)
        w, ws = make_stack(keys[2 * j + 1], s.layers, n, k)
        products.append((x, xs, w, ws))
    n = proj[names[0]][0]
    flop = sum(2 * s.tokens * proj[name][1] * n for name in names)
    last = s.layers - 1
    ref = jax.block_until_ready(reference(products, last)[:s.tokens])
    label = f"{case} ({n} x {'+'.join(str(proj[x][1]) for x in names)})"

    def timed(op):
        def fn():
            us = median_us(looped(op, s.layers), (products,), repeats, per=s.layers)
            jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()
            out = jax.jit(op)(products, jnp.int32(last))
            return {"us": us, "flop": flop, "rel_err": rel_err(out[:s.tokens], ref)}
        return fn

    res.measure(label, "xla", timed(xla_op))
    if impl is None:
        res.skip(label, "kernel", "needs an NVIDIA sm_90 GPU")
    elif not all(st.fits(proj[x][0], proj[x][1]) for x in names):
        res.skip(label, "kernel", "the shape does not tile")
    else:
        res.measure(label, "kernel", timed(kernel_op(impl)))
    if with_torch:
        products.clear()  # the JAX operands' memory back before torch draws its own
        res.measure(label, "torch_scaled_mm", lambda: torch_scaled_mm(s, names, repeats, flop))


def torch_scaled_mm(s: Shapes, names, repeats: int, flop: int) -> dict:
    """``torch._scaled_mm`` on operands of the same shapes and distributions drawn by
    torch (L distinct weights, as the scan reads them), summed over the products like the
    JAX rows, the activations' scales as the config has them; its error against its own
    float32 reference at the last layer."""
    import torch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ops = []
    for name in names:
        n, k, _ = s.projections()[name]
        x, w = torch_fp8_operands(s, k, n, dev, gen)
        if s.activation_scale == "row":  # rowwise: [M, 1] x [1, N], float32
            xs = torch.zeros((s.rows, 1), device=dev)
            xs[:s.tokens] = torch.rand((s.tokens, 1), device=dev, generator=gen) * 1.5 / 16 + 0.5 / 16
            ws = torch.full((1, n), 1 / 32, device=dev)
        else:
            xs, ws = torch.tensor(1 / 16, device=dev), torch.tensor(1 / 32, device=dev)
        ops.append((x, w, xs, ws))

    def call(layer):
        out = None
        for x, w, xs, ws in ops:
            y = torch._scaled_mm(x, w[layer].t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
            out = y if out is None else out + y
        return out

    last = s.layers - 1
    ref = sum((x.float() @ w[last].float().t()) * xs * ws for x, w, xs, ws in ops)
    err = rel_err(call(last)[:s.tokens], ref[:s.tokens])
    us = statistics.median(cuda_event_times_us(call, s.layers, repeats))
    ops.clear()  # the memory back to the caching allocator, then to the device
    torch.cuda.empty_cache()
    return {"us": us, "flop": flop, "rel_err": err}


def main(argv=None) -> int:
    p = parser(__doc__, 1, "tensor-parallel size whose per-GPU shapes are timed",
               "CPU check: small config, 2 layers, the kernel interpreted")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    p.add_argument("--layers", type=int, default=None, help="stack depth (default: the config's blocks)")
    p.add_argument("--no-torch", action="store_true", help="no torch._scaled_mm rows")
    p.add_argument("--budget-s", type=float, default=None, help="skip the cases not started after this many seconds")
    a = p.parse_args(argv)
    cases = names_of(a.cases, CASES, "bench_gemm_stacked: cases")
    if cases is None:
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # room for torch
    import dataclasses

    import jax

    from pallas_kernels import fp8_gemm_stacked as st

    s = load_shapes("small" if a.smoke else a.config, a.tp)
    s = dataclasses.replace(s, layers=a.layers or (2 if a.smoke else s.layers))
    impl = "interpret" if a.smoke else ("pallas" if st.is_supported() else None)
    why = "--no-torch" if a.no_torch else (torch_cuda_missing() if not a.smoke else "smoke run")
    res = Results(a.out or default_out(), "gemm_stacked",
                  {"config": s.config, "tp": s.tp, "rows": s.rows, "tokens": s.tokens, "layers": s.layers,
                   "activation_scale": s.activation_scale, "seed": a.seed, "jax": jax.__version__,
                   "device": jax.devices()[0].device_kind, "kernel": impl, "torch": why or "yes"},
                  budget_s=a.budget_s)
    key = jax.random.key(a.seed)
    for case in cases:
        key, sub = jax.random.split(key)
        res.run_case(case, lambda: run_case(res, s, case, sub, impl, 1 if a.smoke else a.repeats, why is None))
    return finish(res)


if __name__ == "__main__":
    sys.exit(main())
