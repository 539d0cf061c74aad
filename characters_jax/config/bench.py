"""The `[bench]` table: how `characters-jax bench` times a config's step (besides --steps,
--tp and the engine the config's [engine] and [cache] tables pick)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    warmup: int = 3  # steps run before the timed ones
    upkeep_steps_per_call: int = 8  # steps of cache operations per timed call of the upkeep measure
    progress: int = 0  # log every N steps (0: off)
    quiet: bool = False  # no log lines (the table and the JSON only)
    profile_dir: str = ""  # after timing, trace a few steps here and add their component breakdown ("": off)
    profile_steps: int = 3  # steps traced into profile_dir
    # trace a second compile of the step with XLA command buffers off: inside command buffers
    # the GPU trace names Pallas (Mosaic) kernels MemcpyD2D, so their time falls under 'other'
    profile_without_command_buffers: bool = False

    def __post_init__(self):
        for name in ("warmup", "progress"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("upkeep_steps_per_call", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
