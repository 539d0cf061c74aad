"""The per-row FP8 quantization kernels (``pallas_kernels.fp8_row_quantize``) against XLA's
fusions of the same math, at one GPU's shapes of a config at ``--tp``:

  norm  the block input: modulated RMS norm of M x d_model bf16 rows -> ``rows`` e4m3 rows
        (M rounded up to 8; the padding rows zero with scale 0)
  gelu  the MLP hidden: GELU-tanh of up's ``rows`` x mlp / tp output
  none  the attention output, M x heads / tp x head_dim

  kernel      ``row_quantize(impl='pallas')``, its default layout (a GPU with the e4m3
              conversion: sm_89 or later; the interpreter with ``--smoke``)
  xla_row     ``row_quantize(impl='reference')``: the same math, XLA's fusions
  xla_tensor  (norm only) the block input quantized per tensor by the model's code

Each runs L times (the config's blocks) in one jitted scan (``_common.looped``); per call
= scan time / L, median over ``--repeats``. Error: the dequantized output against the
float32 prologue.

    python3 benchmarks/bench_row_quantize.py --config characters-57b --tp 4 --out $OUT
    python3 benchmarks/bench_row_quantize.py --smoke      # CPU: small config, interpreter
"""

from __future__ import annotations

import dataclasses
import sys

from _common import Results, Shapes, default_out, finish, load_shapes, looped, median_us, parser, rel_err

EPS = 1e-6


def cases(s: Shapes) -> list[tuple[str, int, int]]:
    """(prologue, D, rows of the input) of each kernel call in the model's block."""
    return [("norm", s.d_model, s.tokens), ("gelu", s.mlp, s.rows), ("none", s.attention_width, s.tokens)]


def run_case(res: Results, s: Shapes, prologue: str, d: int, rows_in: int, key, impl, repeats: int):
    import jax
    import jax.numpy as jnp

    from characters_jax.parallel.fp8_linear import quantize
    from pallas_kernels import fp8_row_quantize as rq
    from pallas_kernels.numerics import modulated_norm

    kx, ka, kb = jax.random.split(key, 3)
    x = (jax.random.normal(kx, (rows_in, d)) * 2).astype(jnp.bfloat16)
    mod = (jax.random.normal(ka, (d,)) * 0.1, jax.random.normal(kb, (d,)) * 0.1) if prologue == "norm" else ()
    kw = dict(prologue=prologue, eps=EPS, rows=s.tokens, rows_out=s.rows)
    ref = _prologue_f32(prologue, x, mod)[:s.tokens]
    case = f"{prologue} ({rows_in} x {d})"

    def timed(fn):
        def run():
            us = median_us(looped(lambda x, mod, i: fn(x, *mod), s.layers), (x, mod), repeats, per=s.layers)
            values, scale = jax.jit(fn)(x, *mod)
            deq = values.astype(jnp.float32) * jnp.reshape(scale, (-1, 1) if jnp.ndim(scale) else ())
            return {"us": us, "rel_err": rel_err(deq[:s.tokens], ref)}
        return run

    res.measure(case, "xla_row", timed(lambda x, *m: rq.reference(x, *m, **kw)))
    if impl is None:
        res.skip(case, "kernel", "needs an NVIDIA GPU of sm_89 or later")
    else:
        res.measure(case, "kernel", timed(lambda x, *m: rq.row_quantize(x, *m, impl=impl, **kw)))
    if prologue == "norm":
        def per_tensor(x, shift, scale):
            q = quantize(modulated_norm(x, shift, scale, EPS), "tensor")
            return jnp.pad(q.values, ((0, s.rows - s.tokens), (0, 0))), q.scale
        res.measure(case, "xla_tensor", timed(per_tensor))


def _prologue_f32(prologue: str, x, mod):
    """The prologue in float32: what the quantized rows approximate."""
    import jax.numpy as jnp

    from pallas_kernels.numerics import gelu_tanh, modulated_norm

    xf = x.astype(jnp.float32)
    if prologue == "norm":
        return modulated_norm(xf, *mod, EPS).astype(jnp.float32)
    if prologue == "gelu":
        return gelu_tanh(xf)
    return xf


def main(argv=None) -> int:
    p = parser(__doc__, 1, "tensor-parallel size whose per-GPU shapes are timed",
               "CPU check: small config, 2 layers, the kernel interpreted")
    p.set_defaults(repeats=15)
    a = p.parse_args(argv)
    import jax

    from pallas_kernels import fp8_row_quantize as rq

    s = load_shapes("small" if a.smoke else a.config, a.tp)
    if a.smoke:
        s = dataclasses.replace(s, layers=2)
    impl = "interpret" if a.smoke else ("pallas" if rq.is_supported() else None)
    res = Results(a.out or default_out(), "row_quantize",
                  {"config": s.config, "tp": s.tp, "tokens": s.tokens, "rows": s.rows, "layers": s.layers,
                   "seed": a.seed, "jax": jax.__version__, "device": jax.devices()[0].device_kind, "kernel": impl})
    key = jax.random.key(a.seed)
    for prologue, d, rows_in in cases(s):
        key, sub = jax.random.split(key)
        res.run_case(prologue, lambda: run_case(res, s, prologue, d, rows_in, sub, impl, 1 if a.smoke else a.repeats))
    return finish(res)


if __name__ == "__main__":
    sys.exit(main())
