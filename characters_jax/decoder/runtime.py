"""Compiled entry points of the VAE for one config: encode an image, decode a chunk.

`VaeRuntime.decode(state, latent)` takes one latent frame [grid_h, grid_w, latent_channels]
float32 and the session's temporal state, and returns frames [frames_per_step, H, W, 3]
uint8 and the new state (donated: decoded in place). One program per config.

Weights: trained ones from a weights directory (`checkpoint=`, see `weights`; latents are
then in the generator's normalised space: (z - mean) / std per channel, with the stored
statistics), or random ones drawn from `seed` (the default; the reference image's latent
is then scaled to unit RMS per channel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from characters_jax.config import Config
from characters_jax.decoder.vae import VideoDecoder, VideoEncoder
from characters_jax.weights.directory import LatentStats, abstract_tree, open_weights


def to_uint8(video: jax.Array) -> jax.Array:
    """[..., 3] float in [-1, 1] -> uint8 [0, 255]."""
    return jnp.round((video + 1.0) * 127.5).astype(jnp.uint8)


def init_module(make, seed: int):
    """Random weights drawn on the host (numpy): no device program per parameter shape.

    Conv kernels [kt, kh, kw, cin, cout] ~ N(0, 1 / fan_in), biases 0. Returns (graphdef, params).
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = str(path[-1])
        if "bias" in name or len(leaf.shape) < 2:
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = int(np.prod(leaf.shape[:-1]))
        return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) / np.sqrt(fan_in), leaf.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def unit_rms(z: jax.Array) -> jax.Array:
    """[gh, gw, C] scaled to unit RMS per channel (random-weight latents)."""
    return z * jax.lax.rsqrt(jnp.mean(z * z, axis=(0, 1), keepdims=True) + 1e-6)


def vae_modules(cfg: Config):
    """(decoder graphdef, abstract params, encoder graphdef, abstract params)."""
    dec_def, dec = nnx.split(nnx.eval_shape(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0))))
    enc_def, enc = nnx.split(nnx.eval_shape(lambda: VideoEncoder(cfg, rngs=nnx.Rngs(0))))
    return dec_def, dec, enc_def, enc


def load_vae(checkpoint, cfg: Config):
    """(decoder params, encoder params, LatentStats) from a weights directory, checked
    against cfg (`weights.WeightsError` names what differs)."""
    w = open_weights(checkpoint, cfg)
    _, dec, _, enc = vae_modules(cfg)
    target = {"decoder": abstract_tree(nnx.to_pure_dict(dec)), "encoder": abstract_tree(nnx.to_pure_dict(enc))}
    restored = w.restore("vae", target)
    params = []
    for name, abstract in (("decoder", dec), ("encoder", enc)):
        state = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(state, restored[name])
        params.append(state)
    return params[0], params[1], w.stats


def state_bytes(cfg: Config) -> int:
    """Bytes of one decode stream's temporal state (what a session snapshot carries and the
    decoder link sends and receives in one message), from the decoder's shapes."""
    dec_def, dec, _, _ = vae_modules(cfg)
    v, m = cfg.video, cfg.model
    latent = jax.ShapeDtypeStruct((v.grid_h, v.grid_w, m.latent_channels), jnp.float32)
    return _nbytes(jax.eval_shape(lambda p, z: nnx.merge(dec_def, p)(z[None], None)[1], dec, latent))


def _nbytes(shapes) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes)


class VaeRuntime:
    def __init__(self, cfg: Config, seed: int = 0, checkpoint=None):
        """checkpoint: a weights directory (trained VAE), or None: random weights from seed."""
        self.config = cfg
        if checkpoint:
            dec_def, _, enc_def, _ = vae_modules(cfg)
            self._dec_params, self._enc_params, stats = load_vae(checkpoint, cfg)
        else:
            dec_def, self._dec_params = init_module(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0)), seed)
            enc_def, self._enc_params = init_module(lambda: VideoEncoder(cfg, rngs=nnx.Rngs(0)), seed + 1)
            stats = None
        # Weights, and every state a stream starts from, committed to this process's device:
        # a decode's returned state then has the placement of a new one (one compiled program).
        self._device = jax.devices()[0]
        self._dec_params, self._enc_params = jax.device_put((self._dec_params, self._enc_params), self._device)
        self.stats: LatentStats | None = stats
        v, m = cfg.video, cfg.model
        self.latent_shape = (v.grid_h, v.grid_w, m.latent_channels)

        def _decode(params, state, z):
            if stats is not None:
                z = stats.denormalise(z)
            out, new = nnx.merge(dec_def, params)(z[None], state)
            return to_uint8(out), new

        def _encode(params, rgb):
            x = rgb.astype(jnp.float32) / 127.5 - 1.0
            z = nnx.merge(enc_def, params).encode_image(x)
            return unit_rms(z) if stats is None else stats.normalise(z)

        def _encode_video(params, rgb):
            z = nnx.merge(enc_def, params)(rgb.astype(jnp.float32) / 127.5 - 1.0)
            return jax.vmap(unit_rms)(z) if stats is None else stats.normalise(z)

        self._decode = jax.jit(_decode, donate_argnums=(1,))
        self._encode = jax.jit(_encode)
        self._encode_video = jax.jit(_encode_video)
        shapes = jax.eval_shape(lambda p, z: nnx.merge(dec_def, p)(z[None], None)[1], self._dec_params, jax.ShapeDtypeStruct(self.latent_shape, jnp.float32))
        self._state_shapes = shapes
        self.state_bytes = _nbytes(shapes)

    def initial_state(self) -> list[jax.Array]:
        """Empty temporal history: what a new session starts from."""
        return [jax.device_put(jnp.zeros(s.shape, s.dtype), self._device) for s in self._state_shapes]

    def export_state(self, state) -> list[np.ndarray]:
        """A stream's temporal state on the host (copies), in the decoder's order."""
        return [np.array(s, copy=True) for s in state]

    def import_state(self, arrays) -> list[jax.Array]:
        """A stream's state from `export_state`'s arrays, on this process's device. Raises
        ValueError naming the first array of another count, shape or dtype."""
        shapes = self._state_shapes
        if len(arrays) != len(shapes):
            raise ValueError(f"the decoder state has {len(shapes)} arrays, got {len(arrays)}")
        for i, (a, s) in enumerate(zip(arrays, shapes)):
            if tuple(a.shape) != tuple(s.shape) or np.dtype(a.dtype) != np.dtype(s.dtype):
                raise ValueError(f"decoder state array {i}: {np.dtype(a.dtype).name}{list(a.shape)}, expected {np.dtype(s.dtype).name}{list(s.shape)}")
        return [jax.device_put(np.asarray(a), self._device) for a in arrays]

    def decode(self, state, latent) -> tuple[jax.Array, list[jax.Array]]:
        """(state, latent [grid_h, grid_w, C] f32) -> (frames [frames_per_step, H, W, 3] uint8, state)."""
        return self._decode(self._dec_params, state, jnp.asarray(latent, jnp.float32))

    def decode_stream(self, latents) -> np.ndarray:
        """uint8 [steps * frames_per_step, H, W, 3]: latents [steps, gh, gw, C] decoded in
        order from a new stream's state, the temporal state carried (as the decoder process
        decodes a session)."""
        state, out = self.initial_state(), []
        for z in latents:
            chunk, state = self.decode(state, z)
            out.append(chunk)
        return np.concatenate([np.asarray(c) for c in out])

    def encode(self, rgb: np.ndarray) -> jax.Array:
        """rgb [H, W, 3] uint8 at the video size -> latent [grid_h, grid_w, latent_channels] f32."""
        return self._encode(self._enc_params, jnp.asarray(rgb, jnp.uint8))

    def encode_video(self, rgb: np.ndarray) -> jax.Array:
        """rgb [4k, H, W, 3] uint8 -> latents [k, grid_h, grid_w, latent_channels] f32, one
        per chunk of frames_per_step frames (in the generator's space, as `encode`)."""
        return self._encode_video(self._enc_params, jnp.asarray(rgb, jnp.uint8))

    def warmup(self) -> None:
        """Compiles both programs."""
        v = self.config.video
        self.encode(np.zeros((v.height, v.width, 3), np.uint8)).block_until_ready()
        frames, _ = self.decode(self.initial_state(), np.zeros(self.latent_shape, np.float32))
        frames.block_until_ready()
