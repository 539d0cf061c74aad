"""`characters-jax lipsync`: train-probe, evaluate, score; train-features, fidelity."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys


# kind: (steps, conv widths) of the shipped weights
DEFAULTS = {"mouth": (6000, "24,32,48,64"), "identity": (3000, "16,24,32,48")}


def _train_probe(args) -> int:
    from characters_jax.lipsync.probe import default_path

    try:
        from characters_jax.lipsync.train import TrainSpec, train_probe
    except ImportError as err:
        print(f"characters-jax lipsync train-probe: {err} (pip install -e '.[train]')", file=sys.stderr)
        return 2

    steps, widths = DEFAULTS[args.kind]
    spec = TrainSpec(kind=args.kind, steps=args.steps or steps, batch=args.batch, pool=args.pool, seed=args.seed,
                     lr=args.lr, widths=tuple(int(w) for w in (args.widths or widths).split(",")))
    probe, meta = train_probe(spec)
    out = args.out or default_path(args.kind)
    command = "characters-jax lipsync " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    probe = dataclasses.replace(probe, cfg=dataclasses.replace(probe.cfg, meta={**probe.cfg.meta, "command": command}))
    probe.save(out)
    print(json.dumps(meta["validation"], indent=1))
    print(f"wrote {out}")
    return 0


def _train_features(args) -> int:
    from characters_jax.lipsync.feature_net import FeatureSpec, default_path, train_features

    spec = FeatureSpec(steps=args.steps, batch=args.batch, pool=args.pool, seed=args.seed, lr=args.lr)
    net, meta = train_features(spec)
    out = args.out or default_path()
    command = "characters-jax lipsync " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    net = dataclasses.replace(net, cfg=dataclasses.replace(net.cfg, meta={**net.cfg.meta, "command": command}))
    net.save(out)
    print(json.dumps(meta["validation"], indent=1))
    print(f"wrote {out}")
    return 0


def _fidelity(args) -> int:
    from characters_jax.data.speech import EspeakError
    from characters_jax.decoder.weights import WeightsError
    from characters_jax.lipsync.fidelity_eval import ValidationSettings, markdown, validate_measure

    settings = ValidationSettings(weights=args.weights, clips=args.clips, seconds=args.seconds, seed=args.seed,
                                  demo=not args.no_demo, random_weights=not args.no_random)
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
    from characters_jax.data.speech import EspeakError
    from characters_jax.lipsync.evaluate import evaluate

    if args.clips < 2 or args.identities < 2:
        print("characters-jax lipsync evaluate: --clips and --identities must be at least 2", file=sys.stderr)
        return 2
    try:
        result = evaluate(clips=args.clips, seconds=args.seconds, height=args.height, width=args.width,
                          seed=args.seed, identities=args.identities)
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
    t.add_argument("--kind", choices=("mouth", "identity"), default="mouth")
    t.add_argument("--steps", type=int, default=None, help="default: 6000 (mouth), 3000 (identity)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--pool", type=int, default=8192, help="rendered frames the batches are drawn from")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--widths", default=None,
                   help="conv channels, comma-separated (default: 24,32,48,64 mouth, 16,24,32,48 identity)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="weights file (default: the shipped characters_jax/lipsync/weights/)")
    t.set_defaults(func=_train_probe)

    e = sub.add_parser("evaluate", help="the probes and the score on held-out clips (espeak-ng speech)")
    e.add_argument("--clips", type=int, default=24)
    e.add_argument("--identities", type=int, default=24, help="held-out identities in the identification test")
    e.add_argument("--seconds", type=float, default=8.0)
    e.add_argument("--height", type=int, default=64)
    e.add_argument("--width", type=int, default=96)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", default=None, help="also write the result here")
    e.set_defaults(func=_evaluate)

    f = sub.add_parser("train-features", help="train the fidelity measure's feature network on rendered faces (no espeak)")
    f.add_argument("--steps", type=int, default=3000)
    f.add_argument("--batch", type=int, default=64)
    f.add_argument("--pool", type=int, default=8192, help="rendered frames the batches are drawn from")
    f.add_argument("--lr", type=float, default=2e-3)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", default=None, help="weights file (default: the shipped characters_jax/lipsync/weights/)")
    f.set_defaults(func=_train_features)

    v = sub.add_parser("fidelity", help="the fidelity measure's figures: ground truth, the VAE, planted faults, "
                                        "a weights directory's frames (espeak-ng speech)")
    v.add_argument("--weights", default="auto",
                   help="weights directory ('auto': the bundled talking weights; 'none': no VAE or generated rows)")
    v.add_argument("--clips", type=int, default=4, help="held-out clips")
    v.add_argument("--seconds", type=float, default=8.0)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-demo", action="store_true", help="leave out the weights' demo clip")
    v.add_argument("--no-random", action="store_true", help="leave out the random-weights row")
    v.add_argument("--json", default=None, help="also write the result here")
    v.set_defaults(func=_fidelity)

    s = sub.add_parser("score", help="lip sync of a data directory's frames against its mouth tracks")
    s.add_argument("--data", required=True, help="a directory written by `characters-jax data`")
    s.add_argument("--max-lag", type=int, default=15)
    s.set_defaults(func=_score)
