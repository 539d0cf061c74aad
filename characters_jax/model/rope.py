"""3-D rotary position embedding over (time, height, width).

The head dimension D is split into D/2 rotary pairs (i, i + D/2); `rope_split = (nt, nh, nw)`
assigns the first nt pairs to time, the next nh to height and the last nw to width, each axis
with its own geometric frequency ladder. Rotations compose additively in the position, so
`apply_rope(apply_rope(x, p), d) == apply_rope(x, p + d)`: the ring cache uses that for its
delta rotation at a position reset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, rope_split: tuple[int, int, int], theta: float) -> np.ndarray:
    """Per-pair angular frequencies and the axis each pair follows.

    Returns float32 [3, D/2]: row a holds the frequency of each pair on axis a (zero for pairs
    that belong to another axis), so that angle = positions[..., :3] @ freqs.
    """
    half = head_dim // 2
    if sum(rope_split) != half:
        raise ValueError(f"rope_split {rope_split} must sum to head_dim // 2 = {half}")
    freqs = np.zeros((3, half), np.float32)
    start = 0
    for axis, n in enumerate(rope_split):
        if n:
            freqs[axis, start : start + n] = theta ** (-np.arange(n, dtype=np.float64) / n)
        start += n
    return freqs


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray | jax.Array) -> jax.Array:
    """Rotates x by its 3-D positions.

    x: [T, H, D] any float dtype; positions: [T, 3] int32 or float (time, height, width);
    freqs: [3, D/2] from `rope_frequencies`. Computed in float32; returns x.dtype.
    """
    angles = positions.astype(jnp.float32) @ jnp.asarray(freqs)  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
