"""Decoded-frame comparison: the config's causal VAE decoder with fixed random weights.

Latent frames are decoded step by step with the decoder's temporal state carried (as the
decoder process does), on one device; frames stay on the device and only the per-step
PSNR against the base reference run comes back to the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from characters_jax.config import Config
from characters_jax.gate.distance import FRAME_RANGE, PSNR_CAP_DB


def decoder_config(cfg: Config, which: str) -> Config:
    """which: 'config' (the config's decoder) | 'small' (channels / 8, same structure)."""
    if which == "config":
        return cfg
    if which == "small":
        return cfg.replace(decoder={"channels": tuple(max(8, c // 8) for c in cfg.decoder.channels)})
    raise ValueError(f"unknown decoder choice {which!r}")


class FrameDecoder:
    """latents [K, grid_h, grid_w, C] -> frames [K, frames_per_step, H, W, 3] float32 in [-1, 1] (device)."""

    def __init__(self, cfg: Config, seed: int = 0):
        from characters_jax.decoder.runtime import init_module
        from characters_jax.decoder.vae import VideoDecoder

        graphdef, self._params = init_module(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0)), seed)
        self.config = cfg
        self._device = jax.devices()[0]
        self._params = jax.device_put(self._params, self._device)

        def one(params, state, z):
            return nnx.merge(graphdef, params)(z[None], state)

        latent = jax.ShapeDtypeStruct((cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels), jnp.float32)
        self._state_shapes = jax.eval_shape(lambda p, z: one(p, None, z)[1], self._params, latent)
        self._step = jax.jit(one, donate_argnums=(1,))

    def __call__(self, latents: np.ndarray) -> jax.Array:
        state = [jnp.zeros(s.shape, s.dtype, device=self._device) for s in self._state_shapes]  # a new session
        frames = []
        for z in np.asarray(latents, np.float32):
            out, state = self._step(self._params, state, jax.device_put(z, self._device))
            frames.append(out)
        return jnp.stack(frames)


@jax.jit
def _psnr(frames: jax.Array, base: jax.Array) -> jax.Array:
    d = (frames.astype(jnp.float32) - base.astype(jnp.float32)).reshape(frames.shape[0], -1)
    mse = jnp.mean(d * d, axis=1)
    return jnp.minimum(10.0 * jnp.log10(FRAME_RANGE**2 / mse), PSNR_CAP_DB)


def frame_psnr(frames: jax.Array, base: jax.Array) -> np.ndarray:
    """Per-step PSNR (dB, capped) of frames [K, F, H, W, 3] against base frames: -> [K] (host)."""
    return np.asarray(_psnr(frames, base), np.float64)
