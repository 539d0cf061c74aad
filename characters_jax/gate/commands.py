"""`characters-jax gate METRICS`: the variants judged against the reference's run-to-run variation.

METRICS, comma-separated: latent (latent distance; on random weights without --checkpoint),
lipsync (lip sync, identity and their drift on the trained model's held-out clips),
fidelity (the characters' colours on the same clips). The settings are TOML tables set with
`--set` (`options`): [gate], [latent], [clips], [lipsync], beside the model config's own.

Exit status: 0 when every default-path variant (production) passes or did not run here, 1
when one fails, 2 for a command-line error (bad flags or keys, a missing weights
directory, weights made for another config, no espeak-ng for the held-out plans), with the
reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "characters-jax gate"


def register(sub: argparse._SubParsersAction) -> None:
    from characters_jax.config.arguments import CONFIG_TABLES, add_set_argument

    p = sub.add_parser("gate", help="numerics-changing variants vs the reference's run-to-run variation",
                       description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="comma-separated metrics that judge: latent, lipsync, fidelity (the latent distance "
                                   "is measured beside the others anyway)")
    p.add_argument("--config", required=True, help="config name (configs/NAME.toml) or path")
    p.add_argument("--checkpoint", default=None,
                   help="the trained config's weights directory: every run on held-out clips (needed by lipsync and "
                        "fidelity); without it, random weights and one random session")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the base reference run and the variants")
    p.add_argument("--variants", default=None,
                   help="comma-separated: ring-bf16, ring-fp8, fp8-attention, qkv-kernel, fp8-gemm, fp8-gemm-row, "
                        "stacked-gemm, stacked-gemm-row, quant-kernels, fused-reduce, ppermute, production (the config's "
                        "cache and [engine], with --set applied), each optionally @tpN (another tp size). Default on "
                        "random weights: ring-bf16,ring-fp8,fp8-attention,fp8-gemm,fused-reduce,ppermute; with "
                        "--checkpoint: every variant, ppermute@tp2 and production@tp2")
    add_set_argument(p, f"{CONFIG_TABLES}; the gate's: gate, latent, clips, lipsync")
    p.add_argument("--out", default=None, help="write OUT.md, OUT.json and OUT.png")
    p.set_defaults(func=main)


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def settings_from_args(args):
    """harness.Settings from the parsed arguments (ValueError / ConfigError for bad ones)."""
    from characters_jax.config import load_config
    from characters_jax.config.arguments import config_sets
    from characters_jax.gate import harness
    from characters_jax.gate.options import gate_tables

    ours, others = config_sets(args.set)
    config = load_config(args.config, ours)
    tables = gate_tables(others)
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip()) if args.variants else None
    settings = harness.Settings(config=config, metrics=metrics, checkpoint=args.checkpoint, tp=args.tp,
                                variants=variants, gate=tables.gate, latent=tables.latent, clips=tables.clips,
                                lipsync=tables.lipsync)
    harness.check(settings)
    return settings


def main(args) -> int:
    if args.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # On CPU the mesh needs virtual devices (read when the backend starts, which no
        # command import does); the flag does nothing on other backends.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(args.tp, 4)}".strip()
    from characters_jax.config import ConfigError
    from characters_jax.weights.directory import WeightsError

    try:
        settings = settings_from_args(args)
    except ConfigError:
        raise  # exit 2 with the key named (cli.main)
    except ValueError as err:
        return _error(str(err))
    if settings.checkpoint:
        try:
            import espeakng_loader  # noqa: F401  (the held-out plans' speech)
        except ImportError:
            return _error("the held-out clips need espeak-ng: pip install '.[train]' (espeakng-loader)")
    from characters_jax.serving.placement import size_generator_pool

    # Before the backend starts (it fixes the GPU pool): the pool from the memory plan of the
    # config the gate runs (PlacementError, a ConfigError, if it cannot fit).
    size_generator_pool(settings.config, settings.tp)
    from characters_jax.gate import report as rep
    from characters_jax.gate.harness import run

    def save(result, final: bool) -> None:
        if args.out:
            rep.write(result, args.out, plot_png=final)

    try:
        result = run(settings, on_progress=lambda r: save(r, final=False))
    except FileNotFoundError as err:
        return _error(str(err))
    except WeightsError as err:
        return _error(f"--checkpoint does not fit --config {settings.config.name}: {err}")
    save(result, final=True)
    print(rep.header(result))
    print(rep.table(result))
    print(rep.verdict_rule(result))
    for n in result.notes:
        print(f"note: {n}")
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items()))
    failed, default = result.failed, result.failed_default_path
    print(f"failed: {', '.join(failed) if failed else 'none'}; default path failed: {', '.join(default) if default else 'none'}")
    return 1 if default else 0
