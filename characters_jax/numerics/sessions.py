"""Sessions of one engine on the gate's clips: latents, decoded frames, scores.

`ClipSession` is the generator side of a worker (an ``engine.step.Engine`` and its
parameters, the step state reused from session to session, as `DiTGenerator` does): one
prefill with the clip's portrait latent and the prompt, then one step per audio token
window. The trained VAE decodes each latent frame with its temporal state carried
(`VaeRuntime.decode_stream`, the decoder process's path), and the shipped probes read the frames: lip sync against the
ground-truth track, identity distance to the portrait.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.numerics.clips import ClipInputs
from characters_jax.train.evaluate import EvalSettings

PROMPT = EvalSettings.prompt  # the training evaluation's prompt


@dataclasses.dataclass(frozen=True)
class ClipScores:
    """Per clip (n clips): confidence, peak float64 [n] and lag int [n] of the lip-sync score;
    identity float64 [n] (identity probe's distance to the portrait; NaN without the probe);
    latents float32 [n, steps, gh, gw, C] (for the latent-distance diagnostic)."""

    confidence: np.ndarray
    peak: np.ndarray
    lag: np.ndarray
    identity: np.ndarray
    latents: np.ndarray


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


@dataclasses.dataclass(frozen=True)
class Probes:
    """The shipped probes: mouth (lip sync) and identity (None: not shipped)."""

    mouth: object
    identity: object | None

    @classmethod
    def load(cls) -> "Probes":
        from characters_jax.lipsync.probe import load_probe

        try:
            ident = load_probe("identity")
        except FileNotFoundError:
            ident = None
        return cls(load_probe("mouth"), ident)


def _clip_frames(session: ClipSession, vae, clips: ClipInputs, perturb, on_clip):
    """(i, latents [steps, gh, gw, C], frames uint8 [T, H, W, 3]) of every clip in turn."""
    for i in range(len(clips)):
        latent, tokens = clips.latent[i], clips.tokens[i]
        if perturb is not None:
            latent, tokens = perturb(latent, tokens, i)
        z = session(latent, tokens, int(clips.seed[i]))
        yield i, z, vae.decode_stream(z)[: clips.frames]
        if on_clip is not None:
            on_clip(i)


def _identity(frames, portrait, probes: Probes) -> float:
    from characters_jax.lipsync.identity import identity_distance

    return identity_distance(frames, portrait, probes.identity) if probes.identity is not None else float("nan")


def score_clips(session: ClipSession, vae, probes: Probes, clips: ClipInputs, perturb=None,
                on_clip=None) -> ClipScores:
    """Every clip through `session`; perturb(latent, tokens, i) -> (latent, tokens): the
    inputs a perturbed run gets (None: as they are); on_clip(i) after each clip."""
    from characters_jax.lipsync.score import score

    conf, peak, lag, ident, lats = [], [], [], [], []
    for i, z, frames in _clip_frames(session, vae, clips, perturb, on_clip):
        s = score(frames, clips.track[i], probes.mouth)
        conf.append(s.confidence)
        peak.append(s.peak)
        lag.append(s.lag)
        ident.append(_identity(frames, clips.portrait[i], probes))
        lats.append(z)
    return ClipScores(np.asarray(conf, np.float64), np.asarray(peak, np.float64), np.asarray(lag, np.int64),
                      np.asarray(ident, np.float64), np.stack(lats))


@dataclasses.dataclass(frozen=True)
class DriftScores:
    """Per long clip (n clips), the last `window` frames against the first: lip-sync
    confidence change (last - first) and identity-distance change (last - first), float64 [n]."""

    confidence: np.ndarray
    identity: np.ndarray


def drift_clips(session: ClipSession, vae, probes: Probes, clips: ClipInputs, window: int, perturb=None,
                on_clip=None) -> DriftScores:
    """Lip sync and identity of the first and the last `window` frames of each (long) clip."""
    from characters_jax.lipsync.score import score

    conf, ident = [], []
    if not 0 < window <= clips.frames // 2:
        raise ValueError(f"the drift window ({window} frames) must be at most half a clip ({clips.frames} frames)")
    for i, _, frames in _clip_frames(session, vae, clips, perturb, on_clip):
        first, last = slice(0, window), slice(clips.frames - window, clips.frames)
        c = [score(frames[w], clips.track[i][w], probes.mouth).confidence for w in (first, last)]
        d = [_identity(frames[w], clips.portrait[i], probes) for w in (first, last)]
        conf.append(c[1] - c[0])
        ident.append(d[1] - d[0])
    return DriftScores(np.asarray(conf, np.float64), np.asarray(ident, np.float64))
