"""Degradations for training the probes, so that they read decoded, not only rendered, frames.

All in jax, per image, on probe inputs float32 [B, h, w, 3] in [0, 1] (h, w multiples of 8):
down-and-up resampling (a decoder's softness), blur, colour jitter, JPEG-like block
quantisation (8 x 8 DCT with the JPEG tables at a random quality, chroma at half
resolution) and noise. The crop's own jitter (shift, zoom) happens in `probe.crop_resize`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Augment:
    """Strengths; each degradation is applied to a random part of the batch."""

    shift: float = 0.04  # crop shift, fraction of the box
    zoom: float = 0.06  # crop size change, +-
    resample_p: float = 0.5  # down-and-up by one of resample_factors
    resample_factors: tuple[int, int] = (2, 3)
    blur_p: float = 0.5
    brightness: float = 0.12
    contrast: float = 0.25
    channel_gain: float = 0.12
    saturation: float = 0.35
    jpeg_p: float = 0.5
    jpeg_quality: tuple[int, int] = (12, 85)
    noise: float = 0.04


MOUTH_AUGMENT = Augment()
IDENTITY_AUGMENT = Augment(brightness=0.02, contrast=0.04, channel_gain=0.02, saturation=0.05)
# whole frames as a decoder might return them: softer, compressed, noisy, colours kept
FRAME_DEGRADE = Augment(resample_factors=(2, 2), brightness=0.03, contrast=0.05, channel_gain=0.03,
                        saturation=0.08, jpeg_quality=(30, 85), noise=0.03)

_JPEG_LUMA = np.asarray([
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99], np.float32).reshape(8, 8)
_JPEG_CHROMA = np.full((8, 8), 99.0, np.float32)
_JPEG_CHROMA[:4, :4] = np.asarray([17, 18, 24, 47, 18, 21, 26, 66, 24, 26, 56, 99, 47, 66, 99, 99]).reshape(4, 4)


def _dct_matrix() -> np.ndarray:
    k, n = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    m = np.cos(np.pi * (2 * n + 1) * k / 16) * np.sqrt(2 / 8)
    m[0] /= np.sqrt(2)
    return m.astype(np.float32)


_DCT = _dct_matrix()


def _blocks_quantise(x, table):
    """x [h, w] in 0..255 (minus 128): 8 x 8 DCT, quantised by table [8, 8], inverted."""
    h, w = x.shape
    b = x.reshape(h // 8, 8, w // 8, 8).transpose(0, 2, 1, 3)
    d = jnp.asarray(_DCT)
    coef = d @ b @ d.T
    coef = jnp.round(coef / table) * table
    return (d.T @ coef @ d).transpose(0, 2, 1, 3).reshape(h, w)


def jpeg_like(img, quality):
    """img float32 [h, w, 3] in [0, 1] through JPEG's lossy steps at quality (1..100)."""
    q = jnp.clip(quality, 1.0, 100.0)
    scale = jnp.where(q < 50, 5000.0 / q, 200.0 - 2.0 * q) / 100.0

    def table(base):
        return jnp.clip(jnp.floor(base * scale + 0.5), 1.0, 255.0)

    rgb = img * 255.0
    y = 0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]
    cb = -0.168736 * rgb[..., 0] - 0.331264 * rgb[..., 1] + 0.5 * rgb[..., 2]
    cr = 0.5 * rgb[..., 0] - 0.418688 * rgb[..., 1] - 0.081312 * rgb[..., 2]
    h, w = y.shape
    y = _blocks_quantise(y - 128.0, table(_JPEG_LUMA)) + 128.0

    def chroma(c):  # half resolution, quantised on the padded half-size grid, back up
        half = jax.image.resize(c, (h // 2, w // 2), "linear")
        ph, pw = -(-h // 16) * 8, -(-w // 16) * 8
        padded = jnp.pad(half, ((0, ph - h // 2), (0, pw - w // 2)), mode="edge")
        half = _blocks_quantise(padded, table(_JPEG_CHROMA))[: h // 2, : w // 2]
        return jax.image.resize(half, (h, w), "linear")

    cb, cr = chroma(cb), chroma(cr)
    out = jnp.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], -1)
    return jnp.clip(out / 255.0, 0.0, 1.0)


def _blur(img):
    k = jnp.asarray([0.25, 0.5, 0.25])
    p = jnp.pad(img, ((1, 1), (1, 1), (0, 0)), mode="edge")
    rows = k[0] * p[:-2] + k[1] * p[1:-1] + k[2] * p[2:]
    return k[0] * rows[:, :-2] + k[1] * rows[:, 1:-1] + k[2] * rows[:, 2:]


def _resampled(img, factor: int):
    h, w, c = img.shape
    small = jax.image.resize(img, (h // factor, w // factor, c), "linear", antialias=True)
    return jax.image.resize(small, (h, w, c), "linear")


def crop_jitter(key, batch: int, aug: Augment):
    """(shift [B, 2], zoom [B]) for probe.crop_resize."""
    k1, k2 = jax.random.split(key)
    return (jax.random.uniform(k1, (batch, 2), minval=-aug.shift, maxval=aug.shift),
            1.0 + jax.random.uniform(k2, (batch,), minval=-aug.zoom, maxval=aug.zoom))


def degrade(key, images, aug: Augment):
    """images float32 [B, h, w, 3] in [0, 1] -> the same, degraded per image."""

    def one(k, img):
        ks = jax.random.split(k, 13)
        u = lambda i, lo=0.0, hi=1.0, shape=(): jax.random.uniform(ks[i], shape, minval=lo, maxval=hi)  # noqa: E731
        # resampling down and up
        f1, f2 = aug.resample_factors
        res = _resampled(img, f1) if f1 == f2 else jnp.where(u(0) < 0.5, _resampled(img, f1), _resampled(img, f2))
        img = jnp.where(u(1) < aug.resample_p, res, img)
        # blur, once or twice, partly
        b1 = _blur(img)
        b = jnp.where(u(2) < 0.5, b1, _blur(b1))
        img = jnp.where(u(3) < aug.blur_p, img + u(4) * (b - img), img)
        # colour
        grey = img.mean(-1, keepdims=True)
        img = grey + (img - grey) * (1.0 + u(5, -aug.saturation, aug.saturation))
        mean = img.mean()
        img = mean + (img - mean) * (1.0 + u(6, -aug.contrast, aug.contrast))
        img = img * (1.0 + u(7, -aug.channel_gain, aug.channel_gain, (3,))) + u(8, -aug.brightness, aug.brightness)
        img = jnp.clip(img, 0.0, 1.0)
        # JPEG-like
        img = jnp.where(u(9) < aug.jpeg_p, jpeg_like(img, u(10, *aug.jpeg_quality)), img)
        # noise
        img = img + jax.random.normal(ks[12], img.shape) * u(11, 0.0, aug.noise)
        return jnp.clip(img, 0.0, 1.0)

    return jax.vmap(one)(jax.random.split(key, images.shape[0]), images)
