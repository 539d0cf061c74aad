"""The optimizer and the train state shared by the VAE and DiT stages.

AdamW (optax) after global-norm gradient clipping, its learning rate set every step from
the host (`learning_rate`: linear warm-up, then cosine decay to `min_lr_ratio` of the peak
over the stage's planned steps; the plan is known only once the stage has measured its own
speed against its time budget), and an exponential moving average of the weights with a
warm-up of its own (decay min(ema_decay, (1 + n) / (10 + n))).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.99
    ema_decay: float = 0.999


def make_optimizer(s: OptimSettings) -> optax.GradientTransformation:
    def chain(learning_rate):
        return optax.chain(optax.clip_by_global_norm(s.clip_norm),
                           optax.adamw(learning_rate, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay))

    return optax.inject_hyperparams(chain)(learning_rate=0.0)


def learning_rate(step: int, planned_steps: int, s: OptimSettings) -> float:
    """Warm-up then cosine, by the host, for step `step` of `planned_steps`."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    span = max(planned_steps - s.warmup_steps, 1)
    frac = min(max(step - s.warmup_steps, 0) / span, 1.0)
    return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """params, ema: the same tree (float32); opt_state: optax's; step: [] int32."""

    params: object
    opt_state: object
    ema: object
    step: jax.Array


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return TrainState(params=params, opt_state=tx.init(params), ema=jax.tree.map(jnp.copy, params),
                      step=jnp.zeros((), jnp.int32))


def apply_gradients(state: TrainState, grads, lr: jax.Array, tx: optax.GradientTransformation,
                    ema_decay: float) -> tuple[TrainState, jax.Array]:
    """One optimizer step at learning rate lr ([] float32). Returns (state, grad norm)."""
    opt_state = state.opt_state
    opt_state.hyperparams["learning_rate"] = lr
    updates, opt_state = tx.update(grads, opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = state.step.astype(jnp.float32)
    decay = jnp.minimum(ema_decay, (1.0 + n) / (10.0 + n))
    ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema, params)
    return TrainState(params=params, opt_state=opt_state, ema=ema, step=state.step + 1), optax.tree.norm(grads)
