"""`characters-jax train`: the demonstrator's training (all stages), the self-rollout stage
on a trained weights directory, its evaluation, and the demo's held-out assets."""

from __future__ import annotations

import sys


def _settings(args):
    from characters_jax.config import load_config
    from characters_jax.train.settings import load_settings

    s = load_settings(args.settings or args.config, args.set or ())
    cfg = load_config(args.config or s.config)
    return cfg, s


def _all(args) -> int:
    from characters_jax.train.pipeline import train_all

    cfg, s = _settings(args)
    train_all(cfg, s, args.out, deadline_s=args.deadline_s, export=args.export)
    return 0


def _rollout(args) -> int:
    from characters_jax.train.finetune import finetune

    cfg, s = _settings(args)
    finetune(cfg, s, args.weights, args.out, deadline_s=args.deadline_s, export=args.export)
    return 0


def _eval(args) -> int:
    import pathlib

    from characters_jax.train.evaluate import markdown
    from characters_jax.train.pipeline import Clock, PlanQueue, plan_makers, run_eval

    cfg, s = _settings(args)
    out = pathlib.Path(args.out)
    makers = plan_makers(cfg, s, out / "plans")
    makers.pop("train")
    queue = PlanQueue(makers).start()
    try:
        result = run_eval(cfg, s, out, queue, args.weights, Clock(0).logger())
    finally:
        queue.stop()
    print(markdown(result))
    return 0


def _demo_assets(args) -> int:
    from characters_jax.config import load_config
    from characters_jax.train.demo_assets import write_demo_assets

    cfg = load_config(args.config)
    for path in write_demo_assets(cfg, args.out, index=args.index, seconds=args.seconds, seed=args.seed):
        print(f"wrote {path}")
    return 0


def _errors(func):
    def run(args) -> int:
        from characters_jax.decoder.weights import WeightsError

        try:
            return func(args)
        except (WeightsError, FileNotFoundError, FileExistsError) as err:
            print(f"characters-jax train: {err}", file=sys.stderr)
            return 2

    return run


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the talking demonstrator (VAE + DiT) and evaluate it")
    sub = p.add_subparsers(dest="train_command", metavar="STAGE", required=True)

    def common(q):
        q.add_argument("--config", default=None, help="model config (default: the settings' config)")
        q.add_argument("--settings", default=None,
                       help="training settings: configs/train/NAME.toml or a path (default: the --config name)")
        q.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a setting (repeatable)")

    q = sub.add_parser("all", help="data, VAE, latents, DiT, weights and evaluation within a deadline (resumable)")
    common(q)
    q.add_argument("--out", required=True, help="output directory; a rerun resumes from it")
    q.add_argument("--deadline-s", type=float, default=None, help="wall-clock seconds for the whole run")
    q.add_argument("--export", default=None,
                   help="also copy weights.tar, eval.json, eval.md and summary.json here as each is written")
    q.set_defaults(func=_errors(_all))

    q = sub.add_parser("rollout", help="the self-rollout stage from a trained weights directory (a fine-tune; "
                                       "resumable), then its weights and evaluation")
    common(q)
    q.add_argument("--weights", required=True, help="the weights directory to start from (e.g. checkpoints/talking)")
    q.add_argument("--out", required=True, help="output directory; a rerun resumes from it")
    q.add_argument("--deadline-s", type=float, default=None, help="wall-clock seconds for the whole run")
    q.add_argument("--export", default=None,
                   help="also copy weights.tar, eval.json, eval.md and summary.json here as each is written")
    q.set_defaults(func=_errors(_rollout))

    q = sub.add_parser("eval", help="lip sync, identity and drift of a weights directory on held-out clips")
    common(q)
    q.add_argument("--weights", required=True, help="weights directory (e.g. checkpoints/talking)")
    q.add_argument("--out", required=True, help="output directory (plans, eval.json, eval.md)")
    q.set_defaults(func=_errors(_eval))

    q = sub.add_parser("demo-assets", help="a held-out portrait (PNG), speech (WAV) and mouth tracks for the demo")
    q.add_argument("--config", default="talking")
    q.add_argument("--out", required=True)
    q.add_argument("--index", type=int, default=0, help="held-out clip index (past the evaluation's: 1000)")
    q.add_argument("--seconds", type=float, default=8.0)
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=_errors(_demo_assets))
