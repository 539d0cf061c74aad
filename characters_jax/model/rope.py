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

from pallas_kernels.numerics import rotate


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


def rope_angles(positions: jax.Array, freqs: np.ndarray | jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each float32 [T, D/2], of the rotation angles positions [T, 3] @ freqs.

    Compute them once where many tensors rotate by the same positions (every block's Q and
    new K within a step): inside the block scan XLA recomputes them per block (a dot and two
    elementwise kernels each time). ``rotate`` (``pallas_kernels.numerics``) applies them.
    """
    angles = positions.astype(jnp.float32) @ jnp.asarray(freqs)  # [T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray | jax.Array) -> jax.Array:
    """Rotates x by its 3-D positions.

    x: [T, H, D] any float dtype; positions: [T, 3] int32 or float (time, height, width);
    freqs: [3, D/2] from `rope_frequencies`. Computed in float32; returns x.dtype.
    """
    return rotate(x, rope_angles(positions, freqs))
