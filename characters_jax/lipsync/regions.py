"""Where an identity's background, skin, hair and clothes are, whatever the head does.

The renderer (`characters_jax.data.face.draw_frame`) paints each region with its identity
colours (background: bg_top and bg_bottom; skin; hair; clothes). A pixel belongs to a
region where the frame follows that region's colour: the frame is drawn with the region's
colours at 0 and at 1, and the difference (averaged over RGB) is the pixel's share of the
region, times the layer's shade (0.75-1). A pixel is the region's when that share is at
least `COVER`, at the neutral pose (head at rest, mouth closed, eyes open) and at every
pose of `motion_poses`: the corners of the clips' head motion (drift and nods, roll), each
with the mouth closed and wide open, the eyes open and shut. What a head turn, a blink or
an open jaw can take from a region (edges, the chin, the eye sockets) is left out, so a
region's mean colour does not move with the motion that the generator is not asked to
reproduce.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.data import motion
from characters_jax.data.face import draw_frame
from characters_jax.data.identity import IDENTITY_SIZE, colour_offset

REGIONS = ("background", "skin", "hair", "clothes")
REGION_COLOURS = {"background": ("bg_top", "bg_bottom"), "skin": ("skin",), "hair": ("hair",),
                  "clothes": ("clothes",)}
COVER = 0.6  # a pixel's least share of its region (full coverage gives the layer's shade, >= 0.7)


def motion_poses(style: motion.MotionStyle = motion.MotionStyle()) -> np.ndarray:
    """float32 [P, FRAME_PARAMS]: the neutral pose and the corners of the head motion of
    `style` (dx, dy with nods, tilt), each with the mouth closed / wide open and narrow
    open, eyes open / shut."""
    dx, tilt = style.drift[1], style.tilt[1]
    dy = (-style.drift[1], style.drift[1] + style.nod_depth)
    rows = [motion.still(1)[0]]
    for sx, y, st, (jaw, width), blink in itertools.product((-dx, dx), dy, (-tilt, tilt),
                                                            ((0.0, 0.5), (1.0, 1.0), (1.0, 0.0)), (0.0, 1.0)):
        p = motion.still(1)[0]
        p[motion.JAW], p[motion.WIDTH], p[motion.BLINK] = jaw, width, blink
        p[motion.DX], p[motion.DY], p[motion.TILT] = sx, y, st
        rows.append(p)
    return np.stack(rows).astype(np.float32)


def _with_colours(identity, names, value):
    out = identity
    for name in names:
        i = colour_offset(name)
        out = out.at[i:i + 3].set(value)
    return out


@functools.partial(jax.jit, static_argnames=("height", "width"))
def _shares(identity, poses, height: int, width: int):
    """float32 [R, P, H, W]: each region's share of each pixel at each pose."""
    variants = jnp.stack([_with_colours(identity, REGION_COLOURS[r], v) for r in REGIONS for v in (0.0, 1.0)])
    draw = jax.vmap(jax.vmap(draw_frame, (None, 0, None, None)), (0, None, None, None))
    frames = draw(variants, poses, height, width).reshape(len(REGIONS), 2, *poses.shape[:1], height, width, 3)
    return (frames[:, 1] - frames[:, 0]).mean(-1)


def region_masks(identity, height: int, width: int, poses: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """{region: bool [H, W]}: the pixels of each of REGIONS that stay the region's over every
    pose (default `motion_poses()`) for identity float32 [IDENTITY_SIZE]."""
    identity = np.asarray(identity, np.float32)
    if identity.shape != (IDENTITY_SIZE,):
        raise ValueError(f"identity must be float32 [{IDENTITY_SIZE}], got shape {identity.shape}")
    poses = motion_poses() if poses is None else np.asarray(poses, np.float32)
    shares = np.asarray(_shares(jnp.asarray(identity), jnp.asarray(poses), height=int(height), width=int(width)))
    return {r: (shares[i] >= COVER).all(0) for i, r in enumerate(REGIONS)}
