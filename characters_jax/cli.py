"""`characters-jax`: one console entry, one sub-command per job.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code). Modules are imported only when listed here, and a
command's heavy imports happen inside its `func`, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "characters_jax.measure.bench",  # bench
    "characters_jax.weights.commands",  # init-checkpoint
    "characters_jax.serving.commands",  # serve
    "characters_jax.decoder.commands",  # decode-serve
    "characters_jax.client.commands",  # talk
    "characters_jax.demo.commands",  # demo
    "characters_jax.viewer.commands",  # view
    "characters_jax.gate.commands",  # gate
    "characters_jax.data.commands",  # data
    "characters_jax.lipsync.commands",  # lipsync
    "characters_jax.train.commands",  # train
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="characters-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from characters_jax.serving.supervisor import die_with_parent

    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from characters_jax.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"characters-jax {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
