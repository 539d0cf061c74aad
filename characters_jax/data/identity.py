"""Identity parameters of the cartoon face, their sampling, and the held-out region.

An identity is seven colours (RGB in [0, 1]) and twelve shape numbers; `to_vector` packs
them into float32 [IDENTITY_SIZE] in the order of `COLOURS` then `SHAPES` (the renderer and
the identity probe read that layout). Held-out identities come from a box of identity space
that training never draws from (`HELDOUT_REGION`): clothes in a band of hues, skin of
yellower hues, and wide faces, all three at once.
"""

from __future__ import annotations

import colorsys
import dataclasses

import numpy as np

COLOURS = ("skin", "hair", "clothes", "bg_top", "bg_bottom", "iris", "lips")
# name: (low, high) of the uniform draw
SHAPES = {
    "face_width": (0.85, 1.15),
    "face_height": (0.90, 1.10),
    "jaw_taper": (0.0, 0.5),
    "eye_spacing": (0.85, 1.15),
    "eye_size": (0.80, 1.25),
    "mouth_width": (0.85, 1.20),
    "brow_thickness": (0.0, 1.0),
    "blush": (0.0, 1.0),
    "hair_volume": (0.0, 1.0),
    "hair_length": (0.0, 1.0),
    "fringe": (0.0, 1.0),
    "curl": (0.0, 1.0),
}
IDENTITY_SIZE = 3 * len(COLOURS) + len(SHAPES)
SKIN_HUE = (0.03, 0.11)  # hue turns of skin colours


def colour_offset(name: str) -> int:
    """Index of colour `name`'s red channel in the identity vector."""
    return 3 * COLOURS.index(name)


def shape_offset(name: str) -> int:
    """Index of shape `name` in the identity vector."""
    return 3 * len(COLOURS) + list(SHAPES).index(name)


@dataclasses.dataclass(frozen=True)
class Identity:
    """colours: name -> (r, g, b) in [0, 1]; shapes: name -> value (ranges in SHAPES)."""

    colours: dict
    shapes: dict

    def to_vector(self) -> np.ndarray:
        """float32 [IDENTITY_SIZE]."""
        return np.asarray([c for name in COLOURS for c in self.colours[name]] + [self.shapes[n] for n in SHAPES],
                          np.float32)

    @classmethod
    def from_vector(cls, v) -> "Identity":
        v = np.asarray(v, np.float64)
        if v.shape != (IDENTITY_SIZE,):
            raise ValueError(f"identity vector must have shape ({IDENTITY_SIZE},), got {v.shape}")
        colours = {n: tuple(float(x) for x in v[3 * i:3 * i + 3]) for i, n in enumerate(COLOURS)}
        shapes = {n: float(v[shape_offset(n)]) for n in SHAPES}
        return cls(colours, shapes)


def hue(rgb) -> float:
    """Hue in turns [0, 1) of an RGB colour."""
    return colorsys.rgb_to_hsv(*rgb)[0]


@dataclasses.dataclass(frozen=True)
class Region:
    """A box of identity space: clothes hue, skin hue and face width each in [low, high)."""

    clothes_hue: tuple[float, float]
    skin_hue: tuple[float, float]
    face_width: tuple[float, float]

    def contains(self, identity: Identity) -> bool:
        def inside(x, band):
            return band[0] <= x < band[1]

        return (inside(hue(identity.colours["clothes"]), self.clothes_hue)
                and inside(hue(identity.colours["skin"]), self.skin_hue)
                and inside(identity.shapes["face_width"], self.face_width))


HELDOUT_REGION = Region(clothes_hue=(0.40, 0.55), skin_hue=(0.075, 0.11), face_width=(1.05, 1.15))


def _hsv(h, s, v) -> tuple[float, float, float]:
    return tuple(float(x) for x in colorsys.hsv_to_rgb(h % 1.0, s, v))


def _draw(rng: np.random.Generator, clothes_hue: float, skin_hue: float, face_width: float) -> Identity:
    u = rng.uniform
    skin = _hsv(skin_hue, u(0.22, 0.55), u(0.32, 0.97))
    if rng.random() < 0.7:  # natural hair: black, browns, blondes, reds
        hair = _hsv(u(0.02, 0.13), u(0.25, 0.8), u(0.08, 0.85))
    else:  # dyed
        hair = _hsv(u(0.0, 1.0), u(0.4, 0.8), u(0.35, 0.9))
    clothes = _hsv(clothes_hue, u(0.25, 0.85), u(0.25, 0.9))
    bg_h = u(0.0, 1.0)
    bg_top = _hsv(bg_h, u(0.05, 0.6), u(0.45, 0.95))
    bg_bottom = _hsv(bg_h + u(-0.12, 0.12), u(0.05, 0.7), u(0.2, 0.8))
    iris = _hsv([0.08, 0.58, 0.30, 0.6][int(rng.integers(4))] + u(-0.03, 0.03), u(0.2, 0.8), u(0.25, 0.75))
    tint = u(0.0, 1.0)
    lips = tuple(float(np.clip((1 - tint) * 0.82 * s + tint * t, 0, 1)) for s, t in zip(skin, (0.72, 0.28, 0.32)))
    shapes = {n: float(u(lo, hi)) for n, (lo, hi) in SHAPES.items()}
    shapes["face_width"] = float(face_width)
    return Identity({"skin": skin, "hair": hair, "clothes": clothes, "bg_top": bg_top, "bg_bottom": bg_bottom,
                     "iris": iris, "lips": lips}, shapes)


def sample_identity(rng: np.random.Generator, heldout: bool = False, region: Region = HELDOUT_REGION) -> Identity:
    """A training identity (outside `region`) or, with heldout=True, one inside it."""
    if heldout:
        return _draw(rng, rng.uniform(*region.clothes_hue), rng.uniform(*region.skin_hue),
                     rng.uniform(*region.face_width))
    while True:
        ident = _draw(rng, rng.uniform(0.0, 1.0), rng.uniform(*SKIN_HUE), rng.uniform(*SHAPES["face_width"]))
        if not region.contains(ident):
            return ident
