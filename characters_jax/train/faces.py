"""Training faces without speech: identities, mouth tracks, blinks and head motion, drawn
by the data package's own models, and their frames rendered on the device.

The VAE needs the renderer's whole range of faces and mouth states, not the speech: its
mouth tracks come from random phoneme strings (symbols of every place of articulation and
vowel height, random durations, pauses) passed through `visemes.mouth_track`, so they move
as spoken ones do without espeak-ng. Identities are from the training region only.
A `FacePool` is made once on the host; batches are drawn from it on the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.data import motion, visemes
from characters_jax.data.face import draw_frame
from characters_jax.data.identity import sample_identity
from characters_jax.data.motion import BLINK, JAW, WIDTH
from characters_jax.data.speech import Phoneme

# Vowels across the chart and consonants of every place (the viseme table's classes).
SYMBOLS = tuple("aɑæɐɛeiɪyʏuʊoɔøœəʌɒ") + tuple("pbmfvwθtdnlszʃkgŋhjrʔ") + ("ˈa", "ˈo", "ˈi", "ˈu", "ˈɛ", "aɪ", "aʊ", "ɔɪ")


def random_phonemes(rng: np.random.Generator, seconds: float) -> list[Phoneme]:
    """Phonemes of 40-220 ms in runs of speech separated by pauses of 0.1-0.8 s."""
    out, t = [], float(rng.uniform(0.0, 0.5))
    while t < seconds:
        run_end = t + rng.uniform(0.4, 2.5)
        while t < min(run_end, seconds):
            d = float(rng.uniform(0.04, 0.22))
            out.append(Phoneme(SYMBOLS[int(rng.integers(len(SYMBOLS)))], t, t + d))
            t += d
        t += float(rng.uniform(0.1, 0.8))
    return out


def face_params(rng: np.random.Generator, frames: int, fps: int = 24) -> np.ndarray:
    """float32 [frames, FRAME_PARAMS]: a mouth track from random phonemes, blinks, head motion."""
    track = visemes.mouth_track(random_phonemes(rng, frames / fps), frames, fps, jaw_scale=float(rng.uniform(0.8, 1.15)))
    return motion.frame_params(track, motion.blinks(rng, frames, fps), motion.head_motion(rng, frames, fps))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FacePool:
    """Faces to draw training batches from on the device: identities [I, IDENTITY_SIZE] and
    motion [M, span, FRAME_PARAMS] (mouth track, blinks, head motion), made once on the host."""

    identities: jax.Array
    motion: jax.Array

    @classmethod
    def make(cls, rng: np.random.Generator, identities: int, motions: int, span: int, fps: int = 24) -> "FacePool":
        ident = np.stack([sample_identity(rng).to_vector() for _ in range(identities)]).astype(np.float32)
        mot = np.stack([face_params(rng, span, fps) for _ in range(motions)]).astype(np.float32)
        return cls(jnp.asarray(ident), jnp.asarray(mot))

    def sample(self, key, batch: int, frames: int, still_fraction: float = 0.1):
        """(identities [B, IDENTITY_SIZE], params [B, frames, FRAME_PARAMS]): a random
        identity with a random window of a random motion; a still_fraction of them the still
        portrait chunk (`motion.still_params`)."""
        k1, k2, k3, k4 = jax.random.split(key, 4)
        span = self.motion.shape[1]
        ident = self.identities[jax.random.randint(k1, (batch,), 0, self.identities.shape[0])]
        m = jax.random.randint(k2, (batch,), 0, self.motion.shape[0])
        start = jax.random.randint(k3, (batch,), 0, span - frames + 1)
        params = jax.vmap(lambda i, s: jax.lax.dynamic_slice_in_dim(self.motion[i], s, frames, 0))(m, start)
        still = jnp.repeat(params[:, :1], frames, axis=1)
        still = still.at[..., JAW].set(0.0).at[..., WIDTH].set(0.5).at[..., BLINK].set(0.0)
        is_still = jax.random.uniform(k4, (batch, 1, 1)) < still_fraction
        return ident, jnp.where(is_still, still, params)


@functools.partial(jax.jit, static_argnames=("height", "width"))
def render_video(identities: jax.Array, params: jax.Array, height: int, width: int) -> jax.Array:
    """[B, T, H, W, 3] float32 in [-1, 1] on the uint8 grid (what a decoded or received frame
    holds): identities [B, IDENTITY_SIZE], params [B, T, FRAME_PARAMS]."""
    frames = jax.vmap(jax.vmap(draw_frame, (None, 0, None, None)), (0, 0, None, None))
    img = frames(identities, params, height, width)
    return jnp.round(img * 255.0) / 127.5 - 1.0
