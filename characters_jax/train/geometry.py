"""Where the renderer draws the mouth: a per-frame pixel box from the face's parameters.

The cartoon renderer (`characters_jax.data.face`) places the mouth on the head's centre
line, 0.15 face-heights below the head centre plus half the jaw opening, then moves the
head by its offset (dx, dy) and rolls it about the neck pivot. `mouth_mask` inverts that
transform for the mouth's centre and draws a box around the lips (their half width and
half height at that frame's jaw and width, plus a margin), in JAX so that training batches
get their loss weights on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from characters_jax.data.face import FACE_CENTRE_Y, NECK_PIVOT, layout_unit
from characters_jax.data.identity import shape_offset
from characters_jax.data.motion import DX, DY, JAW, TILT, WIDTH

MARGIN = 0.035  # geometry units around the lips


def mouth_box(identity: jax.Array, params: jax.Array, height: int, width: int):
    """(centre row, centre column, half height, half width) in pixels, each [T]:
    identity [IDENTITY_SIZE], params [T, FRAME_PARAMS]."""
    unit = layout_unit(height, width)
    face_h, mouth_w = identity[shape_offset("face_height")], identity[shape_offset("mouth_width")]
    jaw, lip_w, tilt = params[:, JAW], params[:, WIDTH], params[:, TILT]
    opening = 0.075 * jaw * (1.1 - 0.25 * lip_w)
    my = 0.15 * face_h + 0.5 * opening  # head frame, units below the head centre
    half_w = 0.068 * mouth_w * (0.72 + 0.5 * lip_w) + 0.01 + MARGIN
    half_h = 0.5 * opening + 0.013 + 0.006 * (1.0 - lip_w) + MARGIN
    dx, dy = params[:, DX] * height / unit, params[:, DY] * height / unit
    x = dx - jnp.sin(tilt) * (my - NECK_PIVOT)
    y = dy + NECK_PIVOT + jnp.cos(tilt) * (my - NECK_PIVOT)
    row = y * unit + FACE_CENTRE_Y * height - 0.5
    col = x * unit + 0.5 * width - 0.5
    return row, col, half_h * unit, half_w * unit


def mouth_mask(identity: jax.Array, params: jax.Array, height: int, width: int) -> jax.Array:
    """float32 [T, H, W]: 1 inside the frame's mouth box, 0 outside."""
    row, col, hh, hw = mouth_box(identity, params, height, width)
    r = jnp.arange(height, dtype=jnp.float32)[None, :, None]
    c = jnp.arange(width, dtype=jnp.float32)[None, None, :]
    inside = (jnp.abs(r - row[:, None, None]) <= hh[:, None, None]) & (jnp.abs(c - col[:, None, None]) <= hw[:, None, None])
    return inside.astype(jnp.float32)
