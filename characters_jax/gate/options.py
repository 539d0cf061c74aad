"""The gate's settings: TOML tables beside the model config's, set with `--set TABLE.KEY=VALUE`.

  [gate]     the verdict: reference runs and their perturbations, the variation rule, the
             allowed factor and floor, the reference's cache, the time budget, quiet
  [latent]   the random-weights session the latent distance runs without a checkpoint
             (steps, float weights) and its frame decoder for PSNR
  [clips]    the held-out clips every run of the trained model scores
  [lipsync]  the drift clips of the lip-sync metric

A key's default lives here once; a bad key or value is a ConfigError naming TABLE.KEY.
The model's own keys (`model.dtype`, `model.num_blocks`, `engine.*`, `cache.*`, `seed`)
stay the config's.
"""

from __future__ import annotations

import dataclasses

from characters_jax.config.loader import from_document, apply_sets

PERTURBATIONS = ("ulp", "tp", "repeat", "seed")
VARIATION_RULES = ("max", "rms")
DECODERS = ("config", "small", "none")


@dataclasses.dataclass(frozen=True)
class GateOptions:
    """[gate]. runs: reference runs (the base run and runs-1 perturbed ones); perturb: their
    kinds, cycled (empty: the workload's default); variation: the score metrics' rule
    (`variation.Variation`); factor: the allowed multiple of the reference's variation;
    floor: the least tolerance; ref_cache_dtype: the reference's launch cache; time_budget_s:
    variants not started by then are not run (0: no budget); quiet: no progress lines."""

    runs: int = 4
    perturb: tuple[str, ...] = ()
    variation: str = "max"
    factor: float = 2.0
    floor: float = 1e-6
    ref_cache_dtype: str = "bf16"
    time_budget_s: float = 0.0
    quiet: bool = False

    def __post_init__(self):
        if self.runs < 2:
            raise ValueError(f"runs: must be >= 2 (a base run and a perturbed one), got {self.runs}")
        unknown = sorted(set(self.perturb) - set(PERTURBATIONS))
        if unknown:
            raise ValueError(f"perturb: unknown perturbation(s) {unknown}; known: {', '.join(PERTURBATIONS)}")
        if self.variation not in VARIATION_RULES:
            raise ValueError(f"variation: must be one of {', '.join(VARIATION_RULES)}, got {self.variation!r}")
        if not self.factor > 0:
            raise ValueError(f"factor: must be positive, got {self.factor}")
        if self.floor < 0:
            raise ValueError(f"floor: must be >= 0, got {self.floor}")
        if self.ref_cache_dtype not in ("bf16", "float32"):
            raise ValueError(f"ref_cache_dtype: must be bf16 or float32, got {self.ref_cache_dtype!r}")
        if self.time_budget_s < 0:
            raise ValueError(f"time_budget_s: must be >= 0, got {self.time_budget_s}")


@dataclasses.dataclass(frozen=True)
class LatentOptions:
    """[latent]. steps: steps of the random-weights session (one latent frame each);
    decoder: the frame decoder of its PSNR (config: the config's VAE decoder, small: one
    with channels / 8, none), fixed random weights; float_weights: keep the random block
    weights as drawn (default: snapped to the FP8 grid, so FP8-weight variants run the same
    model and only their arithmetic is judged)."""

    steps: int = 12
    decoder: str = "config"
    float_weights: bool = False

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder: must be one of {', '.join(DECODERS)}, got {self.decoder!r}")


@dataclasses.dataclass(frozen=True)
class ClipOptions:
    """[clips]. count held-out clips of `seconds` each (identities, voices and words never
    trained on), their plans kept in `plans_dir` so a rerun reuses them."""

    count: int = 51
    seconds: float = 4.0
    plans_dir: str = "out/gate-plans"

    def __post_init__(self):
        if self.count < 2:
            raise ValueError(f"count: must be >= 2, got {self.count}")
        if not self.seconds > 0:
            raise ValueError(f"seconds: must be positive, got {self.seconds}")


@dataclasses.dataclass(frozen=True)
class LipsyncOptions:
    """[lipsync]. drift_clips longer held-out clips of drift_seconds (0: drift not
    measured); drift: the last drift_window_s seconds of each against the first."""

    drift_clips: int = 2
    drift_seconds: float = 16.0
    drift_window_s: float = 4.0

    def __post_init__(self):
        if self.drift_clips < 0:
            raise ValueError(f"drift_clips: must be >= 0, got {self.drift_clips}")
        if self.drift_clips and 2 * self.drift_window_s > self.drift_seconds:
            raise ValueError(f"drift_window_s: must be at most half of drift_seconds ({self.drift_seconds:g} s), "
                             f"got {self.drift_window_s:g}")


@dataclasses.dataclass(frozen=True)
class GateTables:
    """The gate's tables (the root of its `--set` items)."""

    gate: GateOptions = GateOptions()
    latent: LatentOptions = LatentOptions()
    clips: ClipOptions = ClipOptions()
    lipsync: LipsyncOptions = LipsyncOptions()


TABLES = tuple(f.name for f in dataclasses.fields(GateTables))


def gate_tables(items) -> GateTables:
    """GateTables with `--set` items (all of the gate's tables) applied; ConfigError naming
    TABLE.KEY for a bad one."""
    return from_document(GateTables(), apply_sets({}, items))
