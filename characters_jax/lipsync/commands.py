"""`characters-jax lipsync`: train-probe, evaluate, score; train-features, fidelity."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys

from characters_jax.config.arguments import add_set_argument

# kind: (steps, conv widths) of the shipped weights
DEFAULTS = {"mouth": (6000, (24, 32, 48, 64)), "identity": (3000, (16, 24, 32, 48))}


@dataclasses.dataclass(frozen=True)
class EvaluateSpec:
    """`lipsync evaluate`'s held-out set (the `evaluate` table)."""

    clips: int = 24
    identities: int = 24  # held-out identities in the identification test
    seconds: float = 8.0
    height: int = 64
    width: int = 96
    seed: int = 0

    def __post_init__(self):
        for name in ("clips", "identities"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: must be at least 2, got {getattr(self, name)}")


def _train_probe(args) -> int:
    from characters_jax.lipsync.probe import default_path

    try:
        from characters_jax.lipsync.train import TrainSpec, train_probe
    except ImportError as err:
        print(f"characters-jax lipsync train-probe: {err} (pip install -e '.[train]')", file=sys.stderr)
        return 2

    from characters_jax.config.loader import with_sets

    kind = with_sets(TrainSpec(), "probe", args.set).kind  # the kind picks the other keys' defaults
    if kind not in DEFAULTS:
        print(f"characters-jax lipsync train-probe: probe.kind: must be one of {tuple(DEFAULTS)}, got {kind!r}", file=sys.stderr)
        return 2
    steps, widths = DEFAULTS[kind]
    spec = with_sets(TrainSpec(kind=kind, steps=steps, widths=widths), "probe", args.set)
    probe, meta = train_probe(spec)
    return _save_trained(probe, meta, args.out or default_path(spec.kind))


def _save_trained(net, meta: dict, out) -> int:
    """Saves a trained probe or feature network to `out` with the command that trained it in
    its meta, prints its validation figures (JSON) and the path."""
    command = "characters-jax lipsync " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    net = dataclasses.replace(net, cfg=dataclasses.replace(net.cfg, meta={**net.cfg.meta, "command": command}))
    net.save(out)
    print(json.dumps(meta["validation"], indent=1))
    print(f"wrote {out}")
    return 0


def _train_features(args) -> int:
    from characters_jax.config.loader import with_sets
    from characters_jax.lipsync.feature_net import FeatureSpec, default_path, train_features

    spec = with_sets(FeatureSpec(), "features", args.set)
    net, meta = train_features(spec)
    return _save_trained(net, meta, args.out or default_path())


def _fidelity(args) -> int:
    from characters_jax.config.loader import with_sets
    from characters_jax.data.speech import EspeakError
    from characters_jax.weights.directory import WeightsError
    from characters_jax.lipsync.fidelity_eval import ValidationSettings, markdown, validate_measure

    settings = with_sets(ValidationSettings(), "fidelity", args.set)  # a bad key: exit code 2
    try:
        result = validate_measure(settings)
    except (EspeakError, WeightsError, ValueError, FileNotFoundError) as err:
        print(f"characters-jax lipsync fidelity: {err}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


def _evaluate(args) -> int:
    from characters_jax.config.loader import with_sets
    from characters_jax.data.speech import EspeakError
    from characters_jax.lipsync.evaluate import evaluate

    try:
        spec = with_sets(EvaluateSpec(), "evaluate", args.set)
    except ValueError as err:
        print(f"characters-jax lipsync evaluate: {err}", file=sys.stderr)
        return 2
    try:
        result = evaluate(**dataclasses.asdict(spec))
    except (EspeakError, ValueError, FileNotFoundError) as err:
        print(f"characters-jax lipsync evaluate: {err}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def _score(args) -> int:
    from characters_jax.lipsync.evaluate import score_directory

    try:
        result = score_directory(args.data, max_lag=args.max_lag)
    except (FileNotFoundError, ValueError) as err:
        print(f"characters-jax lipsync score: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("lipsync", help="the lip-sync and fidelity measures: train their networks, evaluate "
                                              "them, score clips")
    sub = p.add_subparsers(dest="lipsync_command", metavar="ACTION", required=True)

    t = sub.add_parser("train-probe", help="train the mouth or identity probe on rendered faces (no espeak)")
    t.add_argument("--out", default=None, help="weights file (default: the shipped characters_jax/lipsync/weights/)")
    add_set_argument(t, "probe (lipsync.train.TrainSpec: kind (mouth | identity), steps (default 6000 mouth, 3000 identity), batch, pool "
                        "(rendered frames the batches are drawn from), lr, weight_decay, seed, validation, widths "
                        "(conv channels; default [24, 32, 48, 64] mouth, [16, 24, 32, 48] identity), frame_sizes)")
    t.set_defaults(func=_train_probe)

    e = sub.add_parser("evaluate", help="the probes and the score on held-out clips (espeak-ng speech)")
    e.add_argument("--json", default=None, help="also write the result here")
    add_set_argument(e, "evaluate (clips, identities, seconds, height, width, seed)")
    e.set_defaults(func=_evaluate)

    f = sub.add_parser("train-features", help="train the fidelity measure's feature network on rendered faces (no espeak)")
    f.add_argument("--out", default=None, help="weights file (default: the shipped characters_jax/lipsync/weights/)")
    add_set_argument(f, "features (lipsync.feature_net.FeatureSpec: steps, batch, pool, lr, weight_decay, seed, "
                        "quality_p, widths, frame_sizes, validation)")
    f.set_defaults(func=_train_features)

    v = sub.add_parser("fidelity", help="the fidelity measure's figures: ground truth, the VAE, planted faults, "
                                        "a weights directory's frames (espeak-ng speech)")
    v.add_argument("--json", default=None, help="also write the result here")
    add_set_argument(v, "fidelity (weights: a weights directory, 'auto': the bundled talking weights, 'none': no VAE "
                        "or generated rows; config, clips: held-out clips, seconds, seed, demo: the weights' demo clip "
                        "too, random_weights: the random-weights row)")
    v.set_defaults(func=_fidelity)

    s = sub.add_parser("score", help="lip sync of a data directory's frames against its mouth tracks")
    s.add_argument("--data", required=True, help="a directory written by `characters-jax data`")
    s.add_argument("--max-lag", type=int, default=15)
    s.set_defaults(func=_score)
