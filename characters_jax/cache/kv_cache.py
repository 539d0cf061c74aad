"""The KV cache: sink slots (reference image + prompt) followed by a ring of frames.

Layout for every block, stacked over blocks: K and V `[L, S, H, D]` (FP8 e4m3 held as its
uint8 bit pattern, see `CacheLayout.storage_dtype`), per-head dequantization
scales `[L, H]` float32, sharded over heads. S = sink_slots + ring_frames * T, where
T = tokens_per_step (one latent frame plus its audio tokens).

Two modes behind one interface (`write`, `attention_operands`, `rotate_ring`, `shift_window`):

- `ring`: keys are stored already rotated (RoPE at the write), quantized once with a scale
  computed on the device; the current frame's slot is `sink + (step % ring_frames) * T`: the
  ring advances by its write index, nothing is copied. A position reset rotates the ring's
  keys by a delta once.
- `launch` (the baseline): keys are stored unrotated (bf16, or float32 for a float32 cache);
  every attention call re-applies RoPE to the whole cache at the slots' positions, re-quantizes
  all of it (FP8) and the window is shifted by copying at the end of each step (the current
  frame always sits in the last T slots).

FP8 scales in `ring` mode: K follows QK-RMSNorm, so |k_i| <= sqrt(D) * max|gain| exactly and
rotation keeps pair norms: that bound is the K scale (never clips). V has no such bound: its
scale is the sink's per-head amax times `V_HEADROOM`, later writes saturate at +-448.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from characters_jax.config import Config
from characters_jax.model.rope import apply_rope, rope_angles, rotate
from pallas_kernels.numerics import FP8, FP8_MAX
from pallas_kernels.numerics import quantize_per_head as quantize

V_HEADROOM = 4.0
_MIN_SCALE = 1e-12


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """k, v: [L, S, H, D] (float8_e4m3fn held as uint8 | bfloat16 | float32); k_scale,
    v_scale: [L, H] float32."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static description of the cache (hashable; closed over by the jitted step)."""

    mode: str  # ring | launch
    dtype: str  # fp8 | bf16 | float32
    num_blocks: int
    num_heads: int
    head_dim: int
    sink_slots: int
    tokens_per_step: int
    ring_frames: int

    @classmethod
    def from_config(cls, cfg: Config) -> "CacheLayout":
        return cls(
            mode=cfg.cache.mode,
            dtype=cfg.cache.dtype,
            num_blocks=cfg.model.num_blocks,
            num_heads=cfg.model.num_heads,
            head_dim=cfg.model.head_dim,
            sink_slots=cfg.sink_slots,
            tokens_per_step=cfg.tokens_per_step,
            ring_frames=cfg.cache.ring_frames,
        )

    @property
    def slots(self) -> int:
        return self.sink_slots + self.ring_frames * self.tokens_per_step

    @property
    def storage_dtype(self):
        """FP8 values are stored as their uint8 bit patterns (`to_storage`): the same bytes,
        but XLA:CPU updates a uint8 slice in place where it rewrites a whole float8 array."""
        if self.mode == "launch":
            return jnp.float32 if self.dtype == "float32" else jnp.bfloat16
        return {"fp8": jnp.uint8, "bf16": jnp.bfloat16, "float32": jnp.float32}[self.dtype]

    def to_storage(self, x: jax.Array) -> jax.Array:
        """Values (float8 when quantized) -> stored dtype."""
        if self.storage_dtype == jnp.uint8:
            return jax.lax.bitcast_convert_type(x.astype(FP8), jnp.uint8)
        return x.astype(self.storage_dtype)

    def from_storage(self, x: jax.Array) -> jax.Array:
        """Stored dtype -> values (float8_e4m3fn when quantized). A bitcast: free on GPU."""
        if x.dtype == jnp.uint8:
            return jax.lax.bitcast_convert_type(x, FP8)
        return x

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8"

    def frame_offset(self, step: jax.Array) -> jax.Array:
        """First slot of the current frame: the ring's write index, or the window's end."""
        if self.mode == "launch":
            return jnp.int32(self.slots - self.tokens_per_step)
        return self.sink_slots + (step % self.ring_frames) * self.tokens_per_step

    def shape(self) -> tuple[int, int, int, int]:
        """K's and V's shape [L, S, H, D]."""
        return (self.num_blocks, self.slots, self.num_heads, self.head_dim)

    def bytes(self) -> int:
        return 2 * math.prod(self.shape()) * jnp.dtype(self.storage_dtype).itemsize


def empty_cache(layout: CacheLayout) -> KVCache:
    """A zeroed cache with unit scales (global shapes; place it with jit out_shardings)."""
    k = jnp.zeros(layout.shape(), layout.storage_dtype)
    ones = jnp.ones((layout.num_blocks, layout.num_heads), jnp.float32)
    return KVCache(k=k, v=jnp.zeros(layout.shape(), layout.storage_dtype), k_scale=ones,
                   v_scale=ones)


def dequantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x: [..., S, H, D] float8; scale: [..., H] -> float32."""
    return x.astype(jnp.float32) * scale[..., None, :, None]


def amax_scale(x: jax.Array, valid: jax.Array | None = None, headroom: float = 1.0) -> jax.Array:
    """Per-head FP8 scale from the data. x: [S, H, D]; valid: [S] bool or None -> [H] float32."""
    a = jnp.abs(x.astype(jnp.float32))
    if valid is not None:
        a = jnp.where(valid[:, None, None], a, 0.0)
    return jnp.maximum(a.max(axis=(0, 2)) * headroom / FP8_MAX, _MIN_SCALE)


def key_bound_scale(k_norm_gain: jax.Array, num_heads: int) -> jax.Array:
    """FP8 K scale from the QK-norm bound |k_i| <= sqrt(D) max|gain|. gain: [D] -> [H] float32."""
    bound = jnp.sqrt(jnp.float32(k_norm_gain.shape[-1])) * jnp.max(jnp.abs(k_norm_gain.astype(jnp.float32)))
    return jnp.full((num_heads,), jnp.maximum(bound / FP8_MAX, _MIN_SCALE), jnp.float32)


def set_scales(layout: CacheLayout, cache: KVCache, layer: jax.Array, k_norm_gain: jax.Array, v_sink: jax.Array, valid: jax.Array) -> KVCache:
    """At prefill (ring + FP8 only): fixes the per-head scales of one block for the session.

    v_sink: [T, H, D] the sink's values; valid: [T] bool.
    """
    if layout.mode != "ring" or not layout.quantized:
        return cache
    heads = v_sink.shape[1]
    k_scale = key_bound_scale(k_norm_gain, heads)
    v_scale = amax_scale(v_sink, valid, V_HEADROOM)
    return dataclasses.replace(
        cache,
        k_scale=jax.lax.dynamic_update_index_in_dim(cache.k_scale, k_scale, layer, 0),
        v_scale=jax.lax.dynamic_update_index_in_dim(cache.v_scale, v_scale, layer, 0),
    )


def write(layout: CacheLayout, cache: KVCache, layer: jax.Array, offset: jax.Array, k_new: jax.Array, v_new: jax.Array, rope) -> KVCache:
    """Writes T new tokens of one block into slots [offset, offset + T) in place.

    k_new, v_new: [T, H, D] (k after QK-norm, not yet rotated); rope: (cos, sin) [T, D/2] of
    the new tokens' positions (`rope_angles`, computed once for all blocks).
    ring: K rotated here, then both quantized (FP8) or cast. launch: stored unrotated.
    """
    if layout.mode == "ring":
        k_new = rotate(k_new, rope)
    if layout.quantized and layout.mode == "ring":
        k_new = quantize(k_new, cache.k_scale[layer])
        v_new = quantize(v_new, cache.v_scale[layer])
    k_new = layout.to_storage(k_new)[None]
    v_new = layout.to_storage(v_new)
    zero = jnp.int32(0)
    start = (layer, offset, zero, zero)
    v = jax.lax.dynamic_update_slice(cache.v, v_new[None], start)
    return dataclasses.replace(cache, k=jax.lax.dynamic_update_slice(cache.k, k_new, start), v=v)


def attention_operands(layout: CacheLayout, cache: KVCache, layer: jax.Array, slot_positions: jax.Array, valid: jax.Array, freqs, *, whole_stack: bool = False):
    """What one attention call reads for block `layer`.

    Returns (k, v, k_scale, v_scale): k, v [S, H, D] as stored (ring) or re-rotated and
    re-quantized from the whole cache (launch); scales [H] float32 (ones when not FP8).
    slot_positions: [S, 3] int32 (used by launch only); valid: [S] bool.
    whole_stack (ring mode only): k, v are the whole stacks [L, S, H, D] in the compute
    dtype (a bitcast of the storage, no copy), for an attention that reads layer `layer`
    in place; without it XLA copies the layer's K and V out of the stack.
    """
    if layout.mode == "ring":
        if whole_stack:
            k, v = layout.from_storage(cache.k), layout.from_storage(cache.v)
        else:
            k, v = layout.from_storage(cache.k[layer]), layout.from_storage(cache.v[layer])
        return k, v, cache.k_scale[layer], cache.v_scale[layer]
    if whole_stack:
        raise ValueError("whole_stack needs the ring cache (launch re-rotates every key per call)")
    k = layout.from_storage(cache.k[layer])
    v = layout.from_storage(cache.v[layer])
    k = apply_rope(k.astype(jnp.float32), slot_positions, freqs)
    if layout.quantized:
        k_scale = amax_scale(k, valid)
        v_scale = amax_scale(v, valid)
        return quantize(k, k_scale), quantize(v, v_scale), k_scale, v_scale
    ones = jnp.ones((k.shape[1],), jnp.float32)
    return k.astype(layout.storage_dtype), v, ones, ones


def rotate_ring(layout: CacheLayout, cache: KVCache, delta: jax.Array, freqs) -> KVCache:
    """ring mode: rotates every cached ring key by `delta` [3] positions (the reset).

    One block at a time in place (a loop over blocks keeps the float32 temporary to one
    block's ring). The sink keeps its positions. FP8 keys keep their scale: rotation does not
    change pair norms, so the QK-norm bound still holds.
    """
    if layout.mode != "ring":
        return cache
    s = layout.sink_slots
    ring_slots = layout.slots - s
    rope = rope_angles(jnp.broadcast_to(delta.astype(jnp.int32), (ring_slots, 3)), freqs)

    def body(layer, k):
        ring = jax.lax.dynamic_slice_in_dim(k[layer], s, ring_slots, axis=0)  # [R, H, D]
        scale = cache.k_scale[layer]
        x = dequantize(layout.from_storage(ring), scale) if layout.quantized else ring.astype(jnp.float32)
        x = rotate(x, rope)
        x = layout.to_storage(quantize(x, scale) if layout.quantized else x)
        return jax.lax.dynamic_update_slice(k, x[None], (layer, jnp.int32(s), jnp.int32(0), jnp.int32(0)))

    return dataclasses.replace(cache, k=jax.lax.fori_loop(0, layout.num_blocks, body, cache.k))


def shift_window(layout: CacheLayout, cache: KVCache) -> KVCache:
    """launch mode, end of step: copies the ring window one frame towards the sink."""
    if layout.mode != "launch":
        return cache
    s, t = layout.sink_slots, layout.tokens_per_step

    def shift(x):
        return jnp.concatenate([x[:, :s], x[:, s + t :], x[:, -t:]], axis=1)

    return dataclasses.replace(cache, k=shift(cache.k), v=shift(cache.v))


def shift_slots(layout: CacheLayout, x: jax.Array) -> jax.Array:
    """launch mode: the same one-frame shift for a per-slot array x: [S, ...]."""
    if layout.mode != "launch":
        return x
    s, t = layout.sink_slots, layout.tokens_per_step
    return jnp.concatenate([x[:s], x[s + t :], x[-t:]], axis=0)


def cache_partition_spec(axis: str | None = "tp"):
    """PartitionSpecs of a KVCache: heads sharded over `axis`."""
    from jax.sharding import PartitionSpec as P

    kv = P(None, None, axis, None)
    return KVCache(k=kv, v=kv, k_scale=P(None, axis), v_scale=P(None, axis))


__all__ = [
    "CacheLayout",
    "KVCache",
    "FP8",
    "FP8_MAX",
    "amax_scale",
    "attention_operands",
    "cache_partition_spec",
    "dequantize",
    "empty_cache",
    "key_bound_scale",
    "quantize",
    "rotate_ring",
    "set_scales",
    "shift_slots",
    "shift_window",
    "write",
]
