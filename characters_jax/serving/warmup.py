"""The worker's warm-up, before it serves: the generator runs every program a session runs
(its `warmup`) and the audio front end its one program, so that no session compiles; then
`timed_steps` steps are timed: the worker's honest speed, logged at start-up."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.engine.interface import Generator


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """warmup_s: the programs' first runs (their compiles where not compiled before);
    step_ms: the timed steps' median (0.0 when none were timed); fps_capacity: frames per
    second at that step time; real_time: whether a step fits the video's step duration."""

    warmup_s: float
    step_ms: float
    fps_capacity: float
    real_time: bool


def warm_up(generator: Generator, frontend: AudioFrontEnd, timed_steps: int = 0) -> WarmupReport:
    """Warms the generator and the front end up, then times `timed_steps` steps (each waited
    for: the only host syncs, all before the worker serves)."""
    t0 = time.perf_counter()
    tokens = frontend.tokens(np.zeros(frontend.spec.window_samples, np.float32))
    generator.warmup()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(timed_steps):
        t = time.perf_counter()
        jax.block_until_ready(generator.step(tokens))
        times.append(time.perf_counter() - t)
    v = generator.config.video
    step_ms = float(np.median(times)) * 1e3 if times else 0.0
    fps = v.frames_per_step / (step_ms / 1e3) if step_ms else 0.0
    return WarmupReport(warmup_s, step_ms, fps, step_ms <= v.step_seconds * 1e3)
