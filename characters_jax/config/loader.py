"""The one TOML loader: frozen dataclasses from TOML tables, `--set TABLE.KEY=VALUE` on top.

A root dataclass (the model `Config`, the training settings) reads a TOML document: its
scalar fields are top-level keys, its dataclass fields are tables. Inside a table, a field
that is itself a dataclass has its keys beside the table's own, each behind the field's
``metadata["prefix"]`` if it has one: `[vae]` holds the optimizer's `lr` beside its own
`batch`, `[serve]` the image limits' `image_max_bytes`. Only fields whose default is a
bool, int, float, str or tuple are keys. A value must have its default's type (an int is
taken for a float, a list for a tuple, element by element); the dataclass's own checks
(``__post_init__``) run when it is built. Every error is a ConfigError naming TABLE.KEY.

`--set TABLE.KEY=VALUE` (`--set KEY=VALUE` for a top-level key; repeatable) replaces one
value of the document before it is built: VALUE in TOML syntax (8, 1e-3, true, "text",
[8, 16]), else the text as it is; a key whose default is a string always takes the text.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import tomllib
from collections.abc import Iterable
from typing import Any

KEY_TYPES = (bool, int, float, str, tuple)


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Given:
    """A value given by `--set`: its text and its TOML reading (the text where that fails)."""

    text: str
    value: Any


def read_toml(name_or_path: str, directory: pathlib.Path, what: str) -> tuple[dict, pathlib.Path]:
    """(the parsed document, its path) of `directory/<name>.toml`, or of a .toml path. Raises
    ConfigError naming `what` and the known names when there is no such file, or the line
    of a TOML syntax error."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = directory / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.toml")))
        raise ConfigError(f"{what} {name_or_path!r} not found (known: {known})")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh), path
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None


def parse_set(item: str) -> tuple[tuple[str, ...], Given]:
    """`TABLE.KEY=VALUE` -> ((TABLE, KEY), Given); `KEY=VALUE` -> ((KEY,), Given)."""
    key, sep, text = item.partition("=")
    path = tuple(part.strip() for part in key.strip().split("."))
    if not sep or not all(path) or len(path) > 2:
        raise ConfigError(f"--set {item!r}: expected TABLE.KEY=VALUE (or KEY=VALUE for a top-level key)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return path, Given(text, value)


def apply_sets(raw: dict, items: Iterable[str]) -> dict:
    """A copy of the document `raw` with each `--set` item placed in it (in order: the last
    of two items with one key wins)."""
    out = copy.deepcopy(raw)
    for item in items:
        path, given = parse_set(item)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is a key, not a table")
        node[path[-1]] = given
    return out


def set_tables(items: Iterable[str]) -> set[str]:
    """The first name of each `--set` item's key (its table, or a top-level key)."""
    return {parse_set(item)[0][0] for item in items}


def split_sets(items: Iterable[str], names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the items whose table or top-level key is one of `names`, the others)."""
    names = set(names)
    ours, others = [], []
    for item in items:
        (ours if parse_set(item)[0][0] in names else others).append(item)
    return ours, others


def table_keys(obj: Any) -> dict[str, tuple[str, ...]]:
    """{key: the field path it sets} of a table's dataclass (nested dataclasses flattened
    behind their field's prefix)."""
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        default = getattr(obj, f.name)
        if dataclasses.is_dataclass(default):
            prefix = f.metadata.get("prefix", "")
            keys = {prefix + k: (f.name, *path) for k, path in table_keys(default).items()}
        elif isinstance(default, KEY_TYPES):
            keys = {f.name: (f.name,)}
        else:
            continue
        for k in keys:
            if k in out:
                raise TypeError(f"{type(obj).__name__}: two fields give the key {k!r}")
        out.update(keys)
    return out


def from_table(obj: Any, raw: Any, where: str) -> Any:
    """The dataclass `obj` with the keys of the table `raw` (a dict) set; `where` is the
    table's name in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table, got {_shown(raw)}")
    keys = table_keys(obj)
    changes: dict[tuple[str, ...], Any] = {}
    for key, value in raw.items():
        path = keys.get(key)
        if path is None:
            raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(keys))})")
        changes[path] = coerce(f"{where}.{key}", _get(obj, path), value)
    return _replace(obj, changes, where, set(keys))


def from_document(root: Any, raw: dict) -> Any:
    """The root dataclass `root` with the document `raw` applied: top-level keys and tables."""
    fields = {f.name: f for f in dataclasses.fields(root) if f.init}
    changes = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{key}: unknown table or key (known: {', '.join(sorted(fields))})")
        default = getattr(root, key)
        if dataclasses.is_dataclass(default):
            changes[(key,)] = from_table(default, value, key)
        else:
            changes[(key,)] = coerce(key, default, value)
    return _replace(root, changes, "", set(fields))


def with_sets(obj: Any, table: str, items: Iterable[str]) -> Any:
    """The options dataclass `obj` of a command that reads no file, with `--set` items
    (all of table `table`) applied."""
    raw = apply_sets({}, items)
    for name in raw:
        if name != table:
            raise ConfigError(f"{name}: unknown table (known: {table})")
    return from_table(obj, raw.get(table, {}), table)


def coerce(where: str, default: Any, value: Any) -> Any:
    """`value` as the type of `default` (ConfigError naming `where` when it is not)."""
    text = None
    if isinstance(value, Given):
        text, value = value.text, value.value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if text is not None:
            return text.strip()
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_shown(value)}")
        if not default:
            return tuple(value)
        return tuple(coerce(f"{where}[{i}]", default[0], v) for i, v in enumerate(value))
    else:
        return value
    raise ConfigError(f"{where}: expected {type(default).__name__}, got {_shown(value)}")


def _shown(value: Any) -> str:
    return repr(value.text if isinstance(value, Given) else value)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def _replace(obj: Any, changes: dict[tuple[str, ...], Any], where: str, keys: set[str]) -> Any:
    """obj with each field path of `changes` set (nested dataclasses rebuilt); a check that
    fails is a ConfigError named after `where`."""
    if not changes:
        return obj
    direct, nested = {}, {}
    for path, value in changes.items():
        if len(path) == 1:
            direct[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1:]] = value
    for name, sub in nested.items():
        direct[name] = _replace(getattr(obj, name), sub, where, keys)
    try:
        return dataclasses.replace(obj, **direct)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(_named(where, str(err), keys)) from None


def _named(where: str, message: str, keys: set[str]) -> str:
    """A dataclass's check message ("lead_chunks: must be >= 1") as TABLE.KEY: ..."""
    if not where:
        return message
    head = message.split(":", 1)[0].strip()
    return f"{where}.{message}" if head in keys else f"{where}: {message}"
