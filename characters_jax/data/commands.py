"""CLI sub-commands of the demonstrator's data and its measure: data, lipsync."""

from __future__ import annotations

import sys

from characters_jax.config.arguments import add_set_argument


def _data(args) -> int:
    from characters_jax.config.loader import with_sets
    from characters_jax.data.clips import write_demo_assets
    from characters_jax.data.shards import DataOptions, write_shards
    from characters_jax.data.speech import EspeakError

    try:
        o = with_sets(DataOptions(), "data", args.set)
        spec = o.clip
    except ValueError as err:
        print(f"characters-jax data: {err}", file=sys.stderr)
        return 2
    try:
        if args.out is None:
            print("characters-jax data: --out is required", file=sys.stderr)
            return 2
        if o.demo:
            png, wav = write_demo_assets(args.out, index=o.first_index, seed=o.seed, spec=spec, split=args.split)
            print(f"wrote {png} and {wav}")
            return 0
        if args.clips is None:
            print("characters-jax data: --clips is required (or --set data.demo=true)", file=sys.stderr)
            return 2
        manifest = write_shards(args.out, args.split, args.clips, spec, seed=o.seed, workers=o.workers or None,
                                shard_size=o.shard_size, first_index=o.first_index,
                                render_batch=o.render_batch, progress=not o.quiet)
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
    p.add_argument("--out", default=None, help="output directory (manifest.json + shard-NNNNN.npz)")
    add_set_argument(p, "data (seconds, height, width, seed, first_index, workers, shard_size, render_batch, quiet; "
                        "demo: instead of shards, clip first_index's portrait (PNG) and speech (WAV))")
    p.set_defaults(func=_data)
