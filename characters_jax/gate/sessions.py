"""A session of one engine on one held-out clip, as the worker's generator runs it.

`ClipSession` is the generator side of a worker (an ``engine.step.Engine`` and its
parameters, the step state reused from session to session, as `DiTGenerator` does): one
prefill with the clip's portrait latent and the prompt, then one step per audio token
window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.lipsync.generate import PROMPT


class ClipSession:
    """engine + params -> latents [steps, gh, gw, C] float32 of one clip (host)."""

    def __init__(self, engine, params, prompt: str = PROMPT):
        self.engine, self.params = engine, params
        self.state = engine.init_state()
        padded, n = engine.pad_prompt(list(prompt.encode("utf-8")))
        self._prompt, self._prompt_len = jnp.asarray(padded), jnp.int32(n)

    def __call__(self, latent: np.ndarray, tokens: np.ndarray, seed: int) -> np.ndarray:
        """latent [gh, gw, C] float32; tokens [steps, A_tok, F_a] float32; seed: noise seed."""
        e = self.engine
        self.state = e.prefill(self.params, self.state, jnp.asarray(latent.reshape(-1, latent.shape[-1])),
                               self._prompt, self._prompt_len, jnp.uint32(seed % 2**32))
        audio = jax.device_put(jnp.asarray(tokens), e.replicated)
        out = []
        for s in range(len(tokens)):
            self.state, z = e.step(self.params, self.state, audio[s])
            out.append(z)
        return np.stack([np.asarray(z) for z in out])
