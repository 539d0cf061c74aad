"""`characters-jax train`: the demonstrator's training (all stages), fine-tunes of a trained
weights directory (the self-rollout stage; the decoder on longer streams), its evaluation,
and the demo's held-out assets.

`--settings` names the training settings (configs/train/NAME.toml), whose `config` names the
model config; `--set` sets a key of either: the settings' tables and keys (budget, data, vae,
dit, rollout, eval; config, seed) or the model config's (model, video, cache, ...)."""

from __future__ import annotations

import sys

from characters_jax.config.arguments import CONFIG_TABLES, add_set_argument

SETTINGS_TABLES = "the settings' budget, data, vae, dit, rollout, eval; config, seed"


def _settings(args):
    from characters_jax.config import load_config
    from characters_jax.config.loader import split_sets
    from characters_jax.train.settings import SETTINGS_KEYS, load_settings

    settings_items, config_items = split_sets(args.set, SETTINGS_KEYS)
    s = load_settings(args.settings, settings_items)
    cfg = load_config(s.config, config_items)
    return cfg, s


def _all(args) -> int:
    from characters_jax.train.pipeline import train_all

    cfg, s = _settings(args)
    train_all(cfg, s, args.out, export=args.export)
    return 0


def _rollout(args) -> int:
    from characters_jax.train.finetune import finetune

    cfg, s = _settings(args)
    finetune(cfg, s, args.weights, args.out, export=args.export)
    return 0


def _decoder(args) -> int:
    from characters_jax.train.finetune import finetune_decoder

    cfg, s = _settings(args)
    finetune_decoder(cfg, s, args.weights, args.out, export=args.export)
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
    from characters_jax.config.arguments import config_sets
    from characters_jax.config.loader import with_sets
    from characters_jax.train.demo_assets import DemoClip, write_demo_assets

    config_items, clip_items = config_sets(args.set)
    cfg = load_config(args.config, config_items)
    clip = with_sets(DemoClip(), "demo_clip", clip_items)
    for path in write_demo_assets(cfg, args.out, clip):
        print(f"wrote {path}")
    return 0


def _errors(func):
    def run(args) -> int:
        from characters_jax.weights.directory import WeightsError

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
        q.add_argument("--settings", default="talking",
                       help="training settings: configs/train/NAME.toml or a path (default: talking); its `config` "
                            "names the model config (--set config=NAME)")
        add_set_argument(q, SETTINGS_TABLES + "; the model config's: " + CONFIG_TABLES)

    def resumable(name, help, func, from_weights: bool) -> None:
        """A stage that writes a resumable output directory (from_weights: a fine-tune of a
        trained weights directory)."""
        q = sub.add_parser(name, help=help)
        common(q)
        if from_weights:
            q.add_argument("--weights", required=True,
                           help="the weights directory to start from (e.g. checkpoints/talking)")
        q.add_argument("--out", required=True, help="output directory; a rerun resumes from it (wall-clock deadline: "
                                                    "budget.deadline_s)")
        q.add_argument("--export", default=None,
                       help="also copy weights.tar, eval.json, eval.md and summary.json here as each is written")
        q.set_defaults(func=_errors(func))

    resumable("all", "data, VAE, latents, DiT, weights and evaluation within a deadline (resumable)", _all,
              from_weights=False)
    resumable("rollout", "the self-rollout stage from a trained weights directory (a fine-tune; resumable), then its "
                         "weights and evaluation", _rollout, from_weights=True)
    resumable("decoder", "the VAE's decoder trained again on longer streams (--set vae.chunks=N), the encoder and the "
                         "DiT kept; then its weights and evaluation (resumable)", _decoder, from_weights=True)

    q = sub.add_parser("eval", help="lip sync, identity and drift of a weights directory on held-out clips")
    common(q)
    q.add_argument("--weights", required=True, help="weights directory (e.g. checkpoints/talking)")
    q.add_argument("--out", required=True, help="output directory (plans, eval.json, eval.md)")
    q.set_defaults(func=_errors(_eval))

    q = sub.add_parser("demo-assets", help="a held-out portrait (PNG), speech (WAV) and mouth tracks for the demo")
    q.add_argument("--config", default="talking", help="model config (its video size)")
    q.add_argument("--out", required=True)
    add_set_argument(q, "demo_clip (index: the held-out clip, default 1000, past the evaluation's; seconds; seed)")
    q.set_defaults(func=_errors(_demo_assets))
