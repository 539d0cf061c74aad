"""CLI sub-commands of the demonstrator's data and its measure: data, lipsync."""

from __future__ import annotations

import sys


def _data(args) -> int:
    from characters_jax.data.clips import ClipSpec, write_demo_assets
    from characters_jax.data.shards import write_shards
    from characters_jax.data.speech import EspeakError

    try:
        spec = ClipSpec(seconds=args.seconds, height=args.height, width=args.width)
    except ValueError as err:
        print(f"characters-jax data: {err}", file=sys.stderr)
        return 2
    try:
        if args.demo_out:
            png, wav = write_demo_assets(args.demo_out, index=args.first_index, seed=args.seed, spec=spec,
                                         split=args.split)
            print(f"wrote {png} and {wav}")
            return 0
        if args.clips is None or args.out is None:
            print("characters-jax data: --clips and --out are required (or --demo-out)", file=sys.stderr)
            return 2
        manifest = write_shards(args.out, args.split, args.clips, spec, seed=args.seed, workers=args.workers,
                                shard_size=args.shard_size, first_index=args.first_index,
                                render_batch=args.render_batch, progress=not args.quiet)
    except (EspeakError, ValueError, OSError) as err:
        print(f"characters-jax data: {err}", file=sys.stderr)
        return 1
    print(f"wrote {manifest['clips']} clips ({spec.num_frames} frames, {spec.num_samples} samples each) "
          f"in {len(manifest['shards'])} shards to {args.out}")
    return 0


def register(subparsers) -> None:
    from characters_jax.data.splits import SPLITS

    p = subparsers.add_parser("data", help="synthetic talking-face clips (espeak-ng speech, cartoon faces) into npz shards")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--clips", type=int, default=None, help="number of clips")
    p.add_argument("--seconds", type=float, default=4.0, help="clip length (rounded up to whole 4-frame chunks)")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--out", default=None, help="output directory (manifest.json + shard-NNNNN.npz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-index", type=int, default=0, help="index of the first clip in its split")
    p.add_argument("--workers", type=int, default=None, help="planning processes (default: cores - 1, at most 16)")
    p.add_argument("--shard-size", type=int, default=64, help="clips per shard")
    p.add_argument("--render-batch", type=int, default=8, help="clips rendered per call of the jax renderer")
    p.add_argument("--demo-out", default=None,
                   help="instead of shards: write clip --first-index's portrait (PNG) and speech (WAV) here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_data)
