"""Training faces without speech: identities, mouth tracks, blinks and head motion, drawn
by the data package's own models, and their frames rendered on the device.

The VAE needs the renderer's whole range of faces and mouth states, not the speech: its
mouth tracks come from random phoneme strings (symbols of every place of articulation and
vowel height, random durations, pauses) passed through `visemes.mouth_track`, so they move
as spoken ones do without espeak-ng. Identities are from the training region only.
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


def still_params(params: np.ndarray, frames: int) -> np.ndarray:
    """[frames, FRAME_PARAMS]: the portrait pose (the data package's reference image): frame
    0's head pose, mouth closed and neutral, eyes open, held still."""
    p = np.repeat(params[:1], frames, axis=0)
    p[:, JAW], p[:, WIDTH], p[:, BLINK] = 0.0, 0.5, 0.0
    return p


@dataclasses.dataclass(frozen=True)
class FaceSampler:
    """Batches of (identities [B, IDENTITY_SIZE], params [B, frames, FRAME_PARAMS]) float32:
    windows of `frames` frames at a random place in `span` frames of motion (so the head has
    drifted), a `still_fraction` of them the still portrait chunk."""

    frames: int
    span: int = 240
    still_fraction: float = 0.1

    def batch(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        idents, params = [], []
        for _ in range(size):
            idents.append(sample_identity(rng).to_vector())
            p = face_params(rng, self.span)
            if rng.random() < self.still_fraction:
                params.append(still_params(p, self.frames))
            else:
                start = int(rng.integers(0, self.span - self.frames + 1))
                params.append(p[start:start + self.frames])
        return np.stack(idents).astype(np.float32), np.stack(params).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("height", "width"))
def render_video(identities: jax.Array, params: jax.Array, height: int, width: int) -> jax.Array:
    """[B, T, H, W, 3] float32 in [-1, 1] on the uint8 grid (what a decoded or received frame
    holds): identities [B, IDENTITY_SIZE], params [B, T, FRAME_PARAMS]."""
    frames = jax.vmap(jax.vmap(draw_frame, (None, 0, None, None)), (0, 0, None, None))
    img = frames(identities, params, height, width)
    return jnp.round(img * 255.0) / 127.5 - 1.0
