"""DiTGenerator: the `Generator` of one worker, one session at a time.

Owns the mesh, the parameters and the donated step state (the engine's options are the
config's [engine] table); `start_session` prefills the sink
(reusing the state's buffers: no allocation per session or per prompt length beyond the
bucketed programs), `step` denoises one latent frame. Both dispatch asynchronously.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.config import Config
from characters_jax.engine.step import Engine
from characters_jax.parallel.sharding import make_mesh


class DiTGenerator:
    def __init__(
        self,
        config: Config,
        tp: int = 1,
        cache_mode: str | None = None,
        cache_dtype: str | None = None,
        checkpoint: str | None = None,
        seed: int = 0,
        devices=None,
    ):
        cache = {k: v for k, v in (("mode", cache_mode), ("dtype", cache_dtype)) if v is not None}
        self.config = config.replace(cache=cache) if cache else config
        self.mesh = make_mesh(tp, devices)
        self.engine = Engine(self.config, self.mesh)
        if checkpoint:
            from characters_jax.checkpoint import restore_params

            self.params = restore_params(checkpoint, self.engine)
        else:
            self.params = self.engine.init_params(jax.random.key(seed))
        self.state = self.engine.init_state()
        self._step_index = 0

    @property
    def step_index(self) -> int:
        return self._step_index

    def start_session(self, image_latent, prompt_tokens, seed: int = 0) -> None:
        """image_latent: [grid_h, grid_w, C] float32; prompt_tokens: int ids; seed: noise seed."""
        cfg = self.config
        expected = (cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)
        if tuple(np.shape(image_latent)) != expected:
            raise ValueError(f"image_latent must have shape {expected}, got {tuple(np.shape(image_latent))}")
        padded, length = self.engine.pad_prompt(prompt_tokens)
        latent = jnp.asarray(image_latent, jnp.float32).reshape(cfg.video.tokens_per_frame, cfg.model.latent_channels)
        self.state = self.engine.prefill(
            self.params, self.state, latent, jnp.asarray(padded), jnp.int32(length), jnp.uint32(seed % 2**32)
        )
        self._step_index = 0

    def step(self, audio_tokens) -> jax.Array:
        """audio_tokens: [audio_tokens_per_step, audio_feature_dim] float32 -> latent [gh, gw, C]."""
        self.state, latent = self.engine.step(self.params, self.state, audio_tokens)
        self._step_index += 1
        return latent

    def compiled_programs(self) -> int:
        """Number of compiled executables held by this worker's programs."""
        e = self.engine
        return sum(f._cache_size() for f in (e.prefill, e.step))
