"""The small engine interface the service codes against (JetStream-style).

One `Generator` per worker, one session at a time. All arrays stay on device; nothing here
syncs the host except where a caller asks for the values (e.g. to forward a latent).
"""

from __future__ import annotations

from typing import Protocol

import jax

from characters_jax.config import Config


class Generator(Protocol):
    config: Config

    def start_session(self, image_latent: jax.Array, prompt_tokens: jax.Array | list[int], seed: int) -> None:
        """Prefills the sink and resets the ring, positions and rng.

        image_latent: [grid_h, grid_w, latent_channels] float32, the VAE-encoded reference image.
        prompt_tokens: int32 token ids (byte-level, < model.prompt_vocab), at most
            cache.max_prompt_tokens long; padded to a bucket and masked.
        """

    def step(self, audio_tokens: jax.Array) -> jax.Array:
        """Denoises the next latent frame.

        audio_tokens: [model.audio_tokens_per_step, model.audio_feature_dim] float32.
        Returns the latent frame [grid_h, grid_w, latent_channels] float32 (device array;
        dispatch is asynchronous).
        """

    @property
    def step_index(self) -> int:
        """Steps taken in this session (host-side counter, no device sync)."""
