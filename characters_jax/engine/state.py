"""The step state: a pytree donated to every step.

`cache` is sharded over heads; everything else is small and replicated. Positions are
(time, height, width) RoPE positions; the sink sits at time 0 and frames start at time 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from characters_jax.cache.kv_cache import CacheLayout, KVCache, cache_partition_spec, empty_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepState:
    """cache: KVCache [L, S, H, D]; valid: [S] bool; slot_positions: [S, 3] int32;
    step: [] int32 (steps this session); frame_time: [] int32 (time position of the next
    frame); rng: [2] uint32 raw key data (the session's noise seed)."""

    cache: KVCache
    valid: jax.Array
    slot_positions: jax.Array
    step: jax.Array
    frame_time: jax.Array
    rng: jax.Array


def empty_state(layout: CacheLayout) -> StepState:
    return StepState(
        cache=empty_cache(layout),
        valid=jnp.zeros((layout.slots,), bool),
        slot_positions=jnp.zeros((layout.slots, 3), jnp.int32),
        step=jnp.int32(0),
        frame_time=jnp.int32(1),
        rng=jnp.zeros((2,), jnp.uint32),
    )


def state_partition_spec(axis: str | None = "tp") -> StepState:
    return StepState(cache=cache_partition_spec(axis), valid=P(), slot_positions=P(), step=P(), frame_time=P(), rng=P())


def frame_positions(frame_time: jax.Array, grid_h: int, grid_w: int, audio_tokens: int) -> jax.Array:
    """RoPE positions of one step's tokens: image (t, h, w) then audio (t, grid_h, j). -> [T, 3] int32."""
    hh, ww = jnp.meshgrid(jnp.arange(grid_h, dtype=jnp.int32), jnp.arange(grid_w, dtype=jnp.int32), indexing="ij")
    img = jnp.stack([jnp.zeros_like(hh).ravel(), hh.ravel(), ww.ravel()], axis=1)
    aud = jnp.stack([jnp.zeros(audio_tokens, jnp.int32), jnp.full(audio_tokens, grid_h, jnp.int32), jnp.arange(audio_tokens, dtype=jnp.int32)], axis=1)
    pos = jnp.concatenate([img, aud], axis=0)
    return pos.at[:, 0].add(frame_time)


def sink_positions(grid_h: int, grid_w: int, prompt_len: int) -> jax.Array:
    """Sink positions: image (0, h, w), then prompt token i at (0, 0, grid_w + i). -> [T, 3] int32."""
    img = frame_positions(jnp.int32(0), grid_h, grid_w, 0)
    txt = jnp.stack([jnp.zeros(prompt_len, jnp.int32), jnp.zeros(prompt_len, jnp.int32), grid_w + jnp.arange(prompt_len, dtype=jnp.int32)], axis=1)
    return jnp.concatenate([img, txt], axis=0)
