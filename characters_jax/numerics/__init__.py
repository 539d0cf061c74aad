"""`characters-jax numerics`: optimized variants against the reference path's own run-to-run spread.

An autoregressive video model cannot be judged by comparing pixels after a few seconds: two
runs of the same reference path already drift apart under perturbations a deployment has
anyway (another reduction order, a one-ulp change of an input, nondeterministic GPU
reductions). The harness measures that spread, runs each variant that changes the
arithmetic on the same inputs, seeds and weights, and says per variant whether its
divergence stays within the spread (mean and worst case). Exact equivalences stay unit
tests (tests/test_engine.py). Modules: `runs` (variants, inputs, trajectories),
`metrics` (distances, spread, verdict), `decode` (frames, PSNR), `harness`, `report`.

`--metric lipsync` judges the same variants on the trained model by what it shows
(`lipsync_gate`): mean lip-sync, identity and drift differences over held-out clips against
the reference's run-to-run variation, with the latent distance of the same runs beside it
(modules `clips`, `sessions`, `quality`, `lipsync_gate`, `gate_report`). `--metric latent`
(the default) is the latent/frame-distance harness alone.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("numerics", help="numerics-changing variants vs the reference's run-to-run spread",
                       description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config name (configs/NAME.toml) or path")
    p.add_argument("--metric", choices=("latent", "lipsync"), default="latent",
                   help="latent: latent/frame distance vs the reference's spread (random weights); "
                        "lipsync: lip sync, identity and drift of the trained model on held-out clips vs the "
                        "reference's run-to-run variation, the latent verdict of the same runs beside it")
    p.add_argument("--checkpoint", default=None, help="weights directory of the trained config (needed by --metric lipsync)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the base reference run and the variants")
    p.add_argument("--steps", type=int, default=12, help="steps per run (one latent frame each)")
    p.add_argument("--variants", default=None,
                   help="comma-separated: ring-bf16, ring-fp8, fp8-attention, qkv-kernel, fp8-gemm, fp8-gemm-row, stacked-gemm, "
                        "stacked-gemm-row, quant-kernels, fused-reduce, ppermute, production (the config's cache and [engine], "
                        "with --set applied); lipsync also NAME@tpN (another tp size). Default latent: "
                        "ring-bf16,ring-fp8,fp8-attention,fp8-gemm,fused-reduce,ppermute; lipsync: every variant, "
                        "ppermute@tp2 and production@tp2")
    from characters_jax.config.arguments import add_set_argument

    add_set_argument(p)
    p.add_argument("--runs", type=int, default=4, help="reference runs: the base run plus R-1 perturbed ones")
    g = p.add_argument_group("lipsync metric")
    g.add_argument("--clips", type=int, default=51, help="held-out clips per run")
    g.add_argument("--seconds", type=float, default=4.0, help="length of each held-out clip")
    g.add_argument("--drift-clips", type=int, default=2, help="longer held-out clips for the drift score (0: not measured)")
    g.add_argument("--drift-seconds", type=float, default=16.0, help="length of each drift clip")
    g.add_argument("--drift-window", type=float, default=4.0, help="drift: the last this many seconds against the first")
    g.add_argument("--variation", choices=("max", "rms"), default="max",
                   help="run-to-run variation V of a score: max (largest |mean difference| of a perturbed reference "
                        "run from the base run) or rms (their root mean square); a variant passes within --factor x V")
    g.add_argument("--perturb", default=None,
                   help="perturbation kinds of the reference runs, cycled: ulp, tp, repeat, seed (default ulp,seed,tp,seed: "
                        "a one-ulp nudge, other noise seeds, another tp size where the devices allow)")
    g.add_argument("--plans", default="out/numerics-plans", help="directory where held-out clip plans are kept")
    g.add_argument("--out", default=None, help="write OUT.md, OUT.json and OUT.png (the lip-sync table)")
    p.add_argument("--blocks", type=int, default=None, help="override model.num_blocks (reduced depth, full width)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="override the activation dtype")
    p.add_argument("--ref-cache-dtype", choices=("bf16", "float32"), default="bf16", help="the reference's launch cache dtype")
    p.add_argument("--factor", type=float, default=2.0, help="allowed multiple of the reference's spread")
    p.add_argument("--floor", type=float, default=1e-6, help="lowest value of the per-step tolerance band")
    p.add_argument("--decoder", choices=("config", "small", "none"), default="config",
                   help="decoder for frame PSNR: the config's, one with channels / 8, or none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which variants not yet started are skipped (with a note)")
    p.add_argument("--json", default=None, help="write the full result (curves, table, notes) here")
    p.add_argument("--plot", default=None, help="write a PNG of divergence against step here")
    p.add_argument("--table", default=None, help="write the markdown table here")
    p.add_argument("--float-weights", action="store_true",
                   help="keep the reference's block weights as drawn (default: snapped to the FP8 grid, so that "
                        "FP8-weight variants run the same model and only their arithmetic is judged)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_main)


def _main(args) -> int:
    if args.metric == "lipsync":
        from characters_jax.numerics.gate_cli import main

        return main(args)
    if args.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # On CPU the mesh needs virtual devices (read when the backend starts, which no
        # command import does); the flag does nothing on other backends.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(args.tp, 4)}".strip()
    from characters_jax.config import load_config
    from characters_jax.numerics import report as rep
    from characters_jax.numerics.harness import Settings, run
    from characters_jax.numerics.runs import VARIANTS

    names = args.variants or "ring-bf16,ring-fp8,fp8-attention,fp8-gemm,fused-reduce,ppermute"
    variants = tuple(v.strip() for v in names.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"characters-jax numerics: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    config = load_config(args.config, args.set)  # a bad key or value fails here
    settings = Settings(config=config, tp=args.tp, steps=args.steps, runs=args.runs, variants=variants,
                        blocks=args.blocks, dtype=args.dtype, ref_cache_dtype=args.ref_cache_dtype,
                        factor=args.factor, floor=args.floor, decoder=args.decoder, seed=args.seed,
                        verbose=not args.quiet, time_budget_s=args.time_budget,
                        fp8_grid_weights=not args.float_weights)

    def save(report, final: bool) -> None:
        if report.config.model.dtype == "float32" and final:
            report.notes.append("activations float32: the reference's spread is float32 rounding, so any bf16/FP8 "
                                "storage lies outside it; --dtype bfloat16 matches the serving configs")
        if args.json:
            rep.write_json(report, args.json)
        if args.table:
            with open(args.table, "w") as fh:
                fh.write(rep.header(report) + "\n\n" + rep.table(report) + "\n")
        if args.plot and final:
            rep.plot(report, args.plot)

    report = run(settings, on_progress=lambda r: save(r, final=False))
    save(report, final=True)
    text = rep.table(report)
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
    print(rep.header(report))
    for n in report.notes:
        print(f"note: {n}")
    print(f"time: {secs}")
    print(text)
    flagged = report.flagged
    print(f"flagged (not within x{settings.factor:g} the reference spread): {', '.join(flagged) if flagged else 'none'}")
    return 1 if flagged else 0
