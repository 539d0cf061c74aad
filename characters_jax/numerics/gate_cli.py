"""`characters-jax numerics --metric lipsync`: the command around `lipsync_gate`.

Exit status: 0 when every default-path variant (`lipsync_gate.DEFAULT_PATH`) passes or did
not run here, 1 when one fails, 2 for a command-line error (bad flags, a missing weights
directory, weights made for another config, no espeak-ng for the held-out plans), with
the reason on stderr.
"""

from __future__ import annotations

import os
import sys

PROG = "characters-jax numerics"


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def settings_from_args(args):
    """GateSettings from the parsed arguments (ValueError / ConfigError for bad ones)."""
    from characters_jax.config import load_config
    from characters_jax.numerics.lipsync_gate import DEFAULT_VARIANTS, GateSettings

    if not args.checkpoint:
        raise ValueError("--metric lipsync needs --checkpoint (the trained config's weights directory, "
                         "e.g. checkpoints/talking)")
    if args.blocks:
        raise ValueError("--blocks changes the model's depth: the trained weights cannot run at another depth")
    config = load_config(args.config, args.set)
    variants = (tuple(v.strip() for v in args.variants.split(",") if v.strip()) if args.variants
                else DEFAULT_VARIANTS)
    perturb = tuple(k.strip() for k in args.perturb.split(",") if k.strip()) if args.perturb else None
    settings = GateSettings(config=config, checkpoint=args.checkpoint, tp=args.tp, runs=args.runs, variants=variants,
                            clips=args.clips, seconds=args.seconds, drift_clips=args.drift_clips,
                            drift_seconds=args.drift_seconds, drift_window_s=args.drift_window, perturb=perturb,
                            rule=args.variation, factor=args.factor, floor=args.floor,
                            ref_cache_dtype=args.ref_cache_dtype, dtype=args.dtype, seed=args.seed,
                            plans_dir=args.plans, time_budget_s=args.time_budget, verbose=not args.quiet)
    settings.check()
    return settings


def main(args) -> int:
    if args.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(args.tp, 4)}".strip()
    from characters_jax.config import ConfigError
    from characters_jax.weights.directory import WeightsError

    try:
        settings = settings_from_args(args)
    except (ValueError, ConfigError, FileNotFoundError) as err:
        return _error(str(err))
    try:
        import espeakng_loader  # noqa: F401  (the held-out plans' speech)
    except ImportError:
        return _error("the held-out clips need espeak-ng: pip install '.[train]' (espeakng-loader)")
    from characters_jax.numerics import gate_report as rep
    from characters_jax.numerics.lipsync_gate import run

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
