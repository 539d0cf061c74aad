"""Causal 3-D-conv VAE decoder and its matching video encoder (Flax NNX).

Layout (LTX-Video's decoder, time upsampling set to the config's frames_per_step):
  conv-in latent_channels -> channels[0]
  for each stage i: blocks_per_stage residual blocks at channels[i]
      (PixelNorm -> SiLU -> causal conv 3x3x3, twice, plus the skip)
  between stages: depth-to-space upsampling (a causal conv to C_next * st * 2 * 2 channels,
      then rearranged: 2x in space, st = 2 in time for the first log2(frames_per_step)
      upsamplers, else 1)
  PixelNorm -> SiLU -> conv-out to out_channels (3 * unpatchify^2) -> unpatchify: RGB.
For characters-57b (channels 1024/512/256/128) that turns a 22x34 latent into 704x1088.

Causality and the temporal state: every conv is causal in time (kernel 3: it sees its
input frame and the two before it) and PixelNorm is per position, so output frame t
depends on latent frames <= t only. Each conv keeps the last (kernel_t - 1) frames of its
input as state; decoding chunk by chunk with the state carried gives exactly the frames of
decoding the whole sequence at once: no seams between chunks.

Arrays: video [T, H, W, C] (the batch is one session; conv layers see [1, T, H, W, C]).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from characters_jax.config import Config, ConfigError

KERNEL_T = 3


def pixel_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMS-normalises over channels at every position: x [..., C] -> same shape."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class CausalConv3d(nnx.Module):
    """3x3 in space (same padding), `kernel_t` causal taps in time.

    __call__(x [T, H, W, Cin], history [kernel_t - 1, H, W, Cin] | None) ->
        (y [T, H, W, Cout], new_history [kernel_t - 1, H, W, Cin]).
    A None history is zeros (the start of a session).
    """

    def __init__(self, cin: int, cout: int, *, kernel_t: int = KERNEL_T, dtype=jnp.float32, rngs: nnx.Rngs):
        self.kernel_t = kernel_t
        self.conv = nnx.Conv(cin, cout, kernel_size=(kernel_t, 3, 3), padding=((0, 0), (1, 1), (1, 1)), dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x, history):
        k = self.kernel_t - 1
        if history is None:
            history = jnp.zeros((k,) + x.shape[1:], x.dtype)
        full = jnp.concatenate([history.astype(x.dtype), x], axis=0)
        y = self.conv(full[None])[0]
        return y, full[full.shape[0] - k :]


class ResBlock(nnx.Module):
    def __init__(self, ch: int, *, dtype, rngs: nnx.Rngs):
        self.conv1 = CausalConv3d(ch, ch, dtype=dtype, rngs=rngs)
        self.conv2 = CausalConv3d(ch, ch, dtype=dtype, rngs=rngs)

    def __call__(self, x, state):
        h, s1 = self.conv1(jax.nn.silu(pixel_norm(x)), state[0])
        h, s2 = self.conv2(jax.nn.silu(pixel_norm(h)), state[1])
        return x + h, [s1, s2]


class DepthToSpaceUp(nnx.Module):
    """[T, H, W, Cin] -> [T * st, 2H, 2W, Cout] through a causal conv to Cout * st * 4 channels."""

    def __init__(self, cin: int, cout: int, st: int, *, dtype, rngs: nnx.Rngs):
        self.st, self.cout = st, cout
        self.conv = CausalConv3d(cin, cout * st * 4, dtype=dtype, rngs=rngs)

    def __call__(self, x, state):
        y, s = self.conv(x, state[0])
        t, h, w, _ = y.shape
        y = y.reshape(t, h, w, self.st, 2, 2, self.cout)
        y = y.transpose(0, 3, 1, 4, 2, 5, 6).reshape(t * self.st, h * 2, w * 2, self.cout)
        return y, [s]


def _plan(cfg: Config) -> tuple[list[int], int]:
    """Validates the decoder config; returns (time factor of each upsampler, unpatchify)."""
    d, v = cfg.decoder, cfg.video
    n_up = len(d.channels) - 1
    u = d.unpatchify
    if d.out_channels != 3 * u * u:
        raise ConfigError(f"decoder.out_channels: must be 3 * unpatchify^2 = {3 * u * u}, got {d.out_channels}")
    if v.spatial_compression != u * 2**n_up:
        raise ConfigError(f"decoder.channels: {len(d.channels)} stages and unpatchify {u} give {u * 2**n_up}x in space, video.spatial_compression is {v.spatial_compression}")
    t_ups = int(round(math.log2(v.frames_per_step)))
    if 2**t_ups != v.frames_per_step or t_ups > n_up:
        raise ConfigError(f"video.frames_per_step: must be a power of two <= 2^{n_up} for this decoder, got {v.frames_per_step}")
    return [2 if i < t_ups else 1 for i in range(n_up)], u


def _dtype(cfg: Config):
    return jnp.bfloat16 if cfg.decoder.dtype == "bfloat16" else jnp.float32


class VideoDecoder(nnx.Module):
    """latent [T, grid_h, grid_w, latent_channels] -> video [T * frames_per_step, H, W, 3] in [-1, 1].

    __call__(z, state | None) -> (video float32, new_state); state is a flat list of conv
    histories (a pytree with fixed shapes per config), None at the start of a session.
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        t_factors, self.unpatchify = _plan(cfg)
        d, dt = cfg.decoder, _dtype(cfg)
        ch = d.channels
        self.conv_in = CausalConv3d(cfg.model.latent_channels, ch[0], dtype=dt, rngs=rngs)
        self.stages = nnx.List([nnx.List([ResBlock(c, dtype=dt, rngs=rngs) for _ in range(d.blocks_per_stage)]) for c in ch])
        self.ups = nnx.List([DepthToSpaceUp(ch[i], ch[i + 1], t_factors[i], dtype=dt, rngs=rngs) for i in range(len(ch) - 1)])
        self.conv_out = CausalConv3d(ch[-1], d.out_channels, dtype=dt, rngs=rngs)
        self.dtype = dt

    def __call__(self, z, state=None, clip: bool = True):
        """clip: the frames clipped to [-1, 1] (False: as the last conv draws them, for training)."""
        it = iter(state) if state is not None else None
        new = []

        def take(n):
            return [next(it) for _ in range(n)] if it is not None else [None] * n

        x, s = self.conv_in(z.astype(self.dtype), take(1)[0])
        new.append(s)
        for i, blocks in enumerate(self.stages):
            for blk in blocks:
                x, s = blk(x, take(2))
                new.extend(s)
            if i < len(self.ups):
                x, s = self.ups[i](x, take(1))
                new.extend(s)
        x, s = self.conv_out(jax.nn.silu(pixel_norm(x)), take(1)[0])
        new.append(s)
        u = self.unpatchify
        t, h, w, _ = x.shape
        x = x.reshape(t, h, w, u, u, 3).transpose(0, 1, 3, 2, 4, 5).reshape(t, h * u, w * u, 3)
        x = x.astype(jnp.float32)
        return (jnp.clip(x, -1.0, 1.0) if clip else x), new


class VideoEncoder(nnx.Module):
    """The decoder's mirror: video [T, H, W, 3] in [-1, 1] (T a multiple of frames_per_step)
    -> latent [T / frames_per_step, grid_h, grid_w, latent_channels] float32 (raw: not
    normalised; `LatentStats` maps it to the generator's space).

    Each chunk of frames_per_step frames is encoded on its own (causal: latent n depends on
    frames 4n .. 4n + 3 only, its convs start from an empty history): patchify by
    `unpatchify` -> conv-in to channels[-1] -> residual stages from the image side with
    space-to-depth downsampling between them (2x in space; 2x in time at the downsamplers
    that mirror the decoder's time upsamplers) -> conv-out to latent_channels.
    A still image (the reference) is a chunk of identical frames (`encode_image`).
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        t_factors, self.unpatchify = _plan(cfg)
        d, dt = cfg.decoder, _dtype(cfg)
        ch = list(reversed(d.channels))
        self.frames = cfg.video.frames_per_step
        self.t_factors = tuple(reversed(t_factors))  # per downsampler, from the image side
        self.conv_in = CausalConv3d(d.out_channels, ch[0], dtype=dt, rngs=rngs)
        self.stages = nnx.List([nnx.List([ResBlock(c, dtype=dt, rngs=rngs) for _ in range(d.blocks_per_stage)]) for c in ch])
        self.downs = nnx.List([CausalConv3d(ch[i] * 4 * self.t_factors[i], ch[i + 1], dtype=dt, rngs=rngs)
                               for i in range(len(ch) - 1)])
        self.conv_out = CausalConv3d(ch[-1], cfg.model.latent_channels, dtype=dt, rngs=rngs)
        self.dtype = dt

    def encode_chunk(self, video):
        """video [frames_per_step, H, W, 3] -> [1, grid_h, grid_w, latent_channels] float32."""
        u = self.unpatchify
        t, h, w, _ = video.shape
        x = video.astype(self.dtype).reshape(t, h // u, u, w // u, u, 3).transpose(0, 1, 3, 2, 4, 5)
        x, _ = self.conv_in(x.reshape(t, h // u, w // u, 3 * u * u), None)
        for i, blocks in enumerate(self.stages):
            for blk in blocks:
                x, _ = blk(x, [None, None])
            if i < len(self.downs):
                st = self.t_factors[i]
                t, hh, ww, c = x.shape
                x = x.reshape(t // st, st, hh // 2, 2, ww // 2, 2, c).transpose(0, 2, 4, 1, 3, 5, 6)
                x, _ = self.downs[i](x.reshape(t // st, hh // 2, ww // 2, st * 4 * c), None)
        x, _ = self.conv_out(jax.nn.silu(pixel_norm(x)), None)
        return x.astype(jnp.float32)

    def __call__(self, video):
        f = self.frames
        t = video.shape[0]
        if t % f:
            raise ValueError(f"the encoder takes whole chunks of {f} frames, got {t}")
        chunks = video.reshape(t // f, f, *video.shape[1:])
        return jax.vmap(self.encode_chunk)(chunks)[:, 0]

    def encode_image(self, rgb):
        """rgb [H, W, 3] in [-1, 1] -> [grid_h, grid_w, latent_channels]: a still chunk."""
        return self.encode_chunk(jnp.broadcast_to(rgb[None], (self.frames,) + rgb.shape))[0]


# The serving side sizes the encoder's memory by this name; it is the same module.
ImageEncoder = VideoEncoder
