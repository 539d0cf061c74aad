"""Where the renderer draws the mouth: a per-frame pixel box from the face's parameters.

The cartoon renderer (`characters_jax.data.face`) places the mouth on the head's centre
line (`face.mouth_layout`: its centre below the head centre and the lips' half sizes at a
mouth state), then moves the head by its offset (dx, dy) and rolls it about the neck
pivot. `mouth_mask` applies that transform to the mouth's centre and draws a box around
the lips, plus a margin, in JAX so that training batches get their loss weights on the
device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from characters_jax.data.face import FACE_CENTRE_Y, NECK_PIVOT, layout_unit, mouth_layout
from characters_jax.data.identity import shape_offset
from characters_jax.data.motion import DX, DY, JAW, TILT, WIDTH

MARGIN = 0.035  # geometry units around the lips


def mouth_box(identity: jax.Array, params: jax.Array, height: int, width: int):
    """(centre row, centre column, half height, half width) in pixels, each [T]:
    identity [IDENTITY_SIZE], params [T, FRAME_PARAMS]."""
    unit = layout_unit(height, width)
    face_h, mouth_w = identity[shape_offset("face_height")], identity[shape_offset("mouth_width")]
    tilt = params[:, TILT]
    m = mouth_layout(face_h, mouth_w, params[:, JAW], params[:, WIDTH])
    my = m.centre_y  # head frame, units below the head centre
    half_w, half_h = m.lips_half_width + MARGIN, m.lips_half_height + MARGIN
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
