"""The engine's ``BlockOps``: what a DiT block (``model.dit.Block``) runs for its norms, its
attention over the KV cache and its reduction, and the per-pass context they read.

Two variants, chosen from the engine's resolved options (``block_ops``):

  ``ReferenceOps``  plain jnp/XLA. GEMM inputs: the modulated RMSNorm, GELU and the
      flattened attention output as XLA fuses them (``model.dit.BlockOps``). Attention:
      QK-norm (``model.dit.qk_norm``) and RoPE in XLA, the new K/V written into the cache
      (``cache.kv_cache.write``; at prefill the FP8 scales are fixed first,
      ``kv_cache.set_scales``), the cache's operands (``kv_cache.attention_operands``)
      and ``pallas_kernels.fp8_attention.attention`` with the impl the options resolved.
      Reduction: ``parallel.row_parallel.row_parallel_matmul_reduce`` with the options'
      method (psum, ppermute; 'pallas' | 'auto' the fused FP8 GEMM + all-reduce).
  ``KernelOps``  the same with the custom kernels of ``engine.kernels`` that are on: 'quant'
      makes the three GEMM inputs FP8 rows in one kernel each
      (``pallas_kernels.fp8_row_quantize``: prologues 'norm', 'gelu', 'none'; rows padded
      to the stacked GEMM's multiple of 8, and the attention hands its padded rows on);
      'qkv' at steps does QK-norm, RoPE, Q's e4m3 parts and the cache write in one kernel
      (``pallas_kernels.fp8_qkv_prepare``); 'gemm' keeps the projection weights whole in
      the block scan, read in place by the stacked FP8 GEMM
      (``pallas_kernels.fp8_gemm_stacked`` through ``parallel.fp8_linear``).

A BlockOps is a frozen dataclass, built once per program: ``prefill`` marks the prefill's
(the FP8 cache scales are set from the sink there, and the fused qkv kernel never runs).
What changes from pass to pass is a ``FrameContext`` (a pytree) handed to every block.
Shapes: T new tokens, S cache slots, L blocks, H_l heads of this shard, D head_dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import Config
from characters_jax.engine.options import ResolvedEngine
from characters_jax.model.dit import BlockOps, qk_norm
from characters_jax.model.rope import rope_angles, rotate
from characters_jax.parallel.fp8_linear import Fp8Activation
from characters_jax.parallel.row_parallel import STACKED_ROW_ALIGN, row_parallel_matmul_reduce
from characters_jax.parallel.sharding import TP
from pallas_kernels import fp8_qkv_prepare, fp8_row_quantize
from pallas_kernels.fp8_attention import SlotMask, attention, slot_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrameContext:
    """One pass's new tokens and the cache they attend, the same for every block.

    rope: (cos, sin), each [T, D/2] float32, the rotation of the new tokens' positions;
    offset: [] int32, the cache slot of the first new token; valid: [S] bool, the slots
    attended (the new ones included); slot_positions: [S, 3] int32, every slot's position
    (the launch cache rotates its keys by them at each call); mask: ``valid`` as the
    attention takes it (``fp8_attention.SlotMask``); token_valid: [T] bool at prefill, the
    sink tokens that exist (the prompt's padding is False), None at steps."""

    rope: tuple[jax.Array, jax.Array]
    offset: jax.Array
    valid: jax.Array
    slot_positions: jax.Array
    mask: SlotMask
    token_valid: jax.Array | None = None


def frame_context(positions: jax.Array, offset: jax.Array, valid: jax.Array,
                  slot_positions: jax.Array, freqs: np.ndarray,
                  token_valid: jax.Array | None = None) -> FrameContext:
    """The ``FrameContext`` of new tokens at positions [T, 3] int32 (RoPE angles against
    freqs [3, D/2] and the attention mask made here, once for every block and pass)."""
    return FrameContext(rope=rope_angles(positions, freqs), offset=offset, valid=valid,
                        slot_positions=slot_positions, mask=slot_mask(valid),
                        token_valid=token_valid)


@dataclasses.dataclass(frozen=True)
class ReferenceOps(BlockOps):
    """The plain jnp/XLA variant (module docstring).

    layout: the cache's; freqs: [3, D/2] float32 RoPE frequencies (the launch cache
    re-rotates with them); attention_impl: ``fp8_attention.attention``'s impl;
    reduce_method: ``row_parallel_matmul_reduce``'s method; out_dtype: the reduction's
    output dtype (the model's activation dtype); act_scale: how the reduction quantizes
    float inputs for FP8 weights ('tensor' | 'row'); prefill: the prefill program's ops."""

    layout: kvc.CacheLayout
    freqs: np.ndarray = dataclasses.field(compare=False, repr=False)
    attention_impl: str
    reduce_method: str
    out_dtype: str
    act_scale: str
    prefill: bool

    @property
    def weights_in_place(self) -> bool:
        """Whether the block scan keeps the projection weights whole (``scan_blocks``'
        in_place): the stacked FP8 GEMM's way; here they are sliced per block."""
        return False

    @property
    def attention_rows_padded(self) -> bool:
        """Whether the attention may return its kernel's padding rows past T (its consumer
        reads only the first T)."""
        return False

    def attend(self, qkv, t, q_gain, k_gain, eps, cache: kvc.KVCache, layer, frame: FrameContext):
        """qkv [T' >= T, H_l * 3 * D] -> (o [T', H_l, D], cache'): the new K/V written at
        frame.offset of block ``layer`` (K rotated and both quantized in the ring cache,
        ``kv_cache.write``), then Q, rotated, attends over the cache."""
        q, k, v = qk_norm(qkv, t, q_gain, k_gain, eps)
        with jax.named_scope("cache_upkeep"):
            if self.prefill:
                cache = kvc.set_scales(self.layout, cache, layer, k_gain, v, frame.token_valid)
            cache = kvc.write(self.layout, cache, layer, frame.offset, k, v, frame.rope)
        return self.attend_cache(rotate(q, frame.rope), cache, layer, frame), cache

    def attend_cache(self, q, cache: kvc.KVCache, layer, frame: FrameContext) -> jax.Array:
        """q [T, H_l, D] rotated (or a ``QuantizedQ``) over block ``layer``'s slots of the
        cache -> o [T' >= T, H_l, D] in q's dtype. The ring cache hands the attention its
        whole K/V stacks and the layer (the Pallas kernel reads the layer in place, the
        other impls slice it)."""
        whole_stack = self.layout.mode == "ring"
        with jax.named_scope("cache_upkeep"):
            k, v, k_scale, v_scale = kvc.attention_operands(
                self.layout, cache, layer, frame.slot_positions, frame.valid, self.freqs,
                whole_stack=whole_stack)
        with jax.named_scope("attention"):
            return attention(q, k, v, k_scale, v_scale, frame.mask, impl=self.attention_impl,
                             layer=layer if whole_stack else None,
                             padded_out=self.attention_rows_padded)

    def reduce(self, pairs) -> jax.Array:
        """[(x_i [T', K_i], w_i [d, K_i]), ...] -> sum_i x_i @ w_i.T all-reduced over 'tp'."""
        with jax.named_scope("out_down_reduce"):
            return row_parallel_matmul_reduce(pairs, axis_name=TP, method=self.reduce_method,
                                              out_dtype=jnp.dtype(self.out_dtype),
                                              act_scale=self.act_scale)


@dataclasses.dataclass(frozen=True)
class KernelOps(ReferenceOps):
    """The kernels variant (module docstring): each of ``engine.kernels``' kernels on its
    own flag; where a flag is off, the reference's piece runs.

    gemm: projection weights whole in the scan, the stacked FP8 GEMM; quant: the GEMM
    inputs from the row-quantize kernels (FP8 rows padded to ``STACKED_ROW_ALIGN``, the
    padding zero with scale 0); qkv: the fused qkv kernel at steps."""

    gemm: bool = False
    quant: bool = False
    qkv: bool = False

    @property
    def weights_in_place(self) -> bool:
        return self.gemm

    @property
    def attention_rows_padded(self) -> bool:
        # The attention output's own quantization kernel reads only the real rows (a slice
        # before it would be a copy).
        return self.quant

    def _row_quantized(self, x, rows: int, **prologue) -> Fp8Activation:
        """x [M, K]'s first ``rows`` rows through a prologue and per-row e4m3 quantization:
        an Fp8Activation of [rows rounded up to STACKED_ROW_ALIGN, K]."""
        values, row_scale = fp8_row_quantize.row_quantize(
            x, rows=rows, rows_out=-(-rows // STACKED_ROW_ALIGN) * STACKED_ROW_ALIGN,
            impl="pallas", **prologue)
        return Fp8Activation(values, row_scale)

    def block_input(self, x, shift, scale, eps):
        if not self.quant:
            return super().block_input(x, shift, scale, eps)
        return self._row_quantized(x, x.shape[0], shift=shift, scale=scale, eps=eps, prologue="norm")

    def mlp_hidden(self, y, t):
        if not self.quant:
            return super().mlp_hidden(y, t)
        return self._row_quantized(y, t, prologue="gelu")

    def attention_out(self, o, t):
        if not self.quant:
            return super().attention_out(o, t)
        return self._row_quantized(o.reshape(o.shape[0], -1), t, prologue="none")

    def attend(self, qkv, t, q_gain, k_gain, eps, cache: kvc.KVCache, layer, frame: FrameContext):
        """At steps with 'qkv': one kernel from qkv to Q's e4m3 parts (with the attention's
        scales) and the new K/V rows written into the FP8 ring cache; else the reference."""
        if self.prefill or not self.qkv:
            return super().attend(qkv, t, q_gain, k_gain, eps, cache, layer, frame)
        layout = self.layout
        with jax.named_scope("cache_upkeep"):
            q, k, v = fp8_qkv_prepare.prepare_qkv(
                qkv, q_gain, k_gain, *frame.rope, cache.k_scale, cache.v_scale,
                layout.from_storage(cache.k), layout.from_storage(cache.v), layer, frame.offset,
                t=t, heads=cache.k.shape[2], eps=eps, any_valid=frame.mask.any_valid,
                impl="pallas")
            cache = dataclasses.replace(cache, k=layout.to_storage(k), v=layout.to_storage(v))
        return self.attend_cache(q, cache, layer, frame), cache


def block_ops(cfg: Config, options: ResolvedEngine, layout: kvc.CacheLayout, freqs: np.ndarray,
              *, prefill: bool) -> ReferenceOps:
    """The BlockOps of one program (``prefill``: the prefill's) for ``options``, the
    config's [engine] table as it resolved on this backend (``engine.options``):
    ``ReferenceOps`` when no kernel of ``engine.kernels`` is on, else ``KernelOps``."""
    common = dict(layout=layout, freqs=freqs, attention_impl=options.attention,
                  reduce_method=options.reduce, out_dtype=cfg.model.dtype,
                  act_scale=cfg.model.activation_scale, prefill=prefill)
    if not (options.gemm or options.quant or options.qkv):
        return ReferenceOps(**common)
    return KernelOps(**common, gemm=options.gemm, quant=options.quant, qkv=options.qkv)
