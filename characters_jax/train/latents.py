"""The DiT's training set on the device: clips rendered and encoded by the trained VAE,
their audio tokens from the project's front end, the reference latents and prompts.

For clip n with L steps (4 frames each): latents [L, T_img, C] (the encoder's, normalised
per channel by `LatentStats` measured here over the whole set), audio [L, A, F] (step s's
tokens from `AudioFrontEnd`, the window the serving step loop cuts: ending at the step's
last sample, zeros before the audio starts), ref [T_img, C] (the portrait: frame 0's pose,
mouth closed, eyes open, encoded as a still chunk, as the service encodes a reference
image), a prompt (UTF-8 bytes of one of `PROMPTS`, padded to `prompt_pad`) and its length.
token_weight [T_img]: 1 + mouth_weight x the share of each latent token's pixels that the
mouth box covers on average (the tokens that carry the speech).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.config import Config
from characters_jax.weights.directory import LatentStats
from characters_jax.data.motion import still_params
from characters_jax.train.faces import render_video
from characters_jax.train.geometry import mouth_mask
from characters_jax.data.plans import PlanSet

PROMPTS = ("a friendly character, talking", "", "a cartoon face", "someone speaking", "talking head",
           "a person telling a story", "hello", "a calm voice", "an animated portrait, speaking clearly",
           "a character in a video call")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DitData:
    """latents [N, L, T_img, C]; audio [N, L, A, F]; ref [N, T_img, C]; prompt [N, P] int32;
    prompt_len [N] int32; token_weight [T_img] (float32 unless noted)."""

    latents: jax.Array
    audio: jax.Array
    ref: jax.Array
    prompt: jax.Array
    prompt_len: jax.Array
    token_weight: jax.Array

    def __len__(self) -> int:
        return int(self.latents.shape[0])


def prompt_ids(index: int, pad: int) -> tuple[np.ndarray, int]:
    """Clip `index`'s prompt bytes padded to `pad` (int32 [pad]) and its length."""
    raw = PROMPTS[index % len(PROMPTS)].encode("utf-8")[:pad]
    return np.pad(np.frombuffer(raw, np.uint8).astype(np.int32), (0, pad - len(raw))), len(raw)


def step_windows(frontend: AudioFrontEnd, audio: np.ndarray, steps: int) -> np.ndarray:
    """float32 [n, steps, window]: each step's front-end window of int16 audio [n, N]
    (`AudioFrontEnd.window`: zeros before sample 0 and after the end)."""
    w = frontend.spec.window_samples
    n, total = audio.shape
    padded = np.zeros((n, w + total + w), np.float32)
    padded[:, w:w + total] = audio.astype(np.float32) / 32768.0
    starts = np.asarray([frontend.window_bounds(s)[0] for s in range(steps)]) + w
    return padded[:, starts[:, None] + np.arange(w)[None, :]]


def audio_tokens(cfg: Config, audio: np.ndarray, steps: int, chunk: int = 64) -> np.ndarray:
    """float32 [n, steps, A, F]: the front end's tokens of every step of every clip."""
    fe = AudioFrontEnd(cfg)
    tokens = jax.jit(jax.vmap(jax.vmap(fe.tokens)))
    return np.concatenate([np.asarray(tokens(jnp.asarray(step_windows(fe, audio[i:i + chunk], steps))))
                           for i in range(0, len(audio), chunk)])


def encode_clips(vae, vae_params, cfg: Config, plans: PlanSet, chunk: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Raw latents of the clips' frames [n, L, gh, gw, C] and of their portraits [n, gh, gw, C]."""
    h, w = cfg.video.height, cfg.video.width
    f = cfg.video.frames_per_step
    frames = plans.params.shape[1] // f * f

    @jax.jit
    def encode(ident, params):
        video = render_video(ident, params, height=h, width=w)
        return jax.vmap(lambda v: vae.encode(vae_params, v))(video)

    @jax.jit
    def encode_ref(ident, params):
        still = render_video(ident, params, height=h, width=w)  # [n, 1, H, W, 3]
        return jax.vmap(lambda x: vae.encode_image(vae_params, x[0]))(still)

    lats, refs = [], []
    for i in range(0, len(plans), chunk):
        part = plans.take(slice(i, i + chunk))
        n = len(part)
        ident, params = part.identity, part.params[:, :frames]
        if n < chunk:  # one compiled shape
            ident = np.concatenate([ident, np.repeat(ident[-1:], chunk - n, 0)])
            params = np.concatenate([params, np.repeat(params[-1:], chunk - n, 0)])
        still = np.stack([still_params(p, 1) for p in params])
        lats.append(np.asarray(encode(jnp.asarray(ident), jnp.asarray(params)))[:n])
        refs.append(np.asarray(encode_ref(jnp.asarray(ident), jnp.asarray(still)))[:n])
    return np.concatenate(lats), np.concatenate(refs)


def measure_stats(z: np.ndarray) -> LatentStats:
    """Per-channel mean and std over everything but the last axis."""
    flat = z.reshape(-1, z.shape[-1]).astype(np.float64)
    return LatentStats(flat.mean(0).astype(np.float32), np.maximum(flat.std(0), 1e-4).astype(np.float32))


def mouth_token_share(cfg: Config, plans: PlanSet, sample: int = 16) -> np.ndarray:
    """float32 [T_img]: the share of each latent token's pixels inside the mouth box,
    averaged over some frames of the plans, scaled to a maximum of 1."""
    v = cfg.video
    params = jnp.asarray(plans.params[:sample, ::8])
    masks = jax.vmap(lambda i, p: mouth_mask(i, p, v.height, v.width))(jnp.asarray(plans.identity[:sample]), params)
    share = np.asarray(masks.mean((0, 1))).reshape(v.grid_h, v.height // v.grid_h, v.grid_w, v.width // v.grid_w).mean((1, 3))
    return (share / max(share.max(), 1e-9)).reshape(-1).astype(np.float32)


def build_dit_data(cfg: Config, vae, vae_params, plans: PlanSet, stats: LatentStats | None = None,
                   mouth_weight: float = 2.0, prompt_pad: int | None = None) -> tuple[DitData, LatentStats]:
    """The DiT's training set (module docstring) and the latent statistics it was normalised
    with (measured here unless given)."""
    f = cfg.video.frames_per_step
    steps = plans.params.shape[1] // f
    z, ref = encode_clips(vae, vae_params, cfg, plans)
    stats = stats or measure_stats(z)
    c = cfg.model.latent_channels
    t_img = cfg.video.tokens_per_frame
    pad = prompt_pad or cfg.cache.prompt_buckets[min(1, len(cfg.cache.prompt_buckets) - 1)]
    prompts = [prompt_ids(int(i), pad) for i in plans.index]
    norm = lambda a: (a - stats.mean) / stats.std  # noqa: E731
    data = DitData(
        latents=jnp.asarray(norm(z).reshape(len(plans), steps, t_img, c), jnp.float32),
        audio=jnp.asarray(audio_tokens(cfg, plans.audio, steps)),
        ref=jnp.asarray(norm(ref).reshape(len(plans), t_img, c), jnp.float32),
        prompt=jnp.asarray(np.stack([p for p, _ in prompts]), jnp.int32),
        prompt_len=jnp.asarray([n for _, n in prompts], jnp.int32),
        token_weight=jnp.asarray(1.0 + mouth_weight * mouth_token_share(cfg, plans)),
    )
    return data, stats
