"""The training forward matches the engine: same weights and inputs, float32 cache and the
reference attention; a clip long enough for two position resets, a prompt shorter than its
bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from characters_jax.config import load_config
from characters_jax.engine.generator import DiTGenerator
from characters_jax.train.dit_forward import clip_velocity, frame_times

STEPS = 12
SEED = 7


def _config(sigmas):
    # reset_period 3: resets at steps 8 and 11 (frame time 9 -> 6), ring of 6 frames
    return load_config("tiny").replace(cache={"dtype": "float32", "reset_period": 3}, sampler={"sigmas": sigmas})


def test_frame_times_follow_the_engine():
    np.testing.assert_array_equal(frame_times(12, 6, 3), [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 6])
    t = frame_times(200, 6, 42)
    assert t.min() == 1 and t.max() == 47 and t[47] == 6 and t[89] == 6


def _engine_run(cfg, image, prompt, audio):
    gen = DiTGenerator(cfg.replace(engine={"attention": "reference"}), tp=1, seed=SEED)
    gen.start_session(image, prompt, seed=3)
    key = jax.random.wrap_key_data(jnp.asarray(np.asarray(gen.state.rng)))
    shape = (cfg.video.tokens_per_frame, cfg.model.latent_channels)
    noise = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(key, s), shape, jnp.float32)) for s in range(STEPS)])
    out = np.stack([np.asarray(gen.step(jnp.asarray(a))) for a in audio])
    model = nnx.merge(gen.engine.graphdef, gen.params)
    return model, noise, out.reshape(STEPS, *shape)


def _inputs(cfg):
    rs = np.random.RandomState(0)
    v, m = cfg.video, cfg.model
    image = rs.randn(v.grid_h, v.grid_w, m.latent_channels).astype(np.float32)
    audio = rs.randn(STEPS, m.audio_tokens_per_step, m.audio_feature_dim).astype(np.float32)
    return image, list(b"hello"), audio


@pytest.mark.parametrize("sigmas", [(0.25, 0.0), (1.0, 0.75, 0.5, 0.25, 0.0)], ids=["one-pass", "four-pass"])
def test_training_forward_matches_the_engine(sigmas):
    cfg = _config(sigmas)
    image, prompt, audio = _inputs(cfg)
    model, noise, engine_out = _engine_run(cfg, image, prompt, audio)
    bucket = 8
    padded = jnp.asarray(np.pad(np.asarray(prompt, np.int32), (0, bucket - len(prompt))))
    forward = jax.jit(lambda ctx, cur, sig: clip_velocity(
        model, cfg, jnp.asarray(image.reshape(-1, image.shape[-1])), padded, jnp.int32(len(prompt)), ctx,
        jnp.asarray(audio), cur, sig))
    ctx = jnp.zeros_like(jnp.asarray(noise))
    ours = []
    for s in range(STEPS):  # the sampler, step by step, through the training forward
        x = jnp.asarray(noise[s])
        for i in range(len(sigmas) - 1):
            v = forward(ctx, ctx.at[s].set(x), jnp.full((STEPS,), sigmas[i], jnp.float32))[s]
            if i == len(sigmas) - 2:
                ctx = ctx.at[s].set(x)  # the last pass's input: this frame's context from now on
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        ours.append(np.asarray(x))
    ours = np.stack(ours)
    scale = np.abs(engine_out).max()
    assert scale > 0.1
    np.testing.assert_allclose(ours, engine_out, atol=1e-5 * scale, rtol=0)
