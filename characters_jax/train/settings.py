"""What `characters-jax train` runs: sizes, time shares and hyper-parameters of every stage.

A settings file is `configs/train/<name>.toml` (or a path): top-level `config` (the model
config it trains) and `seed`, then one table per stage. In `[vae]` and `[dit]`, the
optimizer's fields (`OptimSettings`: lr, warmup_steps, ...) and the loop's (`LoopSettings`:
max_steps, log_every, save_every_s) sit beside the stage's own; so in `[rollout]` (the
self-rollout stage, run when `budget.rollout` gives it a share). `--set dit.batch=8` style
overrides apply on top; an unknown key is an error that names it.
"""

from __future__ import annotations

import dataclasses
import tomllib

from characters_jax.config import CONFIG_DIR, ConfigError, read_toml
from characters_jax.train.dit_train import DitSettings
from characters_jax.train.evaluate import EvalSettings
from characters_jax.train.loop import LoopSettings
from characters_jax.train.optim import OptimSettings
from characters_jax.train.self_rollout import RolloutSettings
from characters_jax.train.vae_train import VaeSettings

TRAIN_DIR = CONFIG_DIR / "train"


@dataclasses.dataclass(frozen=True)
class DataSettings:
    train_clips: int = 2048
    clip_seconds: float = 8.0  # 48 steps: every position the engine gives, one reset included
    heldout_clips: int = 51
    heldout_seconds: float = 8.0
    session_seconds: float = 60.0  # the drift sessions' length (0: none)
    sessions: int = 8  # drift sessions
    workers: int = 0  # planning processes (0: cores - 1)
    shard_size: int = 64
    min_train_clips: int = 64  # the DiT waits for at least this many


@dataclasses.dataclass(frozen=True)
class BudgetSettings:
    """Shares of the deadline: the VAE's, the self-rollout stage's (0: not run) and the
    evaluation's; the DiT gets what the VAE, the latents, the self-rollout stage and the
    packing leave before the evaluation (the data runs beside the VAE)."""

    deadline_s: float = 480.0
    vae: float = 0.30
    rollout: float = 0.0
    eval: float = 0.14


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    config: str = "talking"
    seed: int = 0
    budget: BudgetSettings = BudgetSettings()
    data: DataSettings = DataSettings()
    vae: VaeSettings = VaeSettings()
    dit: DitSettings = DitSettings()
    rollout: RolloutSettings = RolloutSettings()
    eval: EvalSettings = EvalSettings()


_NESTED = ("optim", "loop")


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)}


def _coerce(where: str, default, value):
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, (int, float, str)) and not isinstance(value, type(default)):
        raise ConfigError(f"{where}: expected {type(default).__name__}, got {value!r}")
    return value


def _section(name: str, obj, raw: dict):
    """obj (a stage's dataclass) with raw's keys set; nested optim/loop fields by name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table, got {raw!r}")
    own = _fields(type(obj))
    nested = {n: getattr(obj, n) for n in _NESTED if n in own}
    changes, sub = {}, {n: {} for n in nested}
    for key, value in raw.items():
        if key in own and key not in nested:
            changes[key] = _coerce(f"{name}.{key}", getattr(obj, key), value)
            continue
        for n, inner in nested.items():
            if key in _fields(type(inner)):
                sub[n][key] = _coerce(f"{name}.{key}", getattr(inner, key), value)
                break
        else:
            known = sorted(set(own) - set(nested) | {k for inner in nested.values() for k in _fields(type(inner))})
            raise ConfigError(f"{name}.{key}: unknown setting (known: {', '.join(known)})")
    for n, kw in sub.items():
        if kw:
            changes[n] = dataclasses.replace(nested[n], **kw)
    return dataclasses.replace(obj, **changes)


def settings_from_dict(raw: dict) -> TrainSettings:
    raw = dict(raw)
    s = TrainSettings()
    top = {}
    for key in ("config", "seed"):
        if key in raw:
            top[key] = _coerce(key, getattr(s, key), raw.pop(key))
    tables = {}
    for key, value in raw.items():
        if key not in ("budget", "data", "vae", "dit", "rollout", "eval"):
            raise ConfigError(f"{key}: unknown setting or table (known: config, seed, budget, data, vae, dit, rollout, "
                              "eval)")
        tables[key] = _section(key, getattr(s, key), value)
    return dataclasses.replace(s, **top, **tables)


def load_settings(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainSettings:
    """configs/train/<name>.toml (or a .toml path), then `section.key=value` overrides
    (values in TOML syntax: 8, 1e-3, true, "text")."""
    raw, _ = read_toml(name_or_path, TRAIN_DIR, "training settings")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare string
        *sections, leaf = key.strip().split(".")
        node = raw
        for sec in sections:
            node = node.setdefault(sec, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {sec} is not a table")
        node[leaf] = parsed
    return settings_from_dict(raw)


# Plain names for the stages' nested settings (imported here for one import site).
__all__ = ["BudgetSettings", "DataSettings", "DitSettings", "EvalSettings", "LoopSettings", "OptimSettings",
           "RolloutSettings", "TrainSettings", "VaeSettings", "load_settings", "settings_from_dict"]
