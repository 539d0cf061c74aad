"""VAE training: the config's video encoder and causal decoder on rendered faces.

A sample is `chunks` latent frames' worth of video (4 frames each) drawn from a
`faces.FacePool` and rendered on the device (no host work per step); the encoder maps each chunk to a latent frame, noise is added to the
latents (a random fraction `latent_noise` of their RMS: the decoder learns to draw what
an imperfect generator gives it), and the decoder, from an empty temporal history as at
the start of a session, redraws the frames. Loss: per pixel |d| + d^2 (RGB in [-1, 1]),
weighted 1 + mouth_weight inside the mouth box (`geometry.mouth_mask`), plus latent_l2 times
the latents' mean square, plus mouth_aux times the squared error of a linear read-out of
each latent frame (`mouth_head`, trained with it, not kept) to its 4 frames' mouth state
(jaw, width): the latents carry the mouth from the first steps on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from characters_jax.config import Config
from characters_jax.decoder.runtime import init_module
from characters_jax.decoder.vae import VideoDecoder, VideoEncoder
from characters_jax.train.faces import FacePool, render_video
from characters_jax.train.geometry import mouth_mask
from characters_jax.train.loop import LoopSettings, run_stage
from characters_jax.train.optim import OptimSettings, TrainState, apply_gradients, init_state, make_optimizer
from characters_jax.train.state_io import StageStore


@dataclasses.dataclass(frozen=True)
class VaeSettings:
    batch: int = 16
    chunks: int = 3
    mouth_weight: float = 8.0
    latent_l2: float = 1e-4
    latent_noise: float = 0.15
    still_fraction: float = 0.1
    mouth_aux: float = 0.0
    pool_identities: int = 2048
    pool_motions: int = 1024
    pool_span: int = 240  # frames of each motion (a window's head has drifted)
    optim: OptimSettings = OptimSettings(lr=1e-3, warmup_steps=100, ema_decay=0.998)
    loop: LoopSettings = LoopSettings(max_steps=20000, log_every=100)


def training_init(path, x):
    """The serving init (`init_module`) with every residual block's second conv at zero and
    the decoder's conv-out at a tenth: the network starts shallow and unsaturated, and
    learns faster (measured on a fixed batch: L1 0.10 against 0.14 after 100 steps)."""
    key = jax.tree_util.keystr(path)
    if "kernel" in key and "conv2" in key:
        return jnp.zeros_like(x)
    if "kernel" in key and "conv_out" in key and "decoder" in key:
        return 0.1 * x
    return x


class Vae:
    """The encoder and decoder of one config: graphdefs and initial parameters
    {"encoder": pure dict, "decoder": pure dict} (`training_init`)."""

    def __init__(self, cfg: Config, seed: int = 0):
        self.config = cfg
        self.dec_def, dec = init_module(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0)), seed)
        self.enc_def, enc = init_module(lambda: VideoEncoder(cfg, rngs=nnx.Rngs(0)), seed + 1)
        self.initial = jax.tree_util.tree_map_with_path(
            training_init, {"decoder": nnx.to_pure_dict(dec), "encoder": nnx.to_pure_dict(enc)})

    def encode(self, params, video):
        """video [T, H, W, 3] in [-1, 1] -> raw latents [T / 4, gh, gw, C]."""
        return nnx.merge(self.enc_def, params["encoder"])(video)

    def encode_image(self, params, rgb):
        return nnx.merge(self.enc_def, params["encoder"]).encode_image(rgb)

    def decode(self, params, z, clip: bool = True):
        """raw latents [K, gh, gw, C] -> video [4K, H, W, 3], from an empty history (clip:
        to [-1, 1], as served; training reads the unclipped frames, whose gradient does not
        vanish outside the range)."""
        return nnx.merge(self.dec_def, params["decoder"])(z, None, clip=clip)[0]


def mouth_head(cfg: Config) -> dict:
    """The read-out of the mouth state from a latent frame: w [gh * gw * C, 4 * 2], b [8]."""
    v = cfg.video
    n = v.tokens_per_frame * cfg.model.latent_channels
    return {"w": jnp.zeros((n, 2 * v.frames_per_step), jnp.float32), "b": jnp.zeros((2 * v.frames_per_step,), jnp.float32)}


def vae_loss(vae: Vae, s: VaeSettings, params, video, mask, key, poses=None):
    """video [B, T, H, W, 3], mask [B, T, H, W], poses [B, T, FRAME_PARAMS] (for mouth_aux)
    -> (loss, metrics)."""
    z = jax.vmap(lambda v: vae.encode(params, v))(video)  # [B, K, gh, gw, C]
    k1, k2 = jax.random.split(key)
    rms = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(z * z, axis=(1, 2, 3, 4), keepdims=True) + 1e-8))
    level = jax.random.uniform(k1, (z.shape[0], 1, 1, 1, 1)) * s.latent_noise
    rec = jax.vmap(lambda zz: vae.decode(params, zz, clip=False))(z + level * rms * jax.random.normal(k2, z.shape))
    d = rec - video
    per_px = jnp.mean(jnp.abs(d) + d * d, axis=-1)
    w = 1.0 + s.mouth_weight * mask
    rec_loss = jnp.sum(per_px * w) / jnp.sum(w)
    reg = jnp.mean(z * z)
    mouth_l1 = jnp.sum(jnp.mean(jnp.abs(d), -1) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    loss = rec_loss + s.latent_l2 * reg
    metrics = {"loss": loss, "l1": jnp.mean(jnp.abs(d)), "mouth_l1": mouth_l1, "z_rms": jnp.sqrt(reg)}
    if s.mouth_aux > 0:
        b, k = z.shape[:2]
        zn = z / rms  # the read-out sees the latents at unit scale
        pred = zn.reshape(b, k, -1) @ params["mouth_head"]["w"] + params["mouth_head"]["b"]
        target = poses[..., :2].reshape(b, k, -1)  # (jaw, width) of the chunk's frames
        aux = jnp.mean((pred - target) ** 2)
        loss = loss + s.mouth_aux * aux
        metrics.update(loss=loss, mouth_aux=aux)
    return loss, metrics


def make_step(vae: Vae, s: VaeSettings, tx):
    """step(state, (pool, key, fixed), lr): fixed holds the parts of the VAE's parameters that
    are not trained ({} or e.g. {"encoder": ...}: then state.params holds the rest)."""
    cfg = vae.config
    h, w = cfg.video.height, cfg.video.width

    frames = s.chunks * cfg.video.frames_per_step

    def step(state: TrainState, batch, lr):
        pool, key, fixed = batch
        k_faces, key = jax.random.split(key)
        identities, params = pool.sample(k_faces, s.batch, frames, s.still_fraction)
        video = render_video(identities, params, height=h, width=w)
        mask = jax.vmap(lambda i, p: mouth_mask(i, p, h, w))(identities, params)
        (_, metrics), grads = jax.value_and_grad(lambda p: vae_loss(vae, s, {**fixed, **p}, video, mask, key, params),
                                                 has_aux=True)(state.params)
        state, gnorm = apply_gradients(state, grads, lr, tx, s.optim.ema_decay)
        return state, {**metrics, "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,))


def train_vae(cfg: Config, s: VaeSettings, store: StageStore, budget_s: float, log, seed: int = 0):
    """Trains (or resumes) the VAE for up to budget_s seconds. Returns (Vae, ema params
    {"decoder", "encoder"}, record)."""
    vae = Vae(cfg, seed)
    tx = make_optimizer(s.optim)
    initial = {**vae.initial, "mouth_head": mouth_head(cfg)} if s.mouth_aux > 0 else vae.initial
    state = init_state(initial, tx)
    record = {"stage": "vae"}
    resumed = store.restore_latest(state)
    if resumed is not None:
        state, record = resumed
        log(f"vae: resuming at step {int(state.step)}")
    if budget_s > 0:
        pool = FacePool.make(np.random.default_rng([seed, 1]), s.pool_identities, s.pool_motions, s.pool_span,
                             cfg.video.fps)
        key = jax.random.key(seed)
        state, record = run_stage("vae", state, make_step(vae, s, tx), lambda i: (pool, jax.random.fold_in(key, i), {}),
                                  store=store, record=record, budget_s=budget_s, loop=s.loop, optim=s.optim,
                                  examples_per_step=s.batch, log=log)
    return vae, {k: state.ema[k] for k in ("decoder", "encoder")}, record
