"""The video DiT in Flax NNX: parallel blocks, QK-norm, 3-D RoPE, adaLN-single.

One step feeds T = grid_h * grid_w latent tokens plus the audio tokens of that step. Each
block reads one modulated RMSNorm of its input; attention and the MLP run side by side and
their row-parallel outputs are summed before ONE all-reduce. Conditioning rides in the
sequence: audio tokens with the frame, the reference image and prompt in the cached sink.

``Block.__call__`` is the whole block, top to bottom. What it does not compute itself it
asks of a ``BlockOps`` object, with explicit arguments: the GEMM inputs (the modulated norm,
GELU, the flattened attention output), the attention (QK-norm, RoPE, the new K/V written
into the cache, attention over it) and the row-parallel reduction. The engine's two variants
(plain XLA, or its Pallas/Triton kernels) are in ``characters_jax.engine.block_ops``;
``FunctionOps`` here takes the attention and the reduction as functions (the training
forward, tests).

The model is written per tensor-parallel shard: the same code runs on the full weights
(tp=1) or, inside `shard_map`, on one device's heads and MLP columns; head counts are read
off the weight shapes. Block weights are stacked over a leading `layers` axis and run under
`jax.lax.scan` (`run_blocks`, `scan_blocks`).

Weight storage: every projection is (N, K), output features first ("K-major"); in `fp8` mode
block projections hold float8_e4m3fn values and a float32 per-tensor scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from characters_jax.config import ModelConfig
from characters_jax.parallel.fp8_linear import Fp8Weight, linear
from pallas_kernels.numerics import FP8, mlp_hidden, modulated_norm, rms_norm

TIME_FREQ_DIM = 256


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def qk_norm(qkv: jax.Array, t: int, q_gain: jax.Array, k_gain: jax.Array, eps: float):
    """The new tokens' Q, K, V from the qkv projection: qkv [Ty >= T, H * 3 * D] (per head
    q, k, v of D each; rows past t are padding), gains [D] float32 -> (q, k, v), each
    [T, H, D] in qkv's dtype; q and k RMS-normed and scaled by their gains."""
    qkv = qkv[:t].reshape(t, -1, 3, q_gain.shape[-1])
    q = rms_norm(qkv[:, :, 0], eps) * q_gain.astype(qkv.dtype)
    k = rms_norm(qkv[:, :, 1], eps) * k_gain.astype(qkv.dtype)
    return q, k, qkv[:, :, 2]


class BlockOps:
    """What a ``Block`` asks for, for T new tokens on one shard of H_l heads (T' >= T rows:
    an op may hand the next one zero padding rows, which the next one ignores):

      block_input(x [T, d], shift [d], scale [d], eps) -> qkv's and up's input: the
        modulated RMSNorm [T, d] in x.dtype, or its FP8 rows (``Fp8Activation`` [T', d]);
      attend(qkv [T', H_l * 3 * D], t, q_gain [D], k_gain [D], eps, cache, layer, frame)
        -> (o [T', H_l, D], cache'): QK-norm and RoPE of the new tokens, their K/V written
        into ``cache`` and their attention over it (``frame``: the pass's context);
      mlp_hidden(y [T', F_l], t) -> down's input: GELU of y's first t rows [T, F_l], or FP8;
      attention_out(o [T', H_l, D] x.dtype, t) -> out's input: o's first t rows as
        [T, H_l * D], or FP8;
      reduce([(x_i, w_i), ...]) -> sum_i x_i @ w_i.T [T'', d] over the 'tp' axis (one
        all-reduce).

    This base class holds the model's own math for the three GEMM inputs (XLA's fusions);
    ``attend`` and ``reduce`` are the subclass's."""

    def block_input(self, x, shift, scale, eps):
        return modulated_norm(x, shift, scale, eps)

    def attend(self, qkv, t, q_gain, k_gain, eps, cache, layer, frame):
        raise NotImplementedError

    def mlp_hidden(self, y, t):
        return mlp_hidden(y[:t])

    def attention_out(self, o, t):
        return o[:t].reshape(t, -1)

    def reduce(self, pairs):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FunctionOps(BlockOps):
    """The model's math with the attention and the reduction given as functions (one
    device: the training forward, tests).

    attention(q, k, v) -> (o [T, H, D], cache'): q, k [T, H, D] after QK-norm (not
    rotated), v [T, H, D]; ``Block`` returns its cache' (e.g. the rotated K/V). The block's
    ``cache``, ``layer`` and ``frame`` arguments are not read.
    reduction([(x_i, w_i), ...]) -> sum_i x_i @ w_i.T."""

    attention: Callable
    reduction: Callable

    def attend(self, qkv, t, q_gain, k_gain, eps, cache, layer, frame):
        return self.attention(*qk_norm(qkv, t, q_gain, k_gain, eps))

    def reduce(self, pairs):
        return self.reduction(pairs)


def timestep_features(sigma: jax.Array, dim: int = TIME_FREQ_DIM) -> jax.Array:
    """Sinusoidal features of a noise level sigma in [0, 1]: [] -> [dim] float32."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    t = sigma.astype(jnp.float32) * 1000.0
    return jnp.concatenate([jnp.cos(t * freqs), jnp.sin(t * freqs)])


class Linear(nnx.Module):
    """y = x @ w.T with w stored [out, in] (K-major). fp8: e4m3 values + per-tensor scale."""

    def __init__(self, in_features: int, out_features: int, axes: tuple, *, dtype: str, std: float, rngs: nnx.Rngs):
        key = rngs.params()
        shape = (out_features, in_features)
        if dtype == "fp8":
            # Unit-normal values fit e4m3 (max 448) with room; the scale carries the std.
            self.w = nnx.Param(jax.random.normal(key, shape, jnp.bfloat16).astype(FP8), logical_axes=axes)
            self.w_scale = nnx.Param(jnp.asarray(std, jnp.float32), logical_axes=())
        else:
            self.w = nnx.Param((std * jax.random.normal(key, shape, jnp.float32)).astype(_dtype(dtype)), logical_axes=axes)
            self.w_scale = None

    def weight(self, layer: jax.Array | None = None):
        """The weight as `linear` takes it: an Fp8Weight or a plain [N, K] array.

        When this Linear holds the whole layer stack ([L, N, K], see `scan_blocks(...,
        in_place=True)`), `layer` selects the block: FP8 weights are then read in place by
        the stacked GEMM, float weights are sliced.
        """
        w = self.w[...]
        if w.ndim == 3:
            if self.w_scale is None:
                return jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
            return Fp8Weight(values=w, scale=self.w_scale[...], layer=layer)
        if self.w_scale is None:
            return w
        return Fp8Weight(values=w, scale=self.w_scale[...])

    def __call__(self, x, out_dtype=None, layer: jax.Array | None = None,
                 act_scale: str = "tensor") -> jax.Array:
        """x [..., K] float, or an Fp8Activation (then out_dtype is required)."""
        return linear(x, self.weight(layer), out_dtype=out_dtype or x.dtype, act_scale=act_scale)


class Block(nnx.Module):
    """One parallel block. Weights (global shapes): qkv [H*3*D, d], out [d, H*D], up [F, d], down [d, F]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hd, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        wd = cfg.weight_dtype
        depth_scale = 1.0 / math.sqrt(2 * cfg.num_blocks)
        self.eps = cfg.norm_eps
        self.act_scale = cfg.activation_scale  # how qkv's and up's input is quantized (FP8)
        self.qkv = Linear(d, h * 3 * hd, ("heads", "embed"), dtype=wd, std=d**-0.5, rngs=rngs)
        self.out = Linear(h * hd, d, ("embed", "heads"), dtype=wd, std=(h * hd) ** -0.5 * depth_scale, rngs=rngs)
        self.up = Linear(d, f, ("mlp", "embed"), dtype=wd, std=d**-0.5, rngs=rngs)
        self.down = Linear(f, d, ("embed", "mlp"), dtype=wd, std=f**-0.5 * depth_scale, rngs=rngs)
        self.q_norm = nnx.Param(jnp.ones((hd,), jnp.float32), logical_axes=("head_dim",))
        self.k_norm = nnx.Param(jnp.ones((hd,), jnp.float32), logical_axes=("head_dim",))
        # adaLN-single: a learned per-block offset to the shared modulation (shift, scale, gate).
        # Gates start near one (not adaLN-zero): random weights then exercise every path.
        offset = 0.1 * jax.random.normal(rngs.params(), (3, d), jnp.float32)
        self.modulation = nnx.Param(offset.at[2].add(1.0), logical_axes=(None, "embed"))

    def __call__(self, x: jax.Array, shared_mod: jax.Array, ops: BlockOps, cache=None, frame=None,
                 layer: jax.Array | None = None):
        """The block on T new tokens: x [T, d] (replicated over 'tp'); shared_mod [3, d]
        float32, the pass's adaLN-single modulation (shift, scale, gate); ops: the
        ``BlockOps`` that run its norms, attention and reduction; cache: what ``ops.attend``
        writes the new K/V into and attends over (the engine: the whole ``KVCache``
        [L, S, H_l, D], written at ``layer``); frame: the pass's context for ``ops.attend``
        (the engine: ``engine.block_ops.FrameContext``); layer: [] int32, the block's index
        in the layer stacks (the cache's, and the projections' when they hold the whole
        stack). Returns (x' [T, d] x.dtype, cache')."""
        t = x.shape[0]
        mod = shared_mod + self.modulation[...]  # [3, d] float32: shift, scale, gate
        h = ops.block_input(x, mod[0], mod[1], self.eps)  # the modulated RMSNorm: qkv's and up's input
        proj = dict(out_dtype=x.dtype, layer=layer, act_scale=self.act_scale)
        with jax.named_scope("qkv_proj"):
            qkv = self.qkv(h, **proj)  # [T' >= T, H_l * 3 * D]
        # QK-norm and RoPE, the new K/V into the cache, attention over it: o [T' >= T, H_l, D]
        o, cache = ops.attend(qkv, t, self.q_norm[...], self.k_norm[...], self.eps, cache, layer, frame)
        with jax.named_scope("mlp_up"):
            hidden = ops.mlp_hidden(self.up(h, **proj), t)  # GELU: down's input
        o = ops.attention_out(o.astype(x.dtype), t)  # [T, H_l * D]: out's input
        # Attention-out and MLP-down summed under one all-reduce ([:t]: FP8 inputs with padding
        # rows give a padded sum), then the gated residual.
        y = ops.reduce([(o, self.out.weight(layer)), (hidden, self.down.weight(layer))])[:t]
        return (x.astype(jnp.float32) + mod[2] * y.astype(jnp.float32)).astype(x.dtype), cache


class DiT(nnx.Module):
    """Embeddings, the stacked blocks and the output head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        small = cfg.dtype  # embeddings and heads stay in the activation dtype
        self.cfg = cfg
        self.patch_embed = Linear(cfg.latent_channels, d, ("embed", None), dtype=small, std=cfg.latent_channels**-0.5, rngs=rngs)
        self.audio_embed = Linear(cfg.audio_feature_dim, d, ("embed", None), dtype=small, std=cfg.audio_feature_dim**-0.5, rngs=rngs)
        self.prompt_embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.prompt_vocab, d), jnp.float32).astype(_dtype(small)), logical_axes=("vocab", "embed"))
        self.time_in = Linear(TIME_FREQ_DIM, d, ("embed", None), dtype=small, std=TIME_FREQ_DIM**-0.5, rngs=rngs)
        self.time_out = Linear(d, d, ("embed", None), dtype=small, std=d**-0.5, rngs=rngs)
        self.adaln = Linear(d, 3 * d, (None, "embed"), dtype=small, std=0.02 * d**-0.5, rngs=rngs)
        self.final_mod = Linear(d, 2 * d, (None, "embed"), dtype=small, std=0.02 * d**-0.5, rngs=rngs)
        self.proj_out = Linear(d, cfg.latent_channels, (None, "embed"), dtype=small, std=d**-0.5, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(r):
            return Block(cfg, rngs=r)

        self.blocks = make_blocks(rngs)

    @property
    def act_dtype(self):
        return _dtype(self.cfg.dtype)

    def time_embedding(self, sigma: jax.Array) -> jax.Array:
        """sigma [] -> temb [d] float32."""
        feats = timestep_features(sigma).astype(self.act_dtype)
        return self.time_out(jax.nn.silu(self.time_in(feats))).astype(jnp.float32)

    def shared_modulation(self, temb: jax.Array) -> jax.Array:
        """adaLN-single: one projection for all blocks. temb [d] -> [3, d] float32."""
        return self.adaln(jax.nn.silu(temb).astype(self.act_dtype)[None])[0].astype(jnp.float32).reshape(3, -1)

    def embed_frame(self, latent: jax.Array, audio: jax.Array) -> jax.Array:
        """latent [T_img, C] + audio [A_tok, F_a] -> tokens [T_img + A_tok, d]."""
        lat = self.patch_embed(latent.astype(self.act_dtype))
        aud = self.audio_embed(audio.astype(self.act_dtype))
        return jnp.concatenate([lat, aud], axis=0)

    def embed_sink(self, image_latent: jax.Array, prompt_tokens: jax.Array) -> jax.Array:
        """image_latent [T_img, C] + prompt ids [B] int32 -> tokens [T_img + B, d]."""
        img = self.patch_embed(image_latent.astype(self.act_dtype))
        txt = jnp.take(self.prompt_embed[...], prompt_tokens, axis=0).astype(self.act_dtype)
        return jnp.concatenate([img, txt], axis=0)

    def head(self, x: jax.Array, temb: jax.Array) -> jax.Array:
        """Velocity for the image tokens: x [T_img, d], temb [d] -> [T_img, C] float32."""
        mod = self.final_mod(jax.nn.silu(temb).astype(self.act_dtype)[None])[0].astype(jnp.float32).reshape(2, -1)
        h = modulated_norm(x, mod[0], mod[1], self.cfg.norm_eps).astype(self.act_dtype)
        return self.proj_out(h).astype(jnp.float32)


PROJECTIONS = ("qkv", "out", "up", "down")


def _is_projection_weight(path, _value) -> bool:
    return len(path) >= 2 and path[-2] in PROJECTIONS and path[-1] in ("w", "w_scale")


def scan_blocks(blocks: Block, x: jax.Array, shared_mod: jax.Array, carry, block_fn, in_place: bool = False):
    """Runs the stacked blocks under lax.scan: block_fn(block, layer, x, shared_mod, carry)
    -> (x, carry) for layer = 0 .. L-1 (``layer`` [] int32); returns (x, carry).

    in_place: the four projection weights are not scanned over (the scan would slice, and
    XLA copy, each block's weights out of the stack); they enter every iteration whole
    and the block reads its own through `layer` (FP8: `pallas_kernels.fp8_gemm_stacked`).
    """
    if in_place:
        graphdef, invariant, state = nnx.split(blocks, _is_projection_weight, ...)
    else:
        graphdef, state = nnx.split(blocks)
        invariant = None
    num_blocks = jax.tree.leaves(state)[0].shape[0]

    def body(c, xs):
        x, carry = c
        layer, block_state = xs
        block = nnx.merge(graphdef, invariant, block_state) if in_place else nnx.merge(graphdef, block_state)
        x, carry = block_fn(block, layer, x, shared_mod, carry)
        return (x, carry), None

    (x, carry), _ = jax.lax.scan(body, (x, carry), (jnp.arange(num_blocks, dtype=jnp.int32), state))
    return x, carry


def run_blocks(blocks: Block, x: jax.Array, shared_mod: jax.Array, ops: BlockOps, cache, frame,
               in_place: bool = False):
    """Every block in order, ``Block.__call__(x, shared_mod, ops, cache, frame, layer)``, under
    lax.scan (``scan_blocks``, with its ``in_place``): x [T, d] -> (x' [T, d], cache')."""

    def block_fn(block, layer, x, shared_mod, cache):
        return block(x, shared_mod, ops, cache, frame, layer)

    return scan_blocks(blocks, x, shared_mod, cache, block_fn, in_place)
