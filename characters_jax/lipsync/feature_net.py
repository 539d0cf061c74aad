"""The fidelity measure's feature network: a small CNN that reads a whole frame's look.

It is the probes' network (`probe.ProbeNet`: the whole 2:3 frame resized to 48 x 72, four
stride-2 convs, a dense layer) trained to regress what the renderer drew and how soft the
image is: the 33 identity parameters (colours of skin, hair, clothes, background, eyes,
lips; face and hair shapes) and, for each training frame, the strength of a Gaussian blur
(sigma up to BLUR_SIGMA pixels of its input) applied to a random half of the batch. Poses,
mouths and blinks vary at random and are not targets, so the features carry the identity
and the image's softness, little of the motion. Unlike the identity probe it sees no colour
jitter, so colours move its features.

`embed(net, frames)` gives the standardised outputs, float32 [T, 34]: the features KID is
computed in (`fidelity.kid`). The weights ship as `weights/fidelity_features.npz` (the probe
format, kind 'fidelity', with the command that trained them); training renders its own
frames (no espeak) and takes minutes on 2 CPU cores:

    characters-jax lipsync train-features
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from characters_jax.lipsync.augment import Augment, crop_jitter
from characters_jax.lipsync.probe import WEIGHTS_DIR, Probe, crop_resize
from characters_jax.lipsync.train import (FRAME_SIZES, POOL_MARGIN, VALIDATION_SIZES, adamw, base_config, default_log,
                                          fit, render_inputs, render_pool, sample_batch)

KIND = "fidelity"
QUALITY_TARGETS = ("blur",)
BLUR_SIGMA = 1.5  # input pixels at blur = 1
CROP_JITTER = Augment(shift=0.01, zoom=0.02)


def default_path() -> pathlib.Path:
    return WEIGHTS_DIR / "fidelity_features.npz"


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    steps: int = 3000
    batch: int = 64
    pool: int = 8192
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    quality_p: float = 0.5  # share of the batch that is blurred
    widths: tuple[int, ...] = (16, 24, 32, 48)
    frame_sizes: tuple[tuple[int, int], ...] = FRAME_SIZES
    validation: int = 384


def feature_config(spec: FeatureSpec):
    """The identity probe's config (targets and their standardisation) with the blur target
    appended (its mean and std those of the blur draw)."""
    cfg = base_config("identity", spec.seed)
    p = spec.quality_p
    mean, std = p / 2.0, float(np.sqrt(p / 3.0 - (p / 2.0) ** 2))  # U(0, 1) with probability p, else 0
    return dataclasses.replace(cfg, kind=KIND, widths=tuple(spec.widths), targets=cfg.targets + QUALITY_TARGETS,
                               target_mean=cfg.target_mean + (mean,), target_std=cfg.target_std + (std,),
                               weights=(1.0,) * (len(cfg.targets) + len(QUALITY_TARGETS)))


def _gaussian_kernel(sigma):
    x = jnp.arange(-3, 4, dtype=jnp.float32)
    k = jnp.exp(-0.5 * (x / jnp.maximum(sigma, 1e-3)) ** 2)
    return k / k.sum()


def gaussian_blur(img, sigma):
    """img float32 [h, w, 3] blurred by a Gaussian of `sigma` pixels (7 taps, edges repeated;
    sigma ~0 leaves it as it is)."""
    k = _gaussian_kernel(sigma)
    p = jnp.pad(img, ((3, 3), (3, 3), (0, 0)), mode="edge")
    h, w = img.shape[:2]
    rows = sum(k[i] * p[i:i + h] for i in range(7))
    return sum(k[i] * rows[:, i:i + w] for i in range(7))


def spoil(key, images, p: float):
    """(images float32 [B, h, w, 3] in [0, 1], blur [B, 1] in [0, 1]): a random share p of the
    batch blurred at a uniform strength (sigma = blur * BLUR_SIGMA)."""
    k1, k2 = jax.random.split(key)
    b = images.shape[0]
    blur = jnp.where(jax.random.uniform(k1, (b,)) < p, jax.random.uniform(k2, (b,)), 0.0)
    x = jax.vmap(lambda img, s: gaussian_blur(img, s * BLUR_SIGMA))(images, blur)
    return jnp.where(blur[:, None, None, None] > 0, x, images), blur[:, None]


def _make_step(graphdef, cfg, optimizer, spec: FeatureSpec):
    mean, std = jnp.asarray(cfg.target_mean), jnp.asarray(cfg.target_std)
    h, w = cfg.input_hw
    ph, pw = round(h * POOL_MARGIN), round(w * POOL_MARGIN)
    inner = (0.5 * (ph - ph / POOL_MARGIN), 0.5 * (pw - pw / POOL_MARGIN), ph / POOL_MARGIN, pw / POOL_MARGIN)

    @jax.jit
    def step(params, opt_state, key, crops, identities):
        k1, k2 = jax.random.split(key)
        shift, zoom = crop_jitter(k1, crops.shape[0], CROP_JITTER)
        x = crop_resize(crops.astype(jnp.float32) / 255.0, inner, cfg.input_hw, shift, zoom)
        x, quality = spoil(k2, x, spec.quality_p)
        z = (jnp.concatenate([identities, quality], -1) - mean) / std

        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(x) - z) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train_features(spec: FeatureSpec, log=None) -> tuple[Probe, dict]:
    """The trained feature network and its validation figures (deterministic from the seed
    on one machine)."""
    log = log or default_log
    cfg = feature_config(spec)
    net = Probe.create(cfg, seed=spec.seed)
    optimizer = adamw(spec)
    step = _make_step(net.graphdef, cfg, optimizer, spec)
    rng = np.random.default_rng([spec.seed, 11])
    t0 = time.monotonic()
    crops, identities = render_pool(cfg, rng, spec.pool, spec.frame_sizes, log=log)
    pool_s = time.monotonic() - t0
    params, final_loss = fit(net.params, optimizer, step, crops, identities, spec, rng, label="train-features", t0=t0,
                             log=log)
    train_s = time.monotonic() - t0 - pool_s
    net = net.with_params(params)
    meta = {"train_spec": dataclasses.asdict(spec), "pool_seconds": round(pool_s, 1), "train_seconds": round(train_s, 1),
            "final_loss": final_loss, "validation": validate(net, spec)}
    return dataclasses.replace(net, cfg=dataclasses.replace(cfg, meta=meta)), meta


def validate(net: Probe, spec: FeatureSpec) -> dict:
    """R^2 per target group (colours, shapes, blur) on fresh training-region
    identities at the smallest and largest validation sizes, the degradations drawn as in
    training (on the network's input)."""
    rng = np.random.default_rng([spec.seed, 12])
    cfg = net.cfg
    n_colour = sum(1 for t in cfg.targets if t[-2:] in ("_r", "_g", "_b"))
    groups = {"colours": slice(0, n_colour), "shapes": slice(n_colour, -1), "blur": slice(-1, None)}
    forward = jax.jit(lambda p, x: nnx.merge(net.graphdef, p)(x))
    out = {}
    for h, w in VALIDATION_SIZES:
        ids, poses = sample_batch(rng, spec.validation // len(VALIDATION_SIZES))
        spoilt, quality = spoil(jax.random.key(spec.seed + h), net.inputs(render_inputs(ids, poses, h, w)), spec.quality_p)
        t = np.concatenate([ids, np.asarray(quality)], -1)
        z = (t - np.asarray(cfg.target_mean)) / np.asarray(cfg.target_std)
        err = np.asarray(forward(net.params, spoilt)) - z
        r2 = 1.0 - (err ** 2).mean(0) / np.maximum(z.var(0), 1e-9)
        for name, sl in groups.items():
            out[f"{h}x{w}_{name}_r2"] = round(float(np.mean(r2[sl])), 4)
    return out


def load_features(path=None) -> Probe:
    """The shipped feature network (or the one at path)."""
    net = Probe.load(path if path is not None else default_path())
    if net.cfg.kind != KIND:
        raise ValueError(f"{path or default_path()}: a {net.cfg.kind} probe, not the fidelity feature network")
    return net


def embed(net: Probe, frames) -> np.ndarray:
    """float32 [T, 34]: the network's standardised outputs for frames uint8 [T, H, W, 3]."""
    return net.predict_standardised(np.asarray(frames))
