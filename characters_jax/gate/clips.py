"""Held-out clips as the gate feeds them to every run of the trained model: made once, on the host.

A clip's inputs are what a session of the worker sees: the portrait encoded by the trained
VAE (`VaeRuntime.encode`, the generator's normalised latent space), the audio tokens of
every step (`AudioFrontEnd`, cut from the clip's espeak-ng speech), a noise seed; and what
it is judged against: the ground-truth mouth track and the portrait. Every reference run
and every variant gets the same arrays, so two runs differ only in arithmetic (or in the
one-ulp nudge a perturbed reference run applies to `latent` and `tokens`).

Plans (speech, tracks, identities) come from `data.plans` (held-out split: identities,
voices and words never trained on), kept in a plans directory so a rerun reuses them.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from characters_jax.config import Config


@dataclasses.dataclass(frozen=True)
class ClipInputs:
    """n clips of T frames (steps = T / frames_per_step). latent float32 [n, gh, gw, C];
    tokens float32 [n, steps, A_tok, F_a]; track float32 [n, T, 2] (jaw first); portrait
    uint8 [n, H, W, 3]; seed int [n] (each clip's noise seed); index int [n] (plan index)."""

    latent: np.ndarray
    tokens: np.ndarray
    track: np.ndarray
    portrait: np.ndarray
    seed: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    @property
    def steps(self) -> int:
        return self.tokens.shape[1]

    @property
    def frames(self) -> int:
        return self.track.shape[1]


def make_plans(cfg: Config, directory, count: int, seconds: float, seed: int = 0, first: int = 0, workers=None):
    """The held-out plans [first, first + count) of `seconds` each, made into `directory`
    if missing (espeak-ng worker processes), loaded otherwise: a ``data.plans.PlanSet``."""
    from characters_jax.data.clips import ClipSpec
    from characters_jax.data.plans import PlanMaker, load_plans

    v = cfg.video
    spec = ClipSpec(seconds=seconds, height=v.height, width=v.width, fps=v.fps, chunk_frames=v.frames_per_step)
    directory = pathlib.Path(directory) / f"heldout-{spec.num_frames}f-n{count}-from{first}-seed{seed}"
    maker = PlanMaker(directory, "heldout", count, spec, seed, workers, shard_size=8, first=first)
    if not maker.done():
        maker.start()
        maker.wait()
    return load_plans(directory, "heldout", limit=count)


def clip_inputs(cfg: Config, plans, vae, seed: int = 0) -> ClipInputs:
    """Every clip of `plans` (PlanSet) as a session's inputs: portrait rendered and encoded
    by `vae` (VaeRuntime), the audio tokens of each step, the clip's noise seed."""
    from characters_jax.audio.features import AudioFrontEnd
    from characters_jax.data.clips import reference_image

    fe = AudioFrontEnd(cfg)
    h, w = cfg.video.height, cfg.video.width
    frames = plans.params.shape[1]
    steps = frames // cfg.video.frames_per_step
    latents, tokens, portraits = [], [], []
    for i in range(len(plans)):
        image = reference_image(plans.identity[i], plans.params[i], h, w)
        audio = plans.audio[i]
        portraits.append(image)
        latents.append(np.asarray(vae.encode(image), np.float32))
        tokens.append(np.stack([np.asarray(fe.tokens(fe.window(lambda lo, hi: audio[lo:hi], s)), np.float32)
                                for s in range(steps)]))
    return ClipInputs(latent=np.stack(latents), tokens=np.stack(tokens), track=np.asarray(plans.track, np.float32),
                      portrait=np.stack(portraits), seed=seed + np.arange(len(plans)),
                      index=np.asarray(plans.index))
