"""A parametric 2-D cartoon face, rendered with signed distances in jax.numpy.

`render_frames(identity, params, height, width)` draws one identity (float32
[IDENTITY_SIZE], see `identity`) for T frames of parameters (float32 [T, FRAME_PARAMS], see
`motion`) into uint8 [T, H, W, 3]; `render_batch` does [B] identities at once; `draw_frame`
is the traceable single frame (float32). Every shape is an (approximate) signed distance
field; a pixel's coverage is a smoothstep of its distance over one pixel, so edges are
anti-aliased at any size. Frames are vmapped and jitted per (H, W): GPU speed on the
training machine, and fast enough on a CPU.

Geometry is in units of FACE_SCALE * min(H, 1.3 W) pixels: the face is centred
horizontally, at half the height, and keeps its proportions at any size and aspect (a wider
frame shows more background). Layers, back to front: background gradient, hair behind the
head, clothes, neck, ears, face (the chin drops as the jaw opens), blush, brows, fringe,
eyes (blinks close them), nose, mouth (lips, cavity, teeth, tongue).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.data.identity import COLOURS, IDENTITY_SIZE, SHAPES, colour_offset, shape_offset
from characters_jax.data.motion import BLINK, DX, DY, FRAME_PARAMS, JAW, TILT, WIDTH

FACE_CENTRE_Y = 0.5  # fraction of the height
NECK_PIVOT = 0.30  # head roll pivot below the face centre (units)
_CAVITY = np.float32([0.22, 0.05, 0.07])
_TEETH = np.float32([0.95, 0.94, 0.90])
_TONGUE = np.float32([0.82, 0.38, 0.42])
_EYE_WHITE = np.float32([0.97, 0.97, 0.95])
_LID = np.float32([0.12, 0.08, 0.08])
_BLUSH = np.float32([0.95, 0.42, 0.45])

FACE_SCALE = 1.1  # a geometry unit is FACE_SCALE frame heights (when the frame is not too narrow)


def layout_unit(height: int, width: int) -> float:
    """Pixels per geometry unit."""
    return float(min(height, 1.3 * width)) * FACE_SCALE


def _ellipse(x, y, rx, ry):
    """Approximate signed distance to an ellipse centred at the origin (negative inside)."""
    k0 = jnp.sqrt((x / rx) ** 2 + (y / ry) ** 2)
    k1 = jnp.sqrt((x / (rx * rx)) ** 2 + (y / (ry * ry)) ** 2)
    return jnp.where(k1 > 1e-6, k0 * (k0 - 1.0) / jnp.maximum(k1, 1e-6), -jnp.minimum(rx, ry))


def _box(x, y, hx, hy):
    """Signed distance to an axis-aligned box of half sizes (hx, hy) centred at the origin."""
    qx, qy = jnp.abs(x) - hx, jnp.abs(y) - hy
    return jnp.sqrt(jnp.maximum(qx, 0) ** 2 + jnp.maximum(qy, 0) ** 2) + jnp.minimum(jnp.maximum(qx, qy), 0)


def _unpack(identity):
    """Named colours ([3] each) and shapes (scalars) of an identity vector."""
    colours = {n: identity[colour_offset(n):colour_offset(n) + 3] for n in COLOURS}
    shapes = {n: identity[shape_offset(n)] for n in SHAPES}
    return colours, shapes


def _coverage(d, px):
    """Coverage in [0, 1] of a signed distance: smoothstep over one pixel."""
    t = jnp.clip(0.5 - d / px, 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _over(img, colour, d, px, alpha=1.0):
    """img with `colour` composited where d < 0 (anti-aliased), times alpha."""
    a = (_coverage(d, px) * alpha)[..., None]
    return img * (1.0 - a) + jnp.broadcast_to(colour, img.shape) * a


def draw_frame(identity, params, height: int, width: int):
    """float32 [H, W, 3] in [0, 1]: one frame of identity [IDENTITY_SIZE] with params [FRAME_PARAMS]
    (traceable: vmap and jit it as needed)."""
    unit = layout_unit(height, width)
    px = 1.0 / unit
    c, s = _unpack(identity)
    jaw, mouth_w, blink = params[JAW], params[WIDTH], params[BLINK]
    dx, dy, tilt = params[DX] * height / unit, params[DY] * height / unit, params[TILT]

    y = (jnp.arange(height, dtype=jnp.float32) + 0.5 - FACE_CENTRE_Y * height) / unit
    x = (jnp.arange(width, dtype=jnp.float32) + 0.5 - 0.5 * width) / unit
    y, x = jnp.meshgrid(y, x, indexing="ij")  # [H, W], world frame
    # head frame: undo the head's offset and its roll about the neck pivot
    cos, sin = jnp.cos(tilt), jnp.sin(tilt)
    hx0, hy0 = x - dx, y - dy - NECK_PIVOT
    hx = cos * hx0 + sin * hy0
    hy = -sin * hx0 + cos * hy0 + NECK_PIVOT

    def over(img, colour, d, alpha=1.0):
        return _over(img, colour, d, px, alpha)

    rx, ry = 0.23 * s["face_width"], 0.30 * s["face_height"]
    ry_low = ry * (1.0 + 0.07 * jaw)  # the chin drops as the jaw opens

    # background: vertical gradient and a soft light behind the head
    g = (jnp.arange(height, dtype=jnp.float32) / max(height - 1, 1))[:, None, None]
    img = c["bg_top"] * (1.0 - g) + c["bg_bottom"] * g
    img = jnp.broadcast_to(img, (height, width, 3))
    light = 0.14 * jnp.exp(-(x ** 2 + (y + 0.05) ** 2) / 0.06)[..., None]
    img = img * (1.0 - light) + light

    # hair: a cap around the head, wavy with curl; long hair falls behind the shoulders
    vol = 0.012 + 0.05 * s["hair_volume"]
    ang = jnp.arctan2(hy + 0.03, hx)
    wave = 0.012 * s["curl"] * jnp.sin(14.0 * ang)
    cap = _ellipse(hx, hy + 0.03, rx + vol, ry + vol) + wave
    length_end = 0.02 + 0.52 * s["hair_length"]
    falls = _box(hx, hy - 0.5 * (length_end - 0.05), rx + vol * 0.8, 0.5 * (length_end + 0.05)) - 0.02 + \
        0.5 * wave
    back = jnp.maximum(jnp.minimum(cap, falls), hy - length_end)
    img = over(img, c["hair"] * 0.85, back)

    # clothes and neck (the neck follows the head sideways)
    img = over(img, c["clothes"], _ellipse(x, y - 0.66, 0.52, 0.28))
    img = over(img, c["clothes"] * 0.7, jnp.abs(_ellipse(x, y - 0.66, 0.52, 0.28)) - 0.004)
    neck_w = 0.085 * s["face_width"]
    img = over(img, c["skin"] * 0.8, _box(x - dx, y - 0.45, neck_w, 0.25))
    img = over(img, c["skin"] * 0.8, jnp.maximum(_ellipse(x - 0.6 * dx, y - 0.40, neck_w * 1.05, 0.05), 0.38 - y))

    # ears, face (tapered jaw, shaded rim), blush
    for side in (-1.0, 1.0):
        img = over(img, c["skin"] * 0.9, _ellipse(hx - side * rx * 0.97, hy - 0.02, 0.032, 0.052))
    lower = jnp.clip(hy / ry_low, 0.0, 1.0)
    face_x = hx / (1.0 - s["jaw_taper"] * lower ** 1.6 * 0.55)
    face = _ellipse(face_x, hy, rx, jnp.where(hy > 0, ry_low, ry))
    shade = 1.0 - 0.12 * jnp.clip((face + 0.045) / 0.045, 0.0, 1.0)[..., None]
    a = _coverage(face, px)[..., None]
    img = img * (1.0 - a) + c["skin"] * shade * a
    for side in (-1.0, 1.0):
        d = jnp.sqrt((hx - side * 0.12 * s["face_width"]) ** 2 + (hy - 0.085) ** 2)
        img = over(img, _BLUSH, d - 0.045, 0.3 * s["blush"] * jnp.clip(1.0 - d / 0.045, 0.0, 1.0))

    # brows, then the fringe: the cap above a hairline that comes down with `fringe` and at the temples
    ex_off, ey = 0.085 * s["eye_spacing"], -0.02
    ew, eh = 0.042 * s["eye_size"], 0.028 * s["eye_size"]
    for side in (-1.0, 1.0):
        arc = jnp.abs(_ellipse(hx - side * ex_off, hy - ey - 0.02, ew * 1.25, eh * 1.9)) - \
            (0.004 + 0.006 * s["brow_thickness"])
        img = over(img, c["hair"] * 0.75, jnp.maximum(arc, hy - (ey - eh * 1.5)))
    hairline = -ry * (0.66 - 0.5 * s["fringe"]) + 0.3 * ry * jnp.clip(jnp.abs(hx) / rx, 0, 1) ** 3 + \
        0.01 * s["curl"] * jnp.sin(70.0 * hx)
    img = over(img, c["hair"], jnp.maximum(cap, hy - hairline))

    return jnp.clip(_features(img, hx, hy, c, s, jaw, mouth_w, blink, px), 0.0, 1.0)


def _features(img, hx, hy, c, s, jaw, mouth_w, blink, px):
    """Eyes (blinks close them), nose and mouth over img [h, w, 3] at head-frame coordinates hx, hy [h, w]."""

    def over(img, colour, d, alpha=1.0):
        return _over(img, colour, d, px, alpha)

    ex_off, ey = 0.085 * s["eye_spacing"], -0.02
    ew, eh = 0.042 * s["eye_size"], 0.028 * s["eye_size"]
    open_h = jnp.maximum(eh * (1.0 - blink), 0.004)  # thinner ellipses have poor distances: fade instead
    shown = jnp.clip(eh * (1.0 - blink) / 0.004, 0.0, 1.0)
    eye_y = ey + 0.5 * (eh - open_h)  # the upper lid comes down, the lower one stays
    for side in (-1.0, 1.0):
        ex = hx - side * ex_off
        white = _ellipse(ex, hy - eye_y, ew, open_h)
        img = over(img, _EYE_WHITE, white, shown)
        iris = jnp.sqrt(ex ** 2 + (hy - ey - 0.002) ** 2)
        img = over(img, c["iris"], jnp.maximum(iris - 0.019 * s["eye_size"], white), shown)
        img = over(img, _LID, jnp.maximum(iris - 0.008 * s["eye_size"], white), shown)
        glint = jnp.sqrt((ex - 0.006) ** 2 + (hy - ey + 0.007) ** 2) - 0.0035 * s["eye_size"]
        img = over(img, _EYE_WHITE, jnp.maximum(glint, white), shown)
        img = over(img, _LID, jnp.maximum(jnp.abs(white) - 0.0035, hy - eye_y - 0.3 * open_h), shown)
        closed = _box(ex, hy - ey - 0.5 * eh, ew * 0.95, 0.0) - 0.0035
        img = over(img, _LID, closed, 1.0 - shown)

    img = over(img, c["skin"] * 0.78, _ellipse(hx, hy - 0.07, 0.02, 0.011), 0.8)

    # mouth: the upper lip stays, the lower lip and the chin follow the jaw
    m = mouth_layout(s["face_height"], s["mouth_width"], jaw, mouth_w)
    mw, opening, my = m.half_width, m.opening, m.centre_y
    img = over(img, c["lips"], _ellipse(hx, hy - my, m.lips_half_width, m.lips_half_height))
    cavity = _ellipse(hx, hy - my, mw * 0.9, 0.5 * opening + 0.0008)
    img = over(img, _CAVITY, cavity)
    img = over(img, _TEETH, jnp.maximum(cavity, hy - my + 0.5 * opening * 0.45))
    img = over(img, _TONGUE, jnp.maximum(cavity, _ellipse(hx, hy - my - 0.6 * 0.5 * opening, mw * 0.55,
                                                          0.5 * opening * 0.5 + 0.0008)))
    seam = jnp.maximum(jnp.abs(hy - my) - 0.0025, jnp.abs(hx) - mw)
    return over(img, c["lips"] * 0.55, seam, jnp.clip(1.0 - 6.0 * jaw, 0.0, 1.0))


@dataclasses.dataclass(frozen=True)
class MouthLayout:
    """The mouth in head-frame geometry units (arrays broadcast like the inputs): centre_y below
    the face centre, the opening's half_width and full height (opening), the outer lips' half
    sizes."""

    centre_y: object
    half_width: object
    opening: object
    lips_half_width: object
    lips_half_height: object


def mouth_layout(face_height, mouth_width, jaw, lip_width) -> MouthLayout:
    """Where the renderer draws the mouth of an identity (face_height, mouth_width shapes) at a
    mouth state (jaw, lip_width): the upper lip stays, the opening grows downwards."""
    half_width = 0.068 * mouth_width * (0.72 + 0.5 * lip_width)
    opening = 0.075 * jaw * (1.1 - 0.25 * lip_width)
    lip = 0.013 + 0.006 * (1.0 - lip_width)
    return MouthLayout(centre_y=0.15 * face_height + 0.5 * opening, half_width=half_width, opening=opening,
                       lips_half_width=half_width + 0.01, lips_half_height=0.5 * opening + lip)


def _to_uint8(img):
    return jnp.round(img * 255.0).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("height", "width"))
def _render_frames(identity, params, height: int, width: int):
    return _to_uint8(jax.vmap(lambda p: draw_frame(identity, p, height, width))(params))


@functools.partial(jax.jit, static_argnames=("height", "width"))
def _render_batch(identities, params, height: int, width: int):
    frames = jax.vmap(jax.vmap(draw_frame, (None, 0, None, None)), (0, 0, None, None))
    return _to_uint8(frames(identities, params, height, width))


def _check(identity_shape, params_shape, height, width):
    if identity_shape[-1:] != (IDENTITY_SIZE,) or params_shape[-1:] != (FRAME_PARAMS,):
        raise ValueError(f"identity [..., {IDENTITY_SIZE}] and params [..., T, {FRAME_PARAMS}] expected, "
                         f"got {identity_shape} and {params_shape}")
    if height < 8 or width < 8:
        raise ValueError(f"frame size must be at least 8x8, got {height}x{width}")


def render_frames(identity, params, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, 3]: identity float32 [IDENTITY_SIZE], params float32 [T, FRAME_PARAMS]."""
    identity, params = np.asarray(identity, np.float32), np.asarray(params, np.float32)
    _check(identity.shape, params.shape, height, width)
    if params.ndim != 2:
        raise ValueError(f"params must be [T, {FRAME_PARAMS}], got {params.shape}")
    return np.asarray(_render_frames(identity, params, height=int(height), width=int(width)))


def render_batch(identities, params, height: int, width: int) -> np.ndarray:
    """uint8 [B, T, H, W, 3]: identities float32 [B, IDENTITY_SIZE], params float32 [B, T, FRAME_PARAMS]."""
    identities, params = np.asarray(identities, np.float32), np.asarray(params, np.float32)
    _check(identities.shape, params.shape, height, width)
    if identities.ndim != 2 or params.ndim != 3 or params.shape[0] != identities.shape[0]:
        raise ValueError(f"identities [B, {IDENTITY_SIZE}] and params [B, T, {FRAME_PARAMS}] expected, "
                         f"got {identities.shape} and {params.shape}")
    return np.asarray(_render_batch(identities, params, height=int(height), width=int(width)))
