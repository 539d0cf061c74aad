"""The command line's side of the config surface: `--config` and `--set` on every command
that reads a config, and the `--set` items a command hands to one it starts."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable

from characters_jax.config.loader import split_sets
from characters_jax.config.model import Config, load_config

SET_HELP = ("set one key: TABLE.KEY=VALUE (KEY=VALUE for a top-level key), repeatable; VALUE in TOML syntax "
            "(8, 1e-3, true, \"text\", [8, 16]) or plain text; the README's 'Configs' lists every table and key")
CONFIG_TABLES = "the config's tables: model, video, cache, sampler, audio, decoder, engine, serve, bench; seed"


def add_set_argument(parser: argparse.ArgumentParser, tables: str = CONFIG_TABLES) -> None:
    """`--set TABLE.KEY=VALUE` (repeatable) into `args.set` (a list, empty by default)."""
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help=f"{SET_HELP}. Tables: {tables}")


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None = "talking", tables: str = CONFIG_TABLES) -> None:
    """`--config NAME|PATH` (required when `default` is None) and `--set`."""
    what = "config name (configs/NAME.toml) or .toml path"
    if default is None:
        parser.add_argument("--config", required=True, help=what)
    else:
        parser.add_argument("--config", default=default, help=f"{what} (default: {default})")
    add_set_argument(parser, tables)


def config_from_args(args: argparse.Namespace) -> Config:
    """The config of `--config` with `--set` applied (ConfigError naming a bad key)."""
    return load_config(args.config, getattr(args, "set", ()) or ())


def config_keys() -> frozenset[str]:
    """The top-level keys and tables of a model config."""
    return frozenset(f.name for f in dataclasses.fields(Config))


def config_sets(items: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the `--set` items for the model config, the others)."""
    return split_sets(items, config_keys())


def set_argv(items: Iterable[str]) -> list[str]:
    """`--set` items as a command line, for a command that starts another."""
    return [arg for item in items for arg in ("--set", item)]
