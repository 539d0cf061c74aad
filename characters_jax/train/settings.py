"""What `characters-jax train` runs: sizes, time shares and hyper-parameters of every stage.

A settings file is `configs/train/<name>.toml` (or a path): top-level `config` (the model
config it trains) and `seed`, then one table per stage. In `[vae]` and `[dit]`, the
optimizer's fields (`OptimSettings`: lr, warmup_steps, ...) and the loop's (`LoopSettings`:
max_steps, log_every, save_every_s) sit beside the stage's own; so in `[rollout]` (the
self-rollout stage, run when `budget.rollout` gives it a share). The config loader
(`characters_jax.config.loader`) reads it; `--set dit.batch=8` style overrides apply on top;
an unknown key or a value of the wrong type is an error that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from characters_jax.config import CONFIG_DIR
from characters_jax.config.loader import apply_sets, from_document, read_toml
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


SETTINGS_KEYS = frozenset(f.name for f in dataclasses.fields(TrainSettings))


def settings_from_dict(raw: dict) -> TrainSettings:
    """TrainSettings from a parsed document (missing keys and tables take their defaults)."""
    return from_document(TrainSettings(), raw)


def load_settings(name_or_path: str, overrides: Iterable[str] = ()) -> TrainSettings:
    """configs/train/<name>.toml (or a .toml path), then `--set` items `TABLE.KEY=VALUE`
    (values in TOML syntax: 8, 1e-3, true, "text")."""
    raw, _ = read_toml(name_or_path, TRAIN_DIR, "training settings")
    return settings_from_dict(apply_sets(raw, overrides))


# Plain names for the stages' nested settings (imported here for one import site).
__all__ = ["BudgetSettings", "DataSettings", "DitSettings", "EvalSettings", "LoopSettings", "OptimSettings",
           "RolloutSettings", "SETTINGS_KEYS", "TrainSettings", "VaeSettings", "load_settings", "settings_from_dict"]
