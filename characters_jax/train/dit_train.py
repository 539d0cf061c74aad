"""DiT training with rectified flow, exactly as the engine samples.

For a clip's ground-truth latents x0 [L, T_img, C]: every step s gets a noise level from the
sampler's passes (`cfg.sampler.sigmas[:-1]`, e.g. 1, .75, .5, .25), x_s = (1 - sigma) x0 +
sigma eps, and the target velocity eps - x0 (the engine's Euler update is x += (sigma_{i+1} -
sigma_i) v, which moves x_s to x_{sigma_{i+1}} along that line). The context each step
sees is the earlier steps' ground truth noised to the last pass's sigma (0.25: the K/V the
ring keeps), through `dit_forward.clip_velocity` (the sink at sigma 0, the ring window,
the engine's positions with their resets). Loss: squared error of the velocity, each
latent token weighted by `DitData.token_weight` (the mouth's tokens more).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from characters_jax.config import Config
from characters_jax.model.dit import DiT
from characters_jax.train.dit_forward import CONTEXT_SIGMA, clip_velocity
from characters_jax.train.latents import DitData
from characters_jax.train.loop import LoopSettings, run_stage
from characters_jax.train.optim import OptimSettings, TrainState, apply_gradients, init_state, make_optimizer
from characters_jax.train.state_io import StageStore


@dataclasses.dataclass(frozen=True)
class DitSettings:
    batch: int = 16
    mouth_weight: float = 2.0
    optim: OptimSettings = OptimSettings(lr=5e-4, warmup_steps=200, ema_decay=0.999, b2=0.99)
    loop: LoopSettings = LoopSettings(max_steps=100000, log_every=100)


def init_dit(cfg: Config, seed: int = 0):
    """(graphdef, pure dict of parameters) of a fresh DiT (the engine's structure and init)."""
    graphdef, state = nnx.split(DiT(cfg.model, rngs=nnx.Rngs(params=jax.random.key(seed))))
    return graphdef, nnx.to_pure_dict(state)


def dit_loss(graphdef, cfg: Config, params, data: DitData, idx, key):
    """idx [B] clip indices -> (loss, metrics)."""
    model = nnx.merge(graphdef, params)
    x0 = data.latents[idx]  # [B, L, T_img, C]
    b, steps = x0.shape[:2]
    k_sig, k_cur, k_ctx = jax.random.split(key, 3)
    sigmas = jnp.asarray(cfg.sampler.sigmas[:-1], jnp.float32)
    sig = sigmas[jax.random.randint(k_sig, (b, steps), 0, sigmas.shape[0])]
    eps = jax.random.normal(k_cur, x0.shape)
    x_cur = (1.0 - sig)[..., None, None] * x0 + sig[..., None, None] * eps
    x_ctx = (1.0 - CONTEXT_SIGMA) * x0 + CONTEXT_SIGMA * jax.random.normal(k_ctx, x0.shape)

    def one(ref, prompt, plen, ctx, audio, cur, s):
        return clip_velocity(model, cfg, ref, prompt, plen, ctx, audio, cur, s)

    v = jax.vmap(one)(data.ref[idx], data.prompt[idx], data.prompt_len[idx], x_ctx, data.audio[idx], x_cur, sig)
    err = jnp.mean((v - (eps - x0)) ** 2, axis=-1)  # [B, L, T_img]
    w = data.token_weight
    loss = jnp.sum(err * w) / (b * steps * jnp.sum(w))
    metrics = {"loss": loss, "mse": jnp.mean(err)}
    for i, s in enumerate(cfg.sampler.sigmas[:-1]):
        hit = (sig == s).astype(jnp.float32)[..., None]
        metrics[f"mse@{s:g}"] = jnp.sum(err * hit) / jnp.maximum(jnp.sum(hit) * err.shape[-1], 1.0)
    return loss, metrics


def make_step(graphdef, cfg: Config, s: DitSettings, tx):
    def step(state: TrainState, batch, lr):
        data, key = batch
        k_idx, k_loss = jax.random.split(key)
        idx = jax.random.randint(k_idx, (s.batch,), 0, data.latents.shape[0])
        (_, metrics), grads = jax.value_and_grad(lambda p: dit_loss(graphdef, cfg, p, data, idx, k_loss),
                                                 has_aux=True)(state.params)
        state, gnorm = apply_gradients(state, grads, lr, tx, s.optim.ema_decay)
        return state, {**metrics, "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,))


def train_dit(cfg: Config, s: DitSettings, data: DitData, store: StageStore, budget_s: float, log, seed: int = 0):
    """Trains (or resumes) the DiT for up to budget_s seconds. Returns (graphdef, ema
    params, record)."""
    graphdef, params = init_dit(cfg, seed)
    tx = make_optimizer(s.optim)
    state = init_state(params, tx)
    record = {"stage": "dit", "clips": len(data)}
    resumed = store.restore_latest(state)
    if resumed is not None:
        state, record = resumed
        log(f"dit: resuming at step {int(state.step)}")
    key = jax.random.key(seed + 2)
    steps = int(data.latents.shape[1])
    state, record = run_stage("dit", state, make_step(graphdef, cfg, s, tx), lambda i: (data, jax.random.fold_in(key, i)),
                              store=store, record=record, budget_s=budget_s, loop=s.loop, optim=s.optim,
                              examples_per_step=s.batch * steps, log=log)
    return graphdef, state.ema, record
