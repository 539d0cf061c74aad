"""Controls of the fidelity measure: the truth with other motion, and planted faults.

`other_motion` keeps a clip's mouth track and draws new blinks and head motion (what two
correct renderings of the same speech differ by: the measure must not see it). The faults
act on uint8 frames [T, H, W, 3]: `colour_shift` adds an RGB offset everywhere,
`blur` a Gaussian blur, `hair_smear` green streaks down both sides of the hair (over the
hair and 2 pixels around it, in the outer thirds of its columns, blended half-way, every
other column stronger).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.data import motion

SMEAR_GREEN = np.asarray([60.0, 165.0, 70.0])


def other_motion(params, seed: int, fps: int = 24) -> np.ndarray:
    """float32 [T, FRAME_PARAMS]: params' mouth track with blinks and head motion drawn anew from seed."""
    params = np.asarray(params, np.float32)
    rng = np.random.default_rng([seed, 77])
    n = len(params)
    return motion.frame_params(params[:, [motion.JAW, motion.WIDTH]], motion.blinks(rng, n, fps),
                               motion.head_motion(rng, n, fps))


def colour_shift(frames, rgb) -> np.ndarray:
    """uint8 frames with rgb [3] (0..255 units) added, clipped."""
    return np.clip(np.asarray(frames, np.float64) + np.asarray(rgb, np.float64), 0, 255).round().astype(np.uint8)


def blur(frames, sigma: float) -> np.ndarray:
    """uint8 frames blurred by a Gaussian of sigma pixels."""
    from characters_jax.lipsync.feature_net import gaussian_blur

    x = jnp.asarray(frames, jnp.float32)
    out = jax.jit(jax.vmap(lambda f: gaussian_blur(f, sigma)))(x)
    return np.asarray(jnp.clip(jnp.round(out), 0, 255)).astype(np.uint8)


def _dilated(mask: np.ndarray, r: int) -> np.ndarray:
    h, w = mask.shape
    p = np.pad(mask, r)
    return np.any([p[i:i + h, j:j + w] for i in range(2 * r + 1) for j in range(2 * r + 1)], axis=0)


def hair_smear(frames, hair_mask, strength: float = 0.5) -> np.ndarray:
    """uint8 frames with green streaks over the hair (hair_mask bool [H, W], dilated by 2
    pixels) in the outer thirds of its columns."""
    frames = np.asarray(frames)
    hair_mask = np.asarray(hair_mask, bool)
    cols = np.flatnonzero(hair_mask.any(0))
    if cols.size == 0:
        raise ValueError("hair_smear: the hair mask is empty")
    lo, hi = cols.min(), cols.max()
    third = max(1, (hi - lo + 1) // 3)
    c = np.arange(frames.shape[2])
    streak = np.where((c - lo) % 2 == 0, 1.0, 0.5) * ((c < lo + third) | (c > hi - third))
    alpha = strength * _dilated(hair_mask, 2) * streak[None, :]
    a = alpha[None, :, :, None]
    return np.clip(frames * (1.0 - a) + SMEAR_GREEN * a, 0, 255).round().astype(np.uint8)
