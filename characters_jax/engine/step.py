"""The compiled programs of one worker: parameter init, session prefill and the step.

Everything runs under one `jax.shard_map` over the ('tp',) mesh: embeddings and heads are
replicated (small), the blocks are Megatron-sharded and end in one all-reduce each, the KV
cache is sharded over heads. Each program is `jax.jit` with explicit in/out shardings and
the state donated, compiled once per config and mesh (prefill once per prompt bucket).

A step: reset the positions if due (ring: one delta rotation of the cached keys), mark the
current frame's slots valid, draw noise, then `num_passes` flow-matching Euler passes; every
pass runs the blocks under `lax.scan` and each block writes its new K/V into the current
frame's slots before attending over sink + ring. The last pass's K/V stay as that frame's
context. Nothing syncs the host.

The blocks run ``model.dit.Block`` with the engine's ``BlockOps`` (``engine.block_ops``:
the reference or the kernels variant, as the [engine] table resolved), one for the prefill
and one for the step, and a ``FrameContext`` made once per program (the new tokens' RoPE
angles, their cache offset, the slot mask).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import CacheConfig, Config
from characters_jax.engine.block_ops import block_ops, frame_context
from characters_jax.engine.options import resolve_engine
from characters_jax.engine.state import StepState, empty_state, frame_positions, sink_positions, state_partition_spec
from characters_jax.model.dit import DiT, run_blocks
from characters_jax.model.params import abstract_model, init_state, param_partition_specs
from characters_jax.model.rope import rope_frequencies
from characters_jax.parallel.sharding import TP, ShardingRules, named_shardings


class Engine:
    """Compiled programs for one config on one mesh, as its [engine] table resolves here
    (``options``: ``engine.options.ResolvedEngine``). Holds no session state."""

    def __init__(self, cfg: Config, mesh, rules: ShardingRules = ShardingRules(),
                 noise_transform=None):
        """noise_transform: None, or f(noise [T_img, C] float32, step [] int32) -> noise, applied
        to every step's noise before the passes (e.g. a run-to-run perturbation)."""
        cfg.validate_tp(mesh.size)
        self.cfg, self.mesh = cfg, mesh
        self.options = resolve_engine(cfg)
        self.noise_transform = noise_transform
        self.layout = kvc.CacheLayout.from_config(cfg)
        m = cfg.model
        self.freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)
        # What the blocks run (engine.block_ops): the prefill's set the FP8 cache scales.
        self.prefill_ops = block_ops(cfg, self.options, self.layout, self.freqs, prefill=True)
        self.step_ops = block_ops(cfg, self.options, self.layout, self.freqs, prefill=False)
        self.graphdef, self.abstract_params = abstract_model(m)
        self.param_specs = param_partition_specs(self.abstract_params, rules)
        self.param_shardings = named_shardings(mesh, self.param_specs)
        self.state_specs = state_partition_spec(TP)
        self.state_shardings = named_shardings(mesh, self.state_specs)
        self.replicated = NamedSharding(mesh, P())

        self.init_params = jax.jit(self._init_params, out_shardings=self.param_shardings)
        self.init_state = jax.jit(lambda: empty_state(self.layout), out_shardings=self.state_shardings)
        params_and_state = (self.param_shardings, self.state_shardings)
        self.prefill = jax.jit(
            self.sharded_program(self._prefill_local, (P(),) * 4, out_specs=self.state_specs),
            in_shardings=params_and_state + (self.replicated,) * 4,
            out_shardings=self.state_shardings,
            donate_argnames=("state",),
        )
        self.step = jax.jit(
            self.sharded_program(self._step_local, (P(),), out_specs=(self.state_specs, P())),
            in_shardings=params_and_state + (self.replicated,),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnames=("state",),
        )

    # ---- construction -------------------------------------------------------------
    def _init_params(self, key):
        return init_state(self.cfg.model, key)

    def sharded_program(self, fn, extra_in_specs: tuple, out_specs):
        """shard_map(fn) over (params, state, *extra args) on this engine's mesh, with the
        params' and state's specs (the extra args' given), keeping the argument names."""
        in_specs = (self.param_specs, self.state_specs) + tuple(extra_in_specs)
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

        def program(params, state, *args):
            return mapped(params, state, *args)

        return program

    # ---- the model over one pass ------------------------------------------------------------
    def _forward(self, model: DiT, ops, frame, tokens, sigma, cache):
        """One pass of the blocks over tokens [T, d] at noise level sigma [] float32, each
        block writing its new K/V into the cache (``ops``: this program's BlockOps;
        ``frame``: the pass's FrameContext) -> (velocity [T_img, C] float32, cache')."""
        temb = model.time_embedding(sigma)
        h, cache = run_blocks(model.blocks, tokens, model.shared_modulation(temb), ops, cache, frame,
                              in_place=ops.weights_in_place)
        return model.head(h[: self.cfg.video.tokens_per_frame], temb), cache

    # ---- programs (per shard) --------------------------------------------------------------
    def _prefill_local(self, params, state: StepState, image_latent, prompt_tokens, prompt_len, seed):
        """image_latent [T_img, C] f32; prompt_tokens [B] int32 (B = a bucket); prompt_len [] int32; seed [] uint32."""
        cfg, layout = self.cfg, self.layout
        model = nnx.merge(self.graphdef, params)
        gh, gw, t_img = cfg.video.grid_h, cfg.video.grid_w, cfg.video.tokens_per_frame
        b = prompt_tokens.shape[0]
        tokens = model.embed_sink(image_latent, prompt_tokens)
        pos = sink_positions(gh, gw, b)
        token_valid = jnp.concatenate([jnp.ones((t_img,), bool), jnp.arange(b) < prompt_len])
        valid = jnp.zeros((layout.slots,), bool).at[: t_img + b].set(token_valid)
        slot_positions = jnp.zeros((layout.slots, 3), jnp.int32).at[: t_img + b].set(pos)
        frame = frame_context(pos, jnp.int32(0), valid, slot_positions, self.freqs, token_valid)
        _, cache = self._forward(model, self.prefill_ops, frame, tokens, jnp.float32(0.0), state.cache)
        key = jax.random.key_data(jax.random.key(seed))
        return StepState(cache=cache, valid=valid, slot_positions=slot_positions, step=jnp.int32(0), frame_time=jnp.int32(1), rng=key)

    def reset_positions(self, state: StepState) -> StepState:
        """Every reset_period steps: move every ring position back by reset_period (ring: rotate keys once)."""
        layout, period = self.layout, self.cfg.cache.reset_period
        due = state.frame_time >= layout.ring_frames + period
        delta = jnp.array([-period, 0, 0], jnp.int32)
        k = jax.lax.cond(due, lambda k: kvc.rotate_ring(layout, dataclasses.replace(state.cache, k=k), delta, self.freqs).k, lambda k: k, state.cache.k)
        in_ring = (jnp.arange(layout.slots) >= layout.sink_slots)[:, None] & (jnp.arange(3) == 0)[None, :]
        shift = jnp.where(due, -period, 0)
        return dataclasses.replace(
            state,
            cache=dataclasses.replace(state.cache, k=k),
            slot_positions=state.slot_positions + jnp.where(in_ring, shift, 0),
            frame_time=state.frame_time + shift,
        )

    def begin_frame(self, state: StepState):
        """Positions of the new tokens, their first slot, and the updated valid/positions."""
        cfg, layout = self.cfg, self.layout
        pos = frame_positions(state.frame_time, cfg.video.grid_h, cfg.video.grid_w, cfg.model.audio_tokens_per_step)
        offset = layout.frame_offset(state.step)
        valid = jax.lax.dynamic_update_slice(state.valid, jnp.ones((layout.tokens_per_step,), bool), (offset,))
        slot_positions = jax.lax.dynamic_update_slice(state.slot_positions, pos, (offset, jnp.int32(0)))
        return pos, offset, valid, slot_positions

    def end_frame(self, state: StepState, cache, valid, slot_positions) -> StepState:
        layout = self.layout
        return StepState(
            cache=kvc.shift_window(layout, cache),
            valid=kvc.shift_slots(layout, valid),
            slot_positions=kvc.shift_slots(layout, slot_positions),
            step=state.step + 1,
            frame_time=state.frame_time + 1,
            rng=state.rng,
        )

    def _step_local(self, params, state: StepState, audio):
        """audio [A_tok, F_a] f32 -> (state', latent [grid_h, grid_w, C] f32)."""
        cfg = self.cfg
        model = nnx.merge(self.graphdef, params)
        with jax.named_scope("cache_upkeep"):
            state = self.reset_positions(state)
        pos, offset, valid, slot_positions = self.begin_frame(state)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        x = jax.random.normal(key, (cfg.video.tokens_per_frame, cfg.model.latent_channels), jnp.float32)
        if self.noise_transform is not None:
            x = self.noise_transform(x, state.step)
        frame = frame_context(pos, offset, valid, slot_positions, self.freqs)
        cache = state.cache
        sigmas = cfg.sampler.sigmas
        for i in range(cfg.sampler.num_passes):
            tokens = model.embed_frame(x, audio)
            velocity, cache = self._forward(model, self.step_ops, frame, tokens, jnp.float32(sigmas[i]), cache)
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity
        with jax.named_scope("cache_upkeep"):
            new_state = self.end_frame(state, cache, valid, slot_positions)
        return new_state, x.reshape(cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)

    # ---- abstract arguments (ahead-of-time compilation; nothing allocated) -------------------
    def key_shape(self) -> jax.ShapeDtypeStruct:
        """The init program's argument: one PRNG key."""
        return jax.eval_shape(lambda: jax.random.key(0))

    def param_shapes(self):
        """The parameters as init_params returns them: ShapeDtypeStructs with their shardings."""
        return jax.eval_shape(self.init_params, self.key_shape())

    def state_shapes(self):
        """The step state as init_state returns it: ShapeDtypeStructs with their shardings."""
        return jax.eval_shape(self.init_state)

    def step_input_shapes(self) -> tuple[jax.ShapeDtypeStruct]:
        """The step's arguments after (params, state): audio [A_tok, F_a] float32, replicated."""
        m = self.cfg.model
        return (jax.ShapeDtypeStruct((m.audio_tokens_per_step, m.audio_feature_dim), jnp.float32, sharding=self.replicated),)

    def prefill_input_shapes(self, bucket: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The prefill's arguments after (params, state) for prompts padded to `bucket`:
        image latent [T_img, C] float32, prompt [bucket] int32, length [] int32, seed [] uint32."""
        v, m, r = self.cfg.video, self.cfg.model, self.replicated
        return (jax.ShapeDtypeStruct((v.tokens_per_frame, m.latent_channels), jnp.float32, sharding=r),
                jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=r),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=r),
                jax.ShapeDtypeStruct((), jnp.uint32, sharding=r))

    # ---- host-side methods (no device sync) ----------------------------------------------------
    def prompt_bucket(self, n: int) -> int:
        return prompt_bucket(self.cfg.cache, n)

    def pad_prompt(self, tokens) -> tuple[np.ndarray, int]:
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.model.prompt_vocab):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.model.prompt_vocab})")
        b = self.prompt_bucket(tokens.size)
        return np.pad(tokens, (0, b - tokens.size)), int(tokens.size)


def prompt_bucket(cache: CacheConfig, n: int) -> int:
    """The padded length of an n-token prompt: the smallest of ``cache.prompt_buckets``
    that holds it (ValueError past ``cache.max_prompt_tokens``)."""
    for b in cache.prompt_buckets:
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens exceeds cache.max_prompt_tokens={cache.max_prompt_tokens}")
