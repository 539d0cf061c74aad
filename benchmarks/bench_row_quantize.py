"""The per-row FP8 quantization kernels (``pallas_kernels.fp8_row_quantize``) at
characters-57b's shapes, each ``--layouts`` variant against XLA's fusions of the same math:

  norm  the block input, 757 x 9216 bf16 (every tp) -> 760 rows of e4m3;
  gelu  the MLP hidden from up's 760-row output: 8064 (tp=4), 10752 (tp=3), 16128 (tp=2);
  none  the attention output, 757 x 2304 (tp=4);
and, for the block input, XLA's per-tensor quantization.

Each variant runs 60 times inside one jitted ``lax.scan``: rolled, every output carried
to the next call through an optimization barrier with its input (the loop's own ~10 us a
call included, the same for every variant), or ``--unrolled`` for the kernels alone
(``scanned`` says why XLA's fusions cannot be timed that way); per call = scan time / 60,
median of ``--repeats`` (host clock around ``block_until_ready``, after a warm-up call),
two interleaved rounds.

Run (one GPU):  PYTHONPATH=. python3 benchmarks/bench_row_quantize.py --out $OUT
Layouts: ROWSxCHUNKxWARPS, CHUNK 'full' for the row's next power of two (one chunk), a
trailing 'r' for Layout.reload.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from characters_jax.model.dit import modulated_norm
from characters_jax.parallel.fp8_linear import quantize
from pallas_kernels import fp8_row_quantize as rq

M, ROWS, LAYERS, EPS = 757, 760, 60, 1e-6
# (prologue, D, rows of the input): the kernels' shapes in the model.
CASES = (("norm", 9216, M), ("gelu", 8064, ROWS), ("gelu", 10752, ROWS), ("gelu", 16128, ROWS),
         ("none", 2304, M))
DEFAULT_LAYOUTS = ("1xfullx8", "1x2048x8", "1x1024x4", "1x2048x16", "1x1024x4r", "1x2048x8r",
                   "1x1024x2r", "2x1024x8r")


def parse_layout(text: str) -> rq.Layout:
    """'ROWSxCHUNKxWARPS', a trailing 'r' for Layout.reload; CHUNK 'full': one chunk."""
    match = re.fullmatch(r"(\d+)x(full|\d+)x(\d+)(r?)", text)
    if not match:
        raise ValueError(f"layout {text!r}: want ROWSxCHUNKxWARPS[r], e.g. 1x2048x8")
    rows, chunk, warps, reload = match.groups()
    return rq.Layout(int(rows), None if chunk == "full" else int(chunk), int(warps), bool(reload))


def variants(prologue, layouts):
    def kernel(layout):
        return lambda x, a, b: rq.row_quantize(
            x, *((a, b) if prologue == "norm" else ()), prologue=prologue, eps=EPS, rows=M,
            rows_out=ROWS, impl="pallas", layout=layout)

    out = {name: kernel(parse_layout(name)) for name in layouts}
    out["xla_row"] = lambda x, a, b: rq.reference(
        x, *((a, b) if prologue == "norm" else ()), eps=EPS, rows=M, rows_out=ROWS,
        prologue=prologue)
    if prologue == "norm":
        def xla_tensor(x, a, b):
            q = quantize(modulated_norm(x, a, b, EPS), "tensor")
            return jnp.pad(q.values, ((0, ROWS - M), (0, 0))), q.scale
        out["xla_tensor"] = xla_tensor
    return out


def scanned(fn, d, unroll=False):
    """fn run LAYERS times in one jitted lax.scan (compiled once, timed each round).

    Rolled (default): the whole outputs are the loop's carry, tied to the next call's
    input by an optimization barrier, so every call runs and writes all of them; the loop
    adds its own per-iteration cost (~10 us on an H200), the same for every variant.
    Unrolled (kernels only): the 60 calls back to back; each input is tied to a running
    scalar of the earlier outputs, which keeps the opaque kernel calls distinct and live
    (an XLA fusion there would be cut down to the one element read, so XLA variants are
    not run unrolled)."""
    if unroll:
        def scan(x, a, b):
            def body(acc, i):
                xi, acc = lax.optimization_barrier((x, acc))
                q, s = fn(xi, a, b)
                return acc + s[0] + q[-1, -1].astype(jnp.float32), None
            return lax.scan(body, jnp.float32(0), jnp.arange(LAYERS), unroll=True)[0]
        return jax.jit(scan)

    def scan(x, a, b):
        def body(carry, i):
            xi, _ = lax.optimization_barrier((x, carry))
            q, s = fn(xi, a, b)
            return (q, s.reshape(-1)[:1]), None
        init = (jnp.zeros((ROWS, d), rq.FP8), jnp.zeros((1,), jnp.float32))
        return lax.scan(body, init, jnp.arange(LAYERS))[0]
    return jax.jit(scan)


def time_variant(f, x, a, b, repeats):
    jax.block_until_ready(f(x, a, b))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, a, b))
        ts.append((time.perf_counter() - t0) / LAYERS * 1e6)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layouts", nargs="*", default=list(DEFAULT_LAYOUTS))
    ap.add_argument("--cases", nargs="*", default=[f"{p}:{d}" for p, d, _ in CASES],
                    help="PROLOGUE:D of CASES")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--unrolled", dest="unroll", action="store_true",
                    help="60 unrolled calls, kernels only (no loop overhead; see scanned)")
    args = ap.parse_args()
    cases = [c for c in CASES if f"{c[0]}:{c[1]}" in args.cases]
    key = jax.random.key(int(time.time()) % 2**31)
    res = {"device": str(jax.devices()[0]), "m": M, "rows_out": ROWS, "layers": LAYERS,
           "us": {}}
    for prologue, d, rows_in in cases:
        kx, ka, kb, key = jax.random.split(key, 4)
        x = (jax.random.normal(kx, (rows_in, d)) * 2).astype(jnp.bfloat16)
        a, b = jax.random.normal(ka, (d,)) * 0.1, jax.random.normal(kb, (d,)) * 0.1
        case = f"{prologue}:{d}"
        res["us"][case] = {}
        fns = {name: scanned(fn, d, args.unroll)
               for name, fn in variants(prologue, args.layouts).items()
               if not (args.unroll and name.startswith("xla"))}
        for _ in range(2):  # two rounds, interleaved: drift shows as a difference
            for name, f in fns.items():
                try:
                    us = time_variant(f, x, a, b, args.repeats)
                except Exception as e:  # noqa: BLE001
                    us = float("nan")
                    print(f"{case} {name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                res["us"][case].setdefault(name, []).append(us)
        print(f"{case} done", file=sys.stderr, flush=True)
        os.makedirs(args.out, exist_ok=True)  # after every case: a timeout keeps the rest
        with open(os.path.join(args.out, "row_quantize.json"), "w") as f:
            json.dump(dict(res, unrolled=args.unroll), f, indent=1)
    print(f"us per call, {M} rows -> {ROWS} (two rounds), x = / "
          + ("the first layout" if args.unroll else "xla_row"))
    for case, table in res["us"].items():
        base = min(next(iter(table.values())) if args.unroll else table["xla_row"])
        for name, us in table.items():
            print(f"{case:12s} {name:12s} {us[0]:8.1f} {us[1]:8.1f}   x{min(us) / base:.2f}")


if __name__ == "__main__":
    main()
