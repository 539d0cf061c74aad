"""The self-rollout stage: the DiT learns from the context it generates itself.

Teacher-forced training (`dit_train`) shows every frame the ground truth, noised to the
last pass's sigma, as its context; the engine feeds the model its own frames. Here, for
each clip of a batch, `rollout` first generates the clip step by step as the engine does
(the step's noise, `cfg.sampler`'s passes with their Euler updates, the sink at sigma 0,
the ring of the last `ring_frames - 1` frames' last-pass K/V, the engine's positions and
resets), with the current weights and no gradient. Then every step s of the clip is
trained once, through one pass of the sampler chosen at random (the Self-Forcing idea:
gradient through a single denoising pass, the self-generated context held fixed):

    context  the rollout's last-pass inputs of the steps before s (stop_gradient);
    input    `current = "noised"` (the default): the ground truth noised to that pass's
             sigma, x_i = (1 - sigma_i) x0 + sigma_i eps, target eps - x0, as the
             teacher-forced stage draws it; `current = "rollout"`: the rollout's own input
             of that pass at step s (pure noise for the first), target the velocity that
             takes it to the ground truth in one Euler step, (x_i - x0) / sigma_i (eps - x0
             again for a ground-truth-noised x_i).

The default keeps every target well posed: the rollout's own x_i has already chosen a head
pose and blinks that the ground truth need not share, and (x_i - x0) / sigma_i asks the last
pass (sigma 0.25) to jump 4x that distance to the truth's (from the shipped weights its
squared error starts at 1.66, against 0.19 for the teacher-forced target: BUILD_NOTES,
Fidelity), which pulls towards the mean of the motions, a blur.

The velocities come from `dit_forward.clip_velocity` (all steps of a clip at once), the loss
is the teacher-forced stage's token-weighted squared error. The stage starts from a
teacher-forced DiT (`train all`: the DiT stage's EMA weights) or from a weights directory
(`finetune`), and checkpoints and resumes like the other stages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from characters_jax.config import Config
from characters_jax.engine.state import frame_positions, sink_positions
from characters_jax.model.dit import DiT, FunctionOps, scan_blocks
from characters_jax.model.rope import rope_angles, rope_frequencies, rotate
from characters_jax.train.dit_forward import _attention, _reduce, clip_velocity, frame_times
from characters_jax.train.latents import DitData
from characters_jax.train.loop import LoopSettings, run_stage
from characters_jax.train.optim import OptimSettings, TrainState, apply_gradients, init_state, make_optimizer
from characters_jax.train.state_io import StageStore


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """batch: clips per step; rollout_steps: steps of each clip generated and trained (from
    the clip's start; at most its length: 48 covers the position reset at step 43)."""

    batch: int = 16
    rollout_steps: int = 48
    current: str = "noised"  # the trained frame's input: "noised" ground truth or the "rollout"'s own
    optim: OptimSettings = OptimSettings(lr=1e-4, warmup_steps=50, ema_decay=0.999, b2=0.99)
    loop: LoopSettings = LoopSettings(max_steps=100000, log_every=50)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rollout:
    """inputs [L, N, T_img, C]: the input of pass i at step s (N passes; inputs[:, -1] is
    each step's context from then on); latents [L, T_img, C]: each step's output."""

    inputs: jax.Array
    latents: jax.Array


def rollout(model: DiT, cfg: Config, sink_latent, prompt, prompt_len, audio, noise) -> Rollout:
    """One clip generated as the engine generates it (float32 K/V, the reference attention).

    sink_latent [T_img, C]; prompt [P] int32 (padded); prompt_len [] int32; audio [L, A, F];
    noise [L, T_img, C]: each step's starting point at sigma = sampler.sigmas[0]."""
    v, m, c = cfg.video, cfg.model, cfg.cache
    gh, gw, t_img, a_tok = v.grid_h, v.grid_w, v.tokens_per_frame, m.audio_tokens_per_step
    steps, r = audio.shape[0], c.ring_frames
    t = t_img + a_tok
    sigmas = cfg.sampler.sigmas
    freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)
    p = prompt.shape[0]
    rope_sink = rope_angles(sink_positions(gh, gw, p), freqs)
    sink_valid = jnp.concatenate([jnp.ones((t_img,), bool), jnp.arange(p) < prompt_len])
    nb, heads, hd = m.num_blocks, m.num_heads, m.head_dim
    empty = jnp.zeros((0, heads, hd), jnp.float32)

    def sink_block(block, layer, x, mod, carry):
        ks, vs = carry

        def attend(q, k, v_):
            kr, qr = rotate(k, rope_sink), rotate(q, rope_sink)
            return _attention(qr, qr, kr, v_, sink_valid, empty, empty, jnp.zeros((0,), bool)), (kr, v_)

        x, (kr, vv) = block(x, mod, FunctionOps(attend, _reduce))
        return x, (ks.at[layer].set(kr.astype(ks.dtype)), vs.at[layer].set(vv.astype(vs.dtype)))

    s_len = t_img + p
    zeros_sink = jnp.zeros((nb, s_len, heads, hd), jnp.float32)
    mod_sink = model.shared_modulation(model.time_embedding(jnp.float32(0.0)))
    _, (k_sink, v_sink) = scan_blocks(model.blocks, model.embed_sink(sink_latent, prompt), mod_sink,
                                      (zeros_sink, zeros_sink), sink_block)

    def one_step(ring, xs):
        ring_k, ring_v = ring  # [nb, r - 1, T, H, D]: frames s - r + 1 .. s - 1, oldest first
        aud, x, t_wrapped, t_unwrapped, s = xs
        rope_w = rope_angles(frame_positions(t_wrapped, gh, gw, a_tok), freqs)
        rope_u = rope_angles(frame_positions(t_unwrapped, gh, gw, a_tok), freqs)
        ok = jnp.concatenate([jnp.repeat(s - (r - 1) + jnp.arange(r - 1) >= 0, t), jnp.ones((t,), bool)])

        def frame_block(block, layer, h, mod, carry):
            nk, nv = carry

            def attend(q, k, v_):
                ku, qu, qw = rotate(k, rope_u), rotate(q, rope_u), rotate(q, rope_w)
                kk = jnp.concatenate([ring_k[layer].reshape(-1, heads, hd), ku.astype(jnp.float32)])
                vv = jnp.concatenate([ring_v[layer].reshape(-1, heads, hd), v_.astype(jnp.float32)])
                return _attention(qw, qu, k_sink[layer], v_sink[layer], sink_valid, kk, vv, ok), (ku, v_)

            h, (ku, vv) = block(h, mod, FunctionOps(attend, _reduce))
            return h, (nk.at[layer].set(ku.astype(nk.dtype)), nv.at[layer].set(vv.astype(nv.dtype)))

        inputs = []
        zeros_frame = jnp.zeros((nb, t, heads, hd), jnp.float32)
        for i in range(cfg.sampler.num_passes):
            inputs.append(x)
            temb = model.time_embedding(jnp.float32(sigmas[i]))
            h, (nk, nv) = scan_blocks(model.blocks, model.embed_frame(x, aud), model.shared_modulation(temb),
                                      (zeros_frame, zeros_frame), frame_block)
            x = x + (sigmas[i + 1] - sigmas[i]) * model.head(h[:t_img], temb)
        ring = (jnp.concatenate([ring_k[:, 1:], nk[:, None]], 1), jnp.concatenate([ring_v[:, 1:], nv[:, None]], 1))
        return ring, (jnp.stack(inputs), x)

    ring0 = jnp.zeros((nb, r - 1, t, heads, hd), jnp.float32)
    xs = (audio, noise.astype(jnp.float32), jnp.asarray(frame_times(steps, r, c.reset_period)),
          jnp.arange(1, steps + 1, dtype=jnp.int32), jnp.arange(steps, dtype=jnp.int32))
    _, (inputs, latents) = jax.lax.scan(one_step, (ring0, ring0), xs)
    return Rollout(inputs=inputs, latents=latents)


def rollout_batch(graphdef, cfg: Config, params, data: DitData, idx, noise) -> Rollout:
    """Rollouts of clips idx [B] over their first noise.shape[1] steps (noise [B, L, T_img, C]),
    without gradient."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(params))
    steps = noise.shape[1]
    out = jax.vmap(lambda ref, pr, pl, au, nz: rollout(model, cfg, ref, pr, pl, au, nz))(
        data.ref[idx], data.prompt[idx], data.prompt_len[idx], data.audio[idx, :steps], noise)
    return jax.tree.map(jax.lax.stop_gradient, out)


CURRENT = ("noised", "rollout")


def rollout_loss(graphdef, cfg: Config, params, data: DitData, idx, roll: Rollout, key, current: str = "noised"):
    """(loss, metrics) of clips idx [B] given their rollouts (module docstring)."""
    if current not in CURRENT:
        raise ValueError(f"rollout.current must be one of {', '.join(CURRENT)}, got {current!r}")
    model = nnx.merge(graphdef, params)
    b, steps, passes = roll.inputs.shape[:3]
    x0 = data.latents[idx, :steps]
    sigmas = jnp.asarray(cfg.sampler.sigmas[:-1], jnp.float32)
    k_pass, k_eps = jax.random.split(key)
    which = jax.random.randint(k_pass, (b, steps), 0, passes)
    sig = sigmas[which]
    if current == "rollout":
        cur = jnp.take_along_axis(roll.inputs, which[:, :, None, None, None], axis=2)[:, :, 0]
        target = (cur - x0) / sig[..., None, None]
    else:
        eps = jax.random.normal(k_eps, x0.shape)
        cur = (1.0 - sig)[..., None, None] * x0 + sig[..., None, None] * eps
        target = eps - x0

    def one(ref, prompt, plen, ctx, audio, x, s):
        return clip_velocity(model, cfg, ref, prompt, plen, ctx, audio, x, s)

    vel = jax.vmap(one)(data.ref[idx], data.prompt[idx], data.prompt_len[idx], roll.inputs[:, :, -1],
                        data.audio[idx, :steps], cur, sig)
    err = jnp.mean((vel - target) ** 2, axis=-1)  # [B, L, T_img]
    w = data.token_weight
    loss = jnp.sum(err * w) / (b * steps * jnp.sum(w))
    metrics = {"loss": loss, "mse": jnp.mean(err),
               "rollout_rms": jnp.sqrt(jnp.mean((roll.latents - x0) ** 2))}  # the generated frames' distance to the truth
    for i, s in enumerate(cfg.sampler.sigmas[:-1]):
        hit = (which == i).astype(jnp.float32)[..., None]
        metrics[f"mse@{s:g}"] = jnp.sum(err * hit) / jnp.maximum(jnp.sum(hit) * err.shape[-1], 1.0)
    return loss, metrics


def rollout_steps(s: RolloutSettings, data: DitData) -> int:
    """The steps of each clip the stage generates: rollout_steps, at most the clips' length."""
    return min(s.rollout_steps, int(data.latents.shape[1]))


def make_step(graphdef, cfg: Config, s: RolloutSettings, tx, steps: int):
    shape = (s.batch, steps, cfg.video.tokens_per_frame, cfg.model.latent_channels)

    def step(state: TrainState, batch, lr):
        data, key = batch
        k_idx, k_noise, k_pass = jax.random.split(key, 3)
        idx = jax.random.randint(k_idx, (s.batch,), 0, data.latents.shape[0])
        roll = rollout_batch(graphdef, cfg, state.params, data, idx, jax.random.normal(k_noise, shape))
        (_, metrics), grads = jax.value_and_grad(
            lambda p: rollout_loss(graphdef, cfg, p, data, idx, roll, k_pass, s.current), has_aux=True)(state.params)
        state, gnorm = apply_gradients(state, grads, lr, tx, s.optim.ema_decay)
        return state, {**metrics, "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,))


def train_rollout(cfg: Config, s: RolloutSettings, data: DitData, store: StageStore, budget_s: float, log,
                  init_params, seed: int = 0):
    """Trains (or resumes) the self-rollout stage for up to budget_s seconds, starting from
    init_params (the DiT's pure dict of parameters) unless the store has a checkpoint.
    Returns (graphdef, ema params, record)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DiT(cfg.model, rngs=nnx.Rngs(0))))
    tx = make_optimizer(s.optim)
    state = init_state(jax.tree.map(lambda x: jnp.array(x, jnp.float32), init_params), tx)  # a copy: the step donates it
    steps = rollout_steps(s, data)
    record = {"stage": "rollout", "clips": len(data), "rollout_steps": steps}
    resumed = store.restore_latest(state)
    if resumed is not None:
        state, record = resumed
        log(f"rollout: resuming at step {int(state.step)}")
    key = jax.random.key(seed + 3)
    state, record = run_stage("rollout", state, make_step(graphdef, cfg, s, tx, steps),
                              lambda i: (data, jax.random.fold_in(key, i)), store=store, record=record,
                              budget_s=budget_s, loop=s.loop, optim=s.optim, examples_per_step=s.batch * steps, log=log)
    return graphdef, state.ema, record
