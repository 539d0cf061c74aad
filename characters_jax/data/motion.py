"""Per-frame face parameters besides identity: mouth, blinks and head motion.

A frame's parameters are float32 [FRAME_PARAMS] = (jaw, width, blink, dx, dy, tilt): the
mouth state (see `visemes`), eyelid closure in [0, 1], the head's offset in units of the
frame's height (dx right, dy down) and its roll in radians. Blinks and head motion are
independent of the speech, so nothing but the mouth carries the audio.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FRAME_PARAMS = 6
JAW, WIDTH, BLINK, DX, DY, TILT = range(FRAME_PARAMS)
# eyelid closure of one blink, one value per 1/24 s: fast down, slower up
_BLINK_SHAPE = np.asarray([0.45, 0.95, 1.0, 0.7, 0.35, 0.1])


@dataclasses.dataclass(frozen=True)
class MotionStyle:
    """blink_interval_s: mean seconds between blinks (gamma-distributed, at least min_interval_s);
    drift: head offset amplitude range (frame heights); tilt: roll amplitude range (radians);
    nods_per_s: rate of small downward nods."""

    blink_interval_s: float = 3.5
    min_blink_interval_s: float = 0.4
    drift: tuple[float, float] = (0.004, 0.016)
    tilt: tuple[float, float] = (0.005, 0.035)
    nods_per_s: float = 0.25
    nod_depth: float = 0.01


def blinks(rng: np.random.Generator, num_frames: int, fps: int, style: MotionStyle = MotionStyle()) -> np.ndarray:
    """float32 [T] eyelid closure in [0, 1]."""
    out = np.zeros(num_frames, np.float64)
    shape_t = np.arange(len(_BLINK_SHAPE)) / 24.0
    t = rng.uniform(0.2, style.blink_interval_s)
    frame_t = np.arange(num_frames) / fps
    while t < num_frames / fps:
        out = np.maximum(out, np.interp(frame_t - t, shape_t, _BLINK_SHAPE, left=0.0, right=0.0))
        gap = style.min_blink_interval_s + rng.gamma(2.0, (style.blink_interval_s - style.min_blink_interval_s) / 2)
        t += 0.3 if rng.random() < 0.08 else gap  # now and then a double blink
    return out.astype(np.float32)


def head_motion(rng: np.random.Generator, num_frames: int, fps: int, style: MotionStyle = MotionStyle()) -> np.ndarray:
    """float32 [T, 3] (dx, dy, tilt): a smooth drift (three slow sinusoids per axis) plus small nods."""
    t = np.arange(num_frames) / fps
    out = np.zeros((num_frames, 3), np.float64)
    for axis, (lo, hi) in enumerate((style.drift, style.drift, style.tilt)):
        freqs = rng.uniform(0.05, 0.45, 3)
        phases = rng.uniform(0, 2 * np.pi, 3)
        weights = rng.dirichlet(np.ones(3))
        wave = (weights[:, None] * np.sin(2 * np.pi * freqs[:, None] * t + phases[:, None])).sum(0)
        out[:, axis] = rng.uniform(lo, hi) * wave / max(np.abs(wave).max(), 1e-6)
    nods = rng.poisson(style.nods_per_s * num_frames / fps)
    for centre in rng.uniform(0, num_frames / fps, nods):
        out[:, 1] += style.nod_depth * rng.uniform(0.4, 1.0) * np.exp(-0.5 * ((t - centre) / 0.18) ** 2)
    return out.astype(np.float32)


def frame_params(track: np.ndarray, blink: np.ndarray, head: np.ndarray) -> np.ndarray:
    """float32 [T, FRAME_PARAMS] from a mouth track [T, 2], blinks [T] and head motion [T, 3]."""
    return np.concatenate([track, blink[:, None], head], axis=1).astype(np.float32)


def still(num_frames: int) -> np.ndarray:
    """float32 [T, FRAME_PARAMS]: mouth closed, eyes open, head at rest."""
    out = np.zeros((num_frames, FRAME_PARAMS), np.float32)
    out[:, WIDTH] = 0.5
    return out


def still_params(params: np.ndarray, frames: int) -> np.ndarray:
    """[frames, FRAME_PARAMS] (params' dtype): the portrait pose of a clip's frame parameters
    [T, FRAME_PARAMS] (its reference image): frame 0's head pose, mouth closed and neutral,
    eyes open, held still."""
    p = np.repeat(params[:1], frames, axis=0)
    p[:, JAW], p[:, WIDTH], p[:, BLINK] = 0.0, 0.5, 0.0
    return p
