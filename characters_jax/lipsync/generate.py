"""Sessions of a weights directory's generator, offline, step by step as the worker runs them.

`make_generator` builds the `DiTGenerator` that `serve` runs (the config's [engine] table,
the portable paths if a default kernel does not build here); `generate_latents` runs one
session on a portrait and speech (prefill with the VAE-encoded portrait and the prompt, one
step per audio window of `AudioFrontEnd`); `generate` decodes it as the decoder process
does (`VaeRuntime.decode_stream`, the temporal state carried); `reconstruct` is the truth's
own round trip through the VAE. The evaluations (`train.evaluate`) and the measures'
validation (`fidelity_eval`) share them.
"""

from __future__ import annotations

import numpy as np

from characters_jax.config import Config

PROMPT = "a friendly character, talking"  # the evaluations' prompt
# The engine's portable paths, for a backend where a default kernel does not build.
PORTABLE = {"attention": "reference", "kernels": "none"}


def generate_latents(cfg: Config, generator, vae, image: np.ndarray, audio: np.ndarray, prompt: str,
                     seed: int = 1) -> list:
    """[steps] latents [gh, gw, C]: a session of `generator` (DiTGenerator) on image uint8
    [H, W, 3] (encoded by `vae`, a VaeRuntime) and int16 speech [N], step by step as the
    worker runs it."""
    from characters_jax.audio.features import AudioFrontEnd
    from characters_jax.audio.timeline import Timeline

    fe = AudioFrontEnd(cfg)
    timeline = Timeline.from_config(cfg)
    latent = np.asarray(vae.encode(image))
    generator.start_session(latent, list(prompt.encode("utf-8")), seed)
    return [generator.step(fe.tokens(fe.window(lambda lo, hi: audio[lo:hi], s)))
            for s in range(timeline.steps_for(len(audio)))]


def generate(cfg: Config, generator, vae, image: np.ndarray, audio: np.ndarray, prompt: str, seed: int = 1,
             frames: int | None = None) -> np.ndarray:
    """uint8 [T, H, W, 3]: `generate_latents` decoded as the decoder process does."""
    video = vae.decode_stream(generate_latents(cfg, generator, vae, image, audio, prompt, seed))
    return video[:frames] if frames is not None else video


def reconstruct(vae, frames: np.ndarray) -> np.ndarray:
    """uint8 [T, H, W, 3]: frames (T a multiple of 4) encoded, then decoded chunk by chunk
    with the decoder's state carried."""
    return vae.decode_stream(np.asarray(vae.encode_video(frames)))


def make_generator(cfg: Config, log, checkpoint=None, seed: int = 0):
    """DiTGenerator with the config's engine options (what `serve` runs), compiled by one
    prefill and step; if that fails, the portable paths (`PORTABLE`, an [engine] table).
    Returns (generator, engine table used: None for the config's)."""
    from characters_jax.engine.generator import DiTGenerator

    v, m = cfg.video, cfg.model

    def build(engine):
        gen = DiTGenerator(cfg.replace(engine=engine), checkpoint=checkpoint, seed=seed)
        gen.start_session(np.zeros((v.grid_h, v.grid_w, m.latent_channels), np.float32), [32], 0)
        np.asarray(gen.step(np.zeros((m.audio_tokens_per_step, m.audio_feature_dim), np.float32)))
        return gen

    try:
        return build({}), None
    except Exception as err:  # noted in the result
        log(f"eval: the engine's default paths failed ({type(err).__name__}: {err}); using {PORTABLE}")
        return build(PORTABLE), PORTABLE
