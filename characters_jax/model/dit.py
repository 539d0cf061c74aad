"""The video DiT in Flax NNX: parallel blocks, QK-norm, 3-D RoPE, adaLN-single.

One step feeds T = grid_h * grid_w latent tokens plus the audio tokens of that step. Each
block reads one modulated RMSNorm of its input; attention and the MLP run side by side and
their row-parallel outputs are summed before ONE all-reduce (`reduce`). Conditioning rides in
the sequence: audio tokens with the frame, the reference image and prompt in the cached sink.

The model is written per tensor-parallel shard: the same code runs on the full weights
(tp=1) or, inside `shard_map`, on one device's heads and MLP columns; head counts are read
off the weight shapes. Block weights are stacked over a leading `layers` axis and run under
`jax.lax.scan` by the engine (`scan_blocks`).

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

# attend(q, k, v) -> (o, aux): q, k, v [T, H_local, D]; o [To >= T, H_local, D] (rows past T,
# if any, are a kernel's padding, not read). The engine's closure
# writes k/v into the cache and attends over it; aux carries the updated cache.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]
# attend_qkv(qkv, t, q_gain, k_gain, eps) -> (o, aux): the same from the qkv projection's output
# qkv [Ty >= T, H_local * 3 * D] (rows past t padding), with the QK-norm gains [D] float32 and
# eps: the engine's fused path (pallas_kernels.fp8_qkv_prepare) does the norms itself.
AttendQkvFn = Callable[[jax.Array, int, jax.Array, jax.Array, float], tuple[jax.Array, object]]
# reduce([(x_shard, w_shard), ...]) -> all-reduced sum of x_i @ w_i.T over the 'tp' axis.
ReduceFn = Callable[[list], jax.Array]


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _hidden_of_up(y: jax.Array, t: int) -> jax.Array:
    return mlp_hidden(y[:t])


def _attention_out(o: jax.Array, t: int) -> jax.Array:
    return o[:t].reshape(t, -1)


@dataclasses.dataclass(frozen=True)
class BlockActivations:
    """How a block makes the activations its GEMMs read. Each returns the float array of
    the model's math (the defaults) or, for FP8 weights, that array already quantized as an
    ``Fp8Activation`` whose values may carry zero padding rows past T (the engine's fused
    kernels, ``pallas_kernels.fp8_row_quantize``).

      block_input(x [T, d], shift [d], scale [d], eps) -> h, qkv's and up's input
        (``modulated_norm``);
      mlp_hidden(y [Ty >= T, F], t) -> down's input from up's output, whose rows past t are
        padding (``mlp_hidden`` of y[:t]);
      attention_out(o [To >= T, H_local, D], t) -> out's input [T, H_local * D] from the
        attention output, whose rows past t are padding (o[:t], flattened).
    """

    block_input: Callable = modulated_norm
    mlp_hidden: Callable = _hidden_of_up
    attention_out: Callable = _attention_out


DEFAULT_ACTIVATIONS = BlockActivations()


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
        self.head_dim = hd
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

    def __call__(self, x: jax.Array, shared_mod: jax.Array, attend: AttendFn, reduce: ReduceFn,
                 layer: jax.Array | None = None,
                 activations: BlockActivations = DEFAULT_ACTIVATIONS,
                 attend_qkv: AttendQkvFn | None = None):
        """x: [T, d] (replicated); shared_mod: [3, d] float32; layer: [] int32, used when the
        projections hold the whole layer stack; activations: how the GEMMs' inputs are made
        (``BlockActivations``); attend_qkv: given, it takes the qkv projection's output as
        it is, QK-norm included (``AttendQkvFn``), in place of the norms here and
        ``attend``. Returns (x', aux from attend)."""
        t = x.shape[0]
        acts = activations
        mod = shared_mod + self.modulation[...]
        h = acts.block_input(x, mod[0], mod[1], self.eps)
        proj = dict(out_dtype=x.dtype, layer=layer, act_scale=self.act_scale)
        with jax.named_scope("qkv_proj"):
            qkv = self.qkv(h, **proj)  # [Ty >= T, H_local * 3 * D]
        if attend_qkv is not None:
            o, aux = attend_qkv(qkv, t, self.q_norm[...], self.k_norm[...], self.eps)
        else:
            qkv = qkv[:t].reshape(t, -1, 3, self.head_dim)  # [T, H_local, 3, D]
            q = rms_norm(qkv[:, :, 0], self.eps) * self.q_norm[...].astype(x.dtype)
            k = rms_norm(qkv[:, :, 1], self.eps) * self.k_norm[...].astype(x.dtype)
            o, aux = attend(q, k, qkv[:, :, 2])
        with jax.named_scope("mlp_up"):
            hidden = acts.mlp_hidden(self.up(h, **proj), t)
        o = acts.attention_out(o.astype(x.dtype), t)
        # [:t]: activations with padding rows give a padded sum.
        y = reduce([(o, self.out.weight(layer)), (hidden, self.down.weight(layer))])[:t]
        return (x.astype(jnp.float32) + mod[2] * y.astype(jnp.float32)).astype(x.dtype), aux


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
    """Runs the stacked blocks under lax.scan.

    block_fn(block, layer, x, shared_mod, carry) -> (x, carry) is the engine's per-block body
    (it builds the attend closure over `carry`, e.g. the KV cache, for that layer).

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
