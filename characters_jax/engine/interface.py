"""The small engine interface the service codes against (JetStream-style).

One `Generator` per worker, one session at a time. All arrays stay on device; nothing here
syncs the host except where a caller asks for the values (e.g. to forward a latent), and
`warmup`, which returns once its programs have run. The worker (characters_jax/serving)
uses a generator through this protocol only: `DiTGenerator` (engine/generator.py) serves,
`FakeGenerator` (demo/fakes.py) stands in for it in tests.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from characters_jax.config import Config


@runtime_checkable
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

    def warmup(self) -> None:
        """Runs every program a session runs once (the prefill of each prompt bucket, the
        step), so that no session compiles, and returns once they have run. A session
        starts with `start_session` afterwards, as always."""

    def compiled_programs(self) -> int:
        """Compiled executables this generator holds (host-side, no device sync): bounded
        by the config (the step and a prefill per prompt bucket, and the state's copy once
        a state was captured), whatever the prompts."""

    def capture_state(self):
        """A copy of the state after the steps taken so far, on its way to the host; the
        next step may run at once. Returns an object whose `arrays()` waits for the copy
        and returns {name: numpy array} and whose `step_index` is the steps taken."""

    def restore_state(self, arrays, step_index: int) -> None:
        """Continues a session from `capture_state().arrays()` of a generator with the same
        `state_identity()`; the next step is `step_index`. ValueError when the arrays do
        not fit (named)."""

    def state_identity(self) -> dict:
        """What a captured state is valid for, JSON-ready: the config's generative
        sections, the tensor-parallel size, the engine options and the weights."""
