"""What the kernel benchmarks share: one GPU's shapes from a config, the timing loops, the
error measure, and the results file (rewritten after every row, so a benchmark cut short
by its time limit keeps what it measured).

Every benchmark is a script with ``main(argv) -> int`` (run as
``python3 benchmarks/NAME.py``, or through ``benchmarks/run.py kernels``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Prompt tokens of the benchmarked session, at most 3/5 of the config's prompt slots: the
# sink's prompt slots past it are masked (characters-57b: 200 of its 498).
PROMPT_TOKENS = 298


def default_out() -> pathlib.Path:
    """Where results go unless told: $OUT, else out/bench/ (outside the source tree's files)."""
    return pathlib.Path(os.environ.get("OUT") or ROOT / "out" / "bench")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One GPU's operands in one denoising pass of a config at tensor-parallel size tp.

    tokens: new tokens per pass (M); rows: M rounded up to 8 (the kernels' row count);
    heads, mlp: this GPU's share (num_heads / tp, mlp_dim / tp); slots: KV cache slots
    (sink then ring), masked_slots: the sink's prompt slots past the prompt;
    layers: blocks; passes: denoising passes per step."""

    config: str
    tp: int
    tokens: int
    rows: int
    d_model: int
    heads: int
    head_dim: int
    mlp: int
    slots: int
    sink_slots: int
    masked_slots: int
    layers: int
    passes: int
    activation_scale: str

    @classmethod
    def of(cls, cfg, tp: int) -> "Shapes":
        cfg.validate_tp(tp)
        m = cfg.model
        return cls(config=cfg.name, tp=tp, tokens=cfg.tokens_per_step,
                   rows=-(-cfg.tokens_per_step // 8) * 8, d_model=m.d_model,
                   heads=m.num_heads // tp, head_dim=m.head_dim, mlp=m.mlp_dim // tp,
                   slots=cfg.cache_slots, sink_slots=cfg.sink_slots,
                   masked_slots=cfg.cache.max_prompt_tokens
                   - min(PROMPT_TOKENS, cfg.cache.max_prompt_tokens * 3 // 5),
                   layers=m.num_blocks, passes=cfg.sampler.num_passes,
                   activation_scale=m.activation_scale)

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int, bool]]:
        """name: (N, K, row_parallel) of this GPU's weight of each projection (stored
        [N, K]): qkv and up split N over the GPUs, out and down split K (row-parallel:
        their products are summed over the GPUs)."""
        return {"qkv": (3 * self.attention_width, self.d_model, False),
                "out": (self.d_model, self.attention_width, True),
                "up": (self.mlp, self.d_model, False),
                "down": (self.d_model, self.mlp, True)}

    def attention_flop(self) -> int:
        """FLOPs of one attention call: 2 products of Tq x S x D per head."""
        return 4 * self.tokens * self.slots * self.head_dim * self.heads


def parser(doc: str, tp_default: int, tp_help: str, smoke_help: str):
    """The arguments every kernel benchmark takes: --config, --tp, --repeats, --seed,
    --out, --smoke (its CPU check)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--config", default="characters-57b", help="config name or path")
    p.add_argument("--tp", type=type(tp_default), default=tp_default, help=tp_help)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats, median taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory (default $OUT or out/bench/)")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    return p


def names_of(text: str, known, prog: str) -> list[str] | None:
    """A comma-separated choice of ``known`` names; None (after a message) if one is unknown."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"{prog}: unknown {unknown}; known: {tuple(known)}", file=sys.stderr)
        return None
    return names


def fp8_stack(key, layers: int, n: int, k: int, sharding=None):
    """[L, N, K] e4m3 weights from N(0, 16^2), drawn one layer at a time (bounded
    temporaries), placed with ``sharding`` (default: the default device)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    gen = lambda kk: (jax.random.normal(kk, (n, k), jnp.float32) * 16).astype(jnp.float8_e4m3fn)  # noqa: E731
    return jax.jit(lambda ks: lax.map(gen, ks), out_shardings=sharding)(jax.random.split(key, layers))


def torch_fp8_operands(s: "Shapes", k: int, n: int, dev, gen):
    """PyTorch on CUDA: (x [rows, K] e4m3, its first M rows from N(0, 16^2), the rest zero;
    w [L, N, K] e4m3 from N(0, 16^2), one layer at a time)."""
    import torch

    f8 = torch.float8_e4m3fn
    x = torch.zeros((s.rows, k), device=dev, dtype=f8)
    x[:s.tokens] = (torch.randn((s.tokens, k), device=dev, generator=gen) * 16).to(f8)
    w = torch.empty((s.layers, n, k), device=dev, dtype=f8)
    for layer in range(s.layers):
        w[layer] = (torch.randn((n, k), device=dev, generator=gen) * 16).to(f8)
    return x, w


def load_shapes(config: str, tp: int) -> Shapes:
    from characters_jax.config import load_config

    return Shapes.of(load_config(config), tp)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the host; NaN if ``out`` has a non-finite value."""
    out = np.asarray(_host(out), np.float64)
    ref = np.asarray(_host(ref), np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _host(x):
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().float().cpu().numpy()
    import jax

    return jax.device_get(x)


def looped(fn, iters: int):
    """jit of ``run(*operands)``: ``fn(*operands, i)`` for i in 0..iters-1 inside one
    ``lax.scan``. Each call's operands pass through an optimization barrier with the loop
    index (nothing is hoisted out of the loop) and its outputs through another (each is
    materialized whole); one element of the first output is summed into the carry, so
    every call stays live. ``i`` is the traced loop index (e.g. the layer of a stack)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def run(*operands):
        def body(acc, i):
            ops, i = lax.optimization_barrier((operands, i))
            out = lax.optimization_barrier(fn(*ops, i))
            first = jax.tree.leaves(out)[0]
            return acc + first.reshape(-1)[0].astype(jnp.float32), None

        return lax.scan(body, jnp.float32(0), jnp.arange(iters, dtype=jnp.int32))[0]

    return jax.jit(run)


def median_us(jitted, operands, repeats: int, per: int = 1) -> float:
    """Median host-clock microseconds of ``jitted(*operands)`` to completion, divided by
    ``per`` (the calls inside one), over ``repeats`` after one warm-up call."""
    import jax

    jax.block_until_ready(jitted(*operands))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*operands))
        times.append((time.perf_counter() - t0) * 1e6 / per)
    return statistics.median(times)


def torch_cuda_missing() -> str | None:
    """Why there are no PyTorch rows (None: torch with CUDA is importable)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    return None


def cuda_event_times_us(call, n_calls: int, repeats: int, warmup: int = 3) -> list[float]:
    """PyTorch on CUDA: microseconds per call of ``call(i)``, i = 0..n_calls-1 back to back
    between two CUDA events, once per repeat, after ``warmup`` calls."""
    import torch

    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n_calls):
            call(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    return times


class Results:
    """Rows of one benchmark, {case, impl, us, ...}, in ``out_dir/name.json`` with the
    run's metadata and the table; the file is rewritten after every row."""

    def __init__(self, out_dir, name: str, meta: dict, budget_s: float | None = None):
        self.path = pathlib.Path(out_dir) / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.name, self.meta, self.rows = name, meta, []
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        print(f"[{name}] {json.dumps(meta)}", flush=True)

    def measure(self, case: str, impl: str, fn, **extra) -> dict | None:
        """Runs ``fn() -> dict`` (its 'us' and any checks) and records the row; an error or
        the budget spent records the reason instead."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            return self.add(case=case, impl=impl, skipped="out of time", **extra)
        try:
            return self.add(case=case, impl=impl, **extra, **fn())
        except Exception as e:  # noqa: BLE001 - one failing contender must not cost the others
            traceback.print_exc(limit=4)
            return self.add(case=case, impl=impl, error=f"{type(e).__name__}: {e}"[:800], **extra)

    def run_case(self, case: str, fn) -> None:
        """Runs ``fn()``, which records a case's rows; the budget spent, or an error outside
        the rows (e.g. making the operands), is recorded as a row of the case."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.skip(case, "-", "out of time")
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the next case may still run
            traceback.print_exc(limit=4)
            self.add(case=case, impl="-", error=f"{type(e).__name__}: {e}"[:800])

    def skip(self, case: str, impl: str, why: str) -> dict:
        return self.add(case=case, impl=impl, skipped=why)

    def add(self, **row) -> dict:
        self.rows.append(row)
        brief = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
        print(f"[{self.name}] {json.dumps(brief)[:400]}", flush=True)
        self.save()
        return row

    def save(self) -> None:
        self.path.write_text(json.dumps({"meta": self.meta, "rows": self.rows,
                                         "table": self.table()}, indent=1))

    def table(self) -> str:
        return format_rows(self.rows)


def format_rows(rows: list[dict]) -> str:
    """case | impl | us | x (the case's first timed row) | TFLOP/s | rel_err | note."""
    lines = [f"{'case':<28} {'impl':<16} {'us':>9} {'x first':>8} {'TFLOP/s':>8} {'rel_err':>9}  note"]
    first: dict[str, float] = {}
    for r in rows:
        us = r.get("us")
        base = first.setdefault(r["case"], us) if us is not None else first.get(r["case"])
        ratio = f"{us / base:8.2f}" if us is not None and base else f"{'-':>8}"
        tf = f"{r['flop'] / us / 1e6:8.1f}" if us and r.get("flop") else f"{'-':>8}"
        err = r.get("rel_err")
        err = f"{err:9.2e}" if isinstance(err, float) else f"{'-':>9}"
        note = r.get("error") or (f"skipped: {r['skipped']}" if "skipped" in r else r.get("note", ""))
        usf = f"{us:9.1f}" if us is not None else f"{'-':>9}"
        lines.append(f"{r['case']:<28} {r['impl']:<16} {usf} {ratio} {tf} {err}  {note[:100]}")
    return "\n".join(lines)


def finish(results: Results) -> int:
    """Prints the table last; 0 if no row failed."""
    print(f"\n==== {results.name} ({results.path}) ====")
    print(results.table())
    return 1 if any("error" in r for r in results.rows) else 0
