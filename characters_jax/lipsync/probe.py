"""Small CNN probes that read the cartoon face family's frames: mouth openness and identity.

A probe crops a fixed box of the frame (in the renderer's geometry units, so the same box
at any frame size), resizes it to its input size (48 x 72) and regresses standardised
targets: the mouth probe (jaw, width) from the mouth region, the identity probe the 33
identity parameters from the whole portrait. Weights ship as npz files beside this module
(`weights/`), each with its config as JSON; loading them needs jax and flax only (the
renderer's geometry constants come from `characters_jax.data.face`, which needs no espeak).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from characters_jax.data.face import FACE_CENTRE_Y, layout_unit

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "weights"


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """kind: 'mouth' or 'identity'; box: (top, bottom, half width) of the crop in geometry units
    around the face centre; input_hw: the network's input size; widths: conv channels (3 x 3,
    stride 2 each); hidden: the dense layer; targets: output names;
    target_mean / target_std: the standardisation of the targets; weights: per-output weights
    of distances (identity); meta: training command and measured figures."""

    kind: str
    box: tuple[float, float, float]
    input_hw: tuple[int, int] = (48, 72)
    widths: tuple[int, ...] = (16, 24, 32, 48)
    hidden: int = 64
    targets: tuple[str, ...] = ()
    target_mean: tuple[float, ...] = ()
    target_std: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()
    meta: dict = dataclasses.field(default_factory=dict, compare=False)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "ProbeConfig":
        d = json.loads(s)
        for k in ("box", "input_hw", "widths", "targets", "target_mean", "target_std", "weights"):
            d[k] = tuple(d[k])
        return cls(**d)


MOUTH_BOX = (-0.02, 0.40, 0.315)  # nose tip to below the chin, cheek to cheek (2:3)
IDENTITY_BOX = (-0.4545, 0.4545, 0.682)  # the whole 2:3 frame


class ProbeNet(nnx.Module):
    """Conv stack -> dense -> outputs. [B, h, w, 3] float32 in [0, 1] -> [B, outputs]."""

    def __init__(self, cfg: ProbeConfig, rngs: nnx.Rngs):
        chans = (3,) + tuple(cfg.widths)
        self.convs = nnx.List([nnx.Conv(chans[i], chans[i + 1], (3, 3), strides=2, padding="SAME", rngs=rngs)
                               for i in range(len(cfg.widths))])
        h, w = cfg.input_hw
        for _ in cfg.widths:
            h, w = -(-h // 2), -(-w // 2)
        self.dense = nnx.Linear(h * w * cfg.widths[-1], cfg.hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, len(cfg.targets), rngs=rngs)

    def __call__(self, x):
        x = x - 0.5
        for conv in self.convs:
            x = jax.nn.gelu(conv(x))
        x = jax.nn.gelu(self.norm(self.dense(x.reshape(x.shape[0], -1))))
        return self.out(x)


def crop_box_pixels(height: int, width: int, box: tuple[float, float, float]) -> tuple[float, float, float, float]:
    """(top, left, box height, box width) in pixels of a geometry-unit box in an H x W frame."""
    unit = layout_unit(height, width)
    top, bottom, half = box
    return FACE_CENTRE_Y * height + top * unit, 0.5 * width - half * unit, (bottom - top) * unit, 2 * half * unit


def crop_resize(images, box_px, out_hw, shift=None, zoom=None):
    """float32 [B, h, w, 3] from images float32 [B, H, W, 3]: the box (top, left, height, width in
    pixels) resampled to out_hw with antialiasing; optional per-image shift [B, 2] (fractions of the
    box) and zoom [B] (box size multiplier) move the box."""
    b = images.shape[0]
    top, left, bh, bw = box_px
    oh, ow = out_hw
    shift = jnp.zeros((b, 2), jnp.float32) if shift is None else shift
    zoom = jnp.ones((b,), jnp.float32) if zoom is None else zoom

    def one(img, sh, z):
        h, w = bh * z, bw * z
        t = top + 0.5 * (bh - h) + sh[0] * bh
        l = left + 0.5 * (bw - w) + sh[1] * bw
        scale = jnp.stack([oh / h, ow / w])
        translation = jnp.stack([-t * oh / h, -l * ow / w])
        return jax.image.scale_and_translate(img, (oh, ow, 3), (0, 1), scale, translation, "linear", antialias=True)

    return jax.vmap(one)(images, shift, zoom)


@dataclasses.dataclass(frozen=True)
class Probe:
    """A loaded probe: cfg and the network; `predict` maps frames to targets in their units."""

    cfg: ProbeConfig
    graphdef: object
    params: object

    @classmethod
    def create(cls, cfg: ProbeConfig, seed: int = 0) -> "Probe":
        graphdef, params = nnx.split(ProbeNet(cfg, nnx.Rngs(seed)))
        return cls(cfg, graphdef, params)

    @classmethod
    def load(cls, path) -> "Probe":
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no probe weights at {path}")
        with np.load(path) as z:
            cfg = ProbeConfig.from_json(str(z["__config__"]))
            arrays = {k: z[k] for k in z.files if k != "__config__"}
        probe = cls.create(cfg)
        return dataclasses.replace(probe, params=unflatten_params(probe.params, arrays, path))

    def save(self, path) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, __config__=np.asarray(self.cfg.to_json()), **flatten_params(self.params))

    def with_params(self, params) -> "Probe":
        return dataclasses.replace(self, params=params)

    def inputs(self, frames):
        """float32 [B, h, w, 3]: frames uint8 or float [B, H, W, 3] cropped and resized."""
        frames = jnp.asarray(frames)
        if frames.dtype == jnp.uint8:
            frames = frames.astype(jnp.float32) / 255.0
        _, h, w, _ = frames.shape
        return crop_resize(frames, crop_box_pixels(h, w, self.cfg.box), self.cfg.input_hw)

    def predict_standardised(self, frames, batch: int = 256) -> np.ndarray:
        """float32 [B, outputs]: the network's standardised outputs for frames [B, H, W, 3]."""
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be [B, H, W, 3], got {frames.shape}")
        out = []
        for i in range(0, len(frames), batch):
            chunk = frames[i:i + batch]
            n = len(chunk)
            padded = min(batch, -(-n // 32) * 32)  # a few compiled shapes, whatever the clip lengths
            if padded > n:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], padded - n, 0)])
            out.append(np.asarray(_forward(self.graphdef, self.params, self.cfg, jnp.asarray(chunk)))[:n])
        return np.concatenate(out) if out else np.zeros((0, len(self.cfg.targets)), np.float32)

    def predict(self, frames, batch: int = 256) -> np.ndarray:
        """float32 [B, outputs] in the targets' own units."""
        z = self.predict_standardised(frames, batch)
        return z * np.asarray(self.cfg.target_std, np.float32) + np.asarray(self.cfg.target_mean, np.float32)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _forward(graphdef, params, cfg: ProbeConfig, frames):
    frames = frames.astype(jnp.float32) / 255.0 if frames.dtype == jnp.uint8 else frames
    _, h, w, _ = frames.shape
    x = crop_resize(frames, crop_box_pixels(h, w, cfg.box), cfg.input_hw)
    return nnx.merge(graphdef, params)(x)


def flatten_params(params) -> dict[str, np.ndarray]:
    """{path string: array} of a params pytree."""
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def unflatten_params(template, arrays: dict, source="") -> object:
    """template's pytree with its leaves replaced by arrays[path string] (shapes checked)."""

    def leaf(path, v):
        key = jax.tree_util.keystr(path)
        if key not in arrays:
            raise ValueError(f"{source}: probe weights lack {key}")
        a = arrays[key]
        if a.shape != v.shape:
            raise ValueError(f"{source}: {key} has shape {a.shape}, the probe expects {v.shape}")
        return jnp.asarray(a, v.dtype)

    return jax.tree_util.tree_map_with_path(leaf, template)


KINDS = ("mouth", "identity")


def default_path(kind: str) -> pathlib.Path:
    """Where the shipped weights of a probe kind live."""
    if kind not in KINDS:
        raise ValueError(f"probe kind must be one of {KINDS}, got {kind!r}")
    return WEIGHTS_DIR / f"{kind}_probe.npz"


def load_probe(kind: str = "mouth", path=None) -> Probe:
    """The shipped probe of `kind` ('mouth' or 'identity'), or the one at path."""
    probe = Probe.load(path if path is not None else default_path(kind))
    if probe.cfg.kind != kind:
        raise ValueError(f"{path}: a {probe.cfg.kind} probe, not a {kind} probe")
    return probe
