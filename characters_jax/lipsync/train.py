"""Trains the probes on the renderer's ground truth: no espeak, no data files.

A pool of frames is rendered first: training-region identities (`identity.sample_identity`)
with random mouths, blinks and head poses beyond the clips' ranges, at several frame sizes,
each cropped to the probe's box with a margin. Every step then takes a batch from the pool,
jitters the crop, degrades it (`augment`) and takes an AdamW step on the standardised
targets. Validation uses fresh training-region identities; the held-out region is left for
the evaluation. Deterministic from the seed (on one machine).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from characters_jax.data import motion
from characters_jax.data.face import draw_frame
from characters_jax.data.identity import COLOURS, SHAPES, sample_identity
from characters_jax.lipsync import augment
from characters_jax.lipsync.probe import IDENTITY_BOX, MOUTH_BOX, Probe, ProbeConfig, crop_box_pixels, crop_resize

FRAME_SIZES = ((64, 96), (80, 120), (96, 144), (128, 192))
VALIDATION_SIZES = ((64, 96), (128, 192))
LOSS_WEIGHTS = {"mouth": (1.0, 0.2)}  # the jaw is what the score reads; lip width rides along
IDENTITY_TARGETS = tuple(f"{c}_{ch}" for c in COLOURS for ch in "rgb") + tuple(SHAPES)
MOUTH_TARGETS = ("jaw", "width")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    kind: str = "mouth"
    steps: int = 6000
    batch: int = 64
    pool: int = 8192
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    frame_sizes: tuple[tuple[int, int], ...] = FRAME_SIZES
    validation: int = 384
    widths: tuple[int, ...] = (16, 24, 32, 48)


def sample_poses(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [n, FRAME_PARAMS]: mouths (a third nearly closed), blinks (a quarter), head poses."""
    p = np.zeros((n, motion.FRAME_PARAMS), np.float32)
    closed = rng.random(n) < 0.3
    p[:, motion.JAW] = np.where(closed, rng.uniform(0, 0.08, n), rng.uniform(0, 1, n))
    p[:, motion.WIDTH] = rng.uniform(0, 1, n)
    p[:, motion.BLINK] = np.where(rng.random(n) < 0.25, rng.uniform(0, 1, n), 0.0)
    p[:, motion.DX] = rng.uniform(-0.03, 0.03, n)
    p[:, motion.DY] = rng.uniform(-0.03, 0.03, n)
    p[:, motion.TILT] = rng.uniform(-0.06, 0.06, n)
    return p


def sample_batch(rng: np.random.Generator, n: int, heldout: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(identities [n, IDENTITY_SIZE], poses [n, FRAME_PARAMS]) float32."""
    ids = np.stack([sample_identity(rng, heldout=heldout).to_vector() for _ in range(n)])
    return ids, sample_poses(rng, n)


def targets_of(kind: str, identities: np.ndarray, poses: np.ndarray) -> np.ndarray:
    """float32 [n, outputs]: what a probe of `kind` regresses."""
    if kind == "mouth":
        return poses[:, [motion.JAW, motion.WIDTH]]
    return identities


def base_config(kind: str, seed: int = 0, n: int = 4096) -> ProbeConfig:
    """The probe's config with its targets' standardisation measured on n training draws."""
    rng = np.random.default_rng([seed, 99])
    ids, poses = sample_batch(rng, n)
    t = targets_of(kind, ids, poses).astype(np.float64)
    mean, std = t.mean(0), np.maximum(t.std(0), 1e-3)
    names = MOUTH_TARGETS if kind == "mouth" else IDENTITY_TARGETS
    box = MOUTH_BOX if kind == "mouth" else IDENTITY_BOX
    return ProbeConfig(kind=kind, box=box, targets=names, target_mean=tuple(float(x) for x in mean),
                       target_std=tuple(float(x) for x in std), weights=(1.0,) * len(names))


def _render(identities, poses, height: int, width: int):
    return jax.vmap(lambda i, p: draw_frame(i, p, height, width))(identities, poses)


POOL_MARGIN = 1.125  # the pool's crops are this much larger than the box (room for the jitter)


def _pool_hw(cfg: ProbeConfig) -> tuple[int, int]:
    h, w = cfg.input_hw
    return round(h * POOL_MARGIN), round(w * POOL_MARGIN)


@functools.partial(jax.jit, static_argnames=("cfg", "height", "width"))
def _pool_crops(identities, poses, cfg: ProbeConfig, height: int, width: int):
    frames = _render(identities, poses, height, width)
    top, left, bh, bw = crop_box_pixels(height, width, cfg.box)
    box = (top - 0.5 * (POOL_MARGIN - 1) * bh, left - 0.5 * (POOL_MARGIN - 1) * bw, bh * POOL_MARGIN,
           bw * POOL_MARGIN)
    crops = crop_resize(frames, box, _pool_hw(cfg))
    return jnp.round(crops * 255.0).astype(jnp.uint8)


def render_pool(cfg: ProbeConfig, rng: np.random.Generator, size: int, frame_sizes, chunk: int = 64,
                log=None) -> tuple[np.ndarray, np.ndarray]:
    """(crops uint8 [size, h', w', 3], targets float32 [size, outputs]): frames of random training-region
    identities and poses, rendered at the frame sizes in turn, cropped to the box with POOL_MARGIN."""
    crops, targets = [], []
    t0 = time.monotonic()
    for i in range(-(-size // chunk)):
        h, w = frame_sizes[i % len(frame_sizes)]
        ids, poses = sample_batch(rng, chunk)
        crops.append(np.asarray(_pool_crops(jnp.asarray(ids), jnp.asarray(poses), cfg=cfg, height=h, width=w)))
        targets.append(targets_of(cfg.kind, ids, poses))
        if log and (i + 1) % 32 == 0:
            log(f"train-probe {cfg.kind}: pool {(i + 1) * chunk}/{size} frames ({time.monotonic() - t0:.0f} s)")
    return np.concatenate(crops)[:size], np.concatenate(targets)[:size].astype(np.float32)


def _make_step(graphdef, cfg: ProbeConfig, optimizer, aug: augment.Augment):
    mean, std = jnp.asarray(cfg.target_mean), jnp.asarray(cfg.target_std)
    loss_w = jnp.asarray(LOSS_WEIGHTS[cfg.kind] if cfg.kind in LOSS_WEIGHTS else [1.0] * len(cfg.targets))
    ph, pw = _pool_hw(cfg)
    inner = (0.5 * (ph - ph / POOL_MARGIN), 0.5 * (pw - pw / POOL_MARGIN), ph / POOL_MARGIN, pw / POOL_MARGIN)

    @jax.jit
    def step(params, opt_state, key, crops, targets):
        k1, k2 = jax.random.split(key)
        shift, zoom = augment.crop_jitter(k1, crops.shape[0], aug)
        x = crop_resize(crops.astype(jnp.float32) / 255.0, inner, cfg.input_hw, shift, zoom)
        x = augment.degrade(k2, x, aug)
        z = (targets - mean) / std

        def loss_fn(p):
            pred = nnx.merge(graphdef, p)(x)
            return jnp.mean(((pred - z) ** 2) * loss_w)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def default_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def adamw(spec) -> optax.GradientTransformation:
    """AdamW at spec.lr (weight decay spec.weight_decay): a linear warm-up over
    min(200, spec.steps // 10 + 1) steps, then a cosine decay to 2 % of it at spec.steps."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, spec.lr, min(200, spec.steps // 10 + 1), spec.steps,
                                                  spec.lr * 0.02)
    return optax.adamw(schedule, weight_decay=spec.weight_decay)


def fit(params, optimizer, step, crops: np.ndarray, targets: np.ndarray, spec, rng: np.random.Generator, *,
        label: str, t0: float, log) -> tuple[object, float]:
    """spec.steps calls of `step(params, opt_state, key, crops, targets) -> (params, opt_state,
    loss)` on batches of spec.batch drawn from the pool with `rng` (keys from spec.seed), logged
    every 200 steps as `label` with the seconds since t0. Returns (the trained params, the mean
    loss of the last 200 steps)."""
    opt_state = optimizer.init(params)
    key = jax.random.key(spec.seed)
    losses = []
    for i in range(spec.steps):
        idx = rng.integers(0, len(crops), spec.batch)
        key, sub = jax.random.split(key)
        params, opt_state, loss = step(params, opt_state, sub, jnp.asarray(crops[idx]), jnp.asarray(targets[idx]))
        losses.append(loss)
        if (i + 1) % 200 == 0 or i + 1 == spec.steps:
            recent = float(jnp.mean(jnp.stack(losses[-200:])))
            log(f"{label}: step {i + 1}/{spec.steps} loss {recent:.4f} ({time.monotonic() - t0:.0f} s)")
    return params, float(jnp.mean(jnp.stack(losses[-200:])))


def train_probe(spec: TrainSpec, log=None) -> tuple[Probe, dict]:
    """A trained probe of spec.kind and its validation figures."""
    log = log or default_log
    cfg = dataclasses.replace(base_config(spec.kind, spec.seed), widths=tuple(spec.widths))
    probe = Probe.create(cfg, seed=spec.seed)
    optimizer = adamw(spec)
    aug = augment.MOUTH_AUGMENT if spec.kind == "mouth" else augment.IDENTITY_AUGMENT
    step = _make_step(probe.graphdef, cfg, optimizer, aug)
    rng = np.random.default_rng([spec.seed, 1])
    t0 = time.monotonic()
    crops, targets = render_pool(cfg, rng, spec.pool, spec.frame_sizes, log=log)
    pool_s = time.monotonic() - t0
    params, final_loss = fit(probe.params, optimizer, step, crops, targets, spec, rng, label=f"train-probe {spec.kind}",
                             t0=t0, log=log)
    train_s = time.monotonic() - t0
    probe = probe.with_params(params)
    figures = validate(probe, spec)
    weights = tuple(float(w) for w in figures.pop("distance_weights"))
    meta = {"train_spec": dataclasses.asdict(spec), "pool_seconds": round(pool_s, 1),
            "train_seconds": round(train_s, 1), "final_loss": final_loss, "validation": figures}
    probe = dataclasses.replace(probe, cfg=dataclasses.replace(cfg, weights=weights, meta=meta))
    return probe, meta


def render_inputs(identities, poses, height: int, width: int) -> np.ndarray:
    """uint8 [n, H, W, 3] frames of (identity, pose) pairs."""
    frames = jax.jit(_render, static_argnames=("height", "width"))(jnp.asarray(identities), jnp.asarray(poses),
                                                                    height=height, width=width)
    return np.asarray(jnp.round(frames * 255.0).astype(jnp.uint8))


def validate(probe: Probe, spec: TrainSpec) -> dict:
    """Per-target RMSE and R^2 on fresh training-region identities at the smallest and largest
    frame sizes, clean and degraded; distance weights (identity) from the clean errors."""
    rng = np.random.default_rng([spec.seed, 2])
    cfg = probe.cfg
    std = np.asarray(cfg.target_std)
    out, clean_err = {}, []
    for h, w in VALIDATION_SIZES:
        ids, poses = sample_batch(rng, spec.validation // len(VALIDATION_SIZES))
        t = targets_of(cfg.kind, ids, poses)
        frames = render_inputs(ids, poses, h, w)
        for name, x in (("clean", frames), ("degraded", degraded(frames, spec.seed))):
            err = (probe.predict(x) - t) / std
            if name == "clean":
                clean_err.append(err)
            r2 = 1.0 - (err ** 2).mean(0)
            out[f"{h}x{w}_{name}_rmse"] = [round(float(v), 4) for v in np.sqrt((err ** 2).mean(0)) * std]
            out[f"{h}x{w}_{name}_r2"] = [round(float(v), 4) for v in r2]
    mse = (np.concatenate(clean_err) ** 2).mean(0)
    w = 1.0 / (mse + 0.05)
    out["distance_weights"] = w / w.mean()
    return out


_degrade = jax.jit(augment.degrade, static_argnums=2)


def degraded(frames: np.ndarray, seed: int, aug: augment.Augment = augment.FRAME_DEGRADE) -> np.ndarray:
    """uint8 frames [n, H, W, 3] degraded at frame resolution, as a decoder might return them
    (validation and tests)."""
    x = jnp.asarray(frames, jnp.float32) / 255.0
    n, h, w, _ = x.shape
    ph, pw = -(-h // 8) * 8, -(-w // 8) * 8
    x = jnp.pad(x, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)), mode="edge")
    x = _degrade(jax.random.key(seed), x, aug)[:, :h, :w]
    return np.asarray(jnp.round(x * 255.0).astype(jnp.uint8))
