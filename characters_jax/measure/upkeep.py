"""The step's cache operations alone, for measuring their share of the step, and the
step's matmul FLOPs.

``cache_upkeep`` compiles, for an ``Engine``, one program that runs ``steps`` steps of
what the step does to the cache (the same write / re-rotation / re-quantization / shift
code, through the engine's own methods), without the model: timed in the process that
times the step, its share is the cache upkeep's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import Config
from characters_jax.model.rope import rope_angles
from pallas_kernels.fp8_attention import PALLAS_IMPLS


def step_flops(cfg: Config) -> float:
    """Matmul FLOPs of one step: passes x blocks x (GEMMs + attention over all cache slots)."""
    m, t = cfg.model, cfg.tokens_per_step
    gemm = 2 * t * (m.d_model * m.num_heads * m.head_dim * 4 + 2 * m.d_model * m.mlp_dim)
    attn = 4 * t * cfg.cache_slots * m.num_heads * m.head_dim
    return float(cfg.sampler.num_passes * m.num_blocks * (gemm + attn))


def cache_upkeep(engine, steps: int = 1):
    """The jitted program that runs ``steps`` steps' cache operations alone (one call):
    (params, state, new_kv) -> (state, checksum); params are unused (the signature is the
    step's, so that the state's shardings and donation are too)."""
    fn = functools.partial(_upkeep_local, engine, steps=steps)
    return jax.jit(
        engine.sharded_program(fn, (engine.state_specs.cache.k,), out_specs=(engine.state_specs, P())),
        in_shardings=(engine.param_shardings, engine.state_shardings,
                      engine.state_shardings.cache.k),
        out_shardings=(engine.state_shardings, engine.replicated),
        donate_argnames=("state",),
    )


def upkeep_inputs(engine, key=None):
    """Random stand-in K/V [L, T, H, D] bf16 for ``cache_upkeep``, placed like the cache."""
    cfg = engine.cfg
    shape = (cfg.model.num_blocks, cfg.tokens_per_step, cfg.model.num_heads, cfg.model.head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16),
                   out_shardings=engine.state_shardings.cache.k)
    return make(key if key is not None else jax.random.key(1))


def _upkeep_local(engine, params, state, new_kv, *, steps: int):
    """``steps`` steps of the step's cache operations alone: reset, and per pass and block
    the K/V write (RoPE + FP8 at write in ring mode) and what attention reads (launch: RoPE
    + re-quantization of the whole cache), then the window shift. Several steps per call
    amortize the dispatch.

    new_kv: [L, T, H_local, D] stand-in new keys/values (same shapes as the step's).
    """
    layout, freqs = engine.layout, engine.freqs
    del params
    whole = layout.mode == "ring" and engine.options.attention in PALLAS_IMPLS

    def one_step(_, carry):
        state, checksum = carry
        state = engine.reset_positions(state)
        pos, offset, valid, slot_positions = engine.begin_frame(state)
        rope = rope_angles(pos, freqs)

        def body(layer, c):
            cache, checksum = c
            kv = new_kv[layer].astype(jnp.float32)
            cache = kvc.write(layout, cache, layer, offset, kv, kv, rope)
            # As the step: the ring cache's stacks go whole to an attention that reads the
            # layer in place (the Pallas kernel); otherwise the layer's K/V are materialized
            # (a slice for cuDNN/XLA/reference; launch: re-rotated and re-quantized).
            k, v, _, _ = kvc.attention_operands(layout, cache, layer, slot_positions, valid,
                                                freqs, whole_stack=whole)
            # Materialize what attention reads, and consume it so it is not dead code.
            k, v, cache = jax.lax.optimization_barrier((k, v, cache))
            if whole:
                k, v = k[layer], v[layer]
            return cache, checksum + k[-1, 0, 0].astype(jnp.float32) + v[-1, 0, 0].astype(jnp.float32)

        cache = state.cache
        for _ in range(engine.cfg.sampler.num_passes):
            cache, checksum = jax.lax.fori_loop(0, layout.num_blocks, body, (cache, checksum))
        return engine.end_frame(state, cache, valid, slot_positions), checksum

    return jax.lax.fori_loop(0, steps, one_step, (state, jnp.float32(0.0)))
