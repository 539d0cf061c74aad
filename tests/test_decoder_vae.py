"""Causal VAE: chunk-by-chunk decoding with carried state equals whole-sequence decoding;
the video encoder's chunks are independent; a still image is a chunk of identical frames."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from characters_jax.config import ConfigError, load_config
from characters_jax.decoder.runtime import VaeRuntime, init_module
from characters_jax.decoder.vae import VideoDecoder, VideoEncoder


def _decoder(cfg):
    """The decoder as one jitted function of (z [T, gh, gw, C], state | None)."""
    g, params = init_module(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0)), 0)
    run = jax.jit(lambda p, z, s: nnx.merge(g, p)(z, s))
    return lambda z, s=None: run(params, z, s)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_chunks_join_without_seams(name):
    cfg = load_config(name)
    dec = _decoder(cfg)
    v = cfg.video
    z = jax.random.normal(jax.random.key(1), (4, v.grid_h, v.grid_w, cfg.model.latent_channels))
    whole, _ = dec(z)
    assert whole.shape == (4 * v.frames_per_step, v.height, v.width, 3)
    state, parts = None, []
    for t in range(4):
        out, state = dec(z[t : t + 1], state)
        parts.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts)), np.asarray(whole), atol=1e-4)
    assert float(whole.std()) > 0.05  # not a constant image


def test_causal_later_latents_do_not_change_earlier_frames():
    cfg = load_config("tiny")
    dec = _decoder(cfg)
    v = cfg.video
    z = jax.random.normal(jax.random.key(2), (3, v.grid_h, v.grid_w, cfg.model.latent_channels))
    a, _ = dec(z)
    b, _ = dec(z.at[2].set(0.0))
    f = v.frames_per_step
    np.testing.assert_allclose(np.asarray(a[: 2 * f]), np.asarray(b[: 2 * f]), atol=1e-5)
    assert not np.allclose(np.asarray(a[2 * f :]), np.asarray(b[2 * f :]))


def test_runtime_decode_and_encode_shapes():
    cfg = load_config("tiny")
    rt = VaeRuntime(cfg, seed=0)
    v = cfg.video
    lat = rt.encode(np.random.default_rng(0).integers(0, 255, (v.height, v.width, 3), dtype=np.uint8))
    assert lat.shape == (v.grid_h, v.grid_w, cfg.model.latent_channels) and lat.dtype == jnp.float32
    assert np.isclose(float(jnp.sqrt(jnp.mean(lat**2))), 1.0, atol=1e-2)
    state = rt.initial_state()
    for _ in range(3):
        frames, state = rt.decode(state, np.asarray(lat))
    assert frames.shape == (4, v.height, v.width, 3) and frames.dtype == jnp.uint8
    assert rt._decode._cache_size() == 1


def test_decoder_layout_of_the_paper_shape():
    cfg = load_config("characters-57b")
    g, st = nnx.split(nnx.eval_shape(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0))))
    v = cfg.video
    out = jax.eval_shape(lambda s, z: nnx.merge(g, s)(z)[0], st, jax.ShapeDtypeStruct((1, v.grid_h, v.grid_w, 128), jnp.float32))
    assert out.shape == (4, 704, 1088, 3)
    g, st = nnx.split(nnx.eval_shape(lambda: VideoEncoder(cfg, rngs=nnx.Rngs(0))))
    lat = jax.eval_shape(lambda s, x: nnx.merge(g, s)(x), st, jax.ShapeDtypeStruct((8, 704, 1088, 3), jnp.float32))
    assert lat.shape == (2, 22, 34, 128)
    lat = jax.eval_shape(lambda s, x: nnx.merge(g, s).encode_image(x), st, jax.ShapeDtypeStruct((704, 1088, 3), jnp.float32))
    assert lat.shape == (22, 34, 128)


def test_bad_decoder_config_names_the_field():
    cfg = load_config("tiny")
    with pytest.raises(ConfigError, match="decoder.channels"):
        VideoDecoder(cfg.replace(decoder={"channels": (16, 8)}), rngs=nnx.Rngs(0))


def _encoder(cfg, seed=3):
    g, params = init_module(lambda: VideoEncoder(cfg, rngs=nnx.Rngs(0)), seed)
    return jax.jit(lambda x: nnx.merge(g, params)(x)), jax.jit(lambda x: nnx.merge(g, params).encode_image(x))


def test_encoder_chunks_are_causal_and_a_still_is_a_chunk():
    cfg = load_config("tiny")
    v = cfg.video
    enc, enc_image = _encoder(cfg)
    video = jax.random.uniform(jax.random.key(4), (3 * v.frames_per_step, v.height, v.width, 3), minval=-1, maxval=1)
    z = enc(video)
    assert z.shape == (3, v.grid_h, v.grid_w, cfg.model.latent_channels) and z.dtype == jnp.float32
    f = v.frames_per_step
    changed = enc(video.at[f:].set(0.0))  # later chunks change: the first latent does not
    np.testing.assert_allclose(np.asarray(changed[0]), np.asarray(z[0]), atol=1e-6)
    assert not np.allclose(np.asarray(changed[1]), np.asarray(z[1]))
    one = enc(video[f : 2 * f])  # a chunk alone encodes as it does in the sequence
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(z[1]), atol=1e-5)
    still = jnp.broadcast_to(video[5], (f,) + video.shape[1:])
    np.testing.assert_allclose(np.asarray(enc_image(video[5])), np.asarray(enc(still)[0]), atol=1e-6)
