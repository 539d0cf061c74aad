"""The loop every training stage runs: a time budget, a step plan, progress lines and
periodic checkpoints.

The step function is jitted with the train state donated; the loop never waits for the
device except at a progress line (every `log_every` steps: the metrics of that step come
back, which also bounds how far the host runs ahead) and at a checkpoint. The number of
steps is planned from the speed measured over the first steps after compilation, so that
the stage ends inside its budget (`max_steps` caps it), and planned once more at the first
progress line past a quarter of the budget (the speed of the steady state), while less
than half the plan has run; the learning-rate schedule follows the plan. A resumed stage
keeps its plan and its history.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from characters_jax.train.optim import OptimSettings, learning_rate
from characters_jax.train.state_io import StageStore


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    max_steps: int
    log_every: int = 50
    save_every_s: float = 60.0
    plan_after: int = 10  # steps timed (after the first, compiled one) to plan the rest


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def run_stage(name: str, state, step_fn: Callable, next_batch: Callable, *, store: StageStore, record: dict,
              budget_s: float, loop: LoopSettings, optim: OptimSettings, examples_per_step: int,
              log: Callable[[str], None]):
    """Runs `step_fn(state, batch, lr) -> (state, metrics)` from the state's step on until
    the plan, max_steps or budget_s (seconds of this call) is reached; checkpoints to
    `store`. Returns (state, record); record gains 'history' rows [step, seconds, metrics...],
    'planned_steps', 'seconds' (all runs), 'examples_per_s'."""
    if budget_s <= 0:
        return state, record
    t0 = time.monotonic()
    step = int(jax.device_get(state.step))
    history = record.setdefault("history", [])
    record.setdefault("seconds", 0.0)
    planned = record.get("planned_steps")
    last_save = t0
    timing_from = None  # (step, time) after the first compiled step
    rate = record.get("steps_per_s")
    seconds_before = record["seconds"]
    replanned = planned is not None

    def save():
        record["seconds"] = seconds_before + time.monotonic() - t0
        store.save(step, state, record)

    while step < min(loop.max_steps, planned or loop.max_steps):
        now = time.monotonic()
        if now - t0 >= budget_s:
            log(f"{name}: time budget of {budget_s:.0f} s reached at step {step}")
            break
        lr = learning_rate(step, planned or loop.max_steps, optim)
        state, metrics = step_fn(state, next_batch(step), np.float32(lr))
        step += 1
        measuring = timing_from is not None and planned is None and step == timing_from[0] + loop.plan_after
        if timing_from is None or measuring or step % loop.log_every == 0 or step == loop.max_steps:
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.monotonic()
            if timing_from is None:
                timing_from = (step, now)
                log(f"{name}: first step (compiled) after {now - t0:.1f} s, {_fmt(values)}")
            elif measuring:
                rate = loop.plan_after / (now - timing_from[1])
                left = budget_s - (now - t0)
                planned = int(min(loop.max_steps, step + max(0.0, left) * rate * 0.97))
                record["planned_steps"], record["steps_per_s"] = planned, rate
                record["examples_per_s"] = rate * examples_per_step
                log(f"{name}: {rate:.2f} steps/s ({rate * examples_per_step:.0f} examples/s): {planned} steps planned")
            else:
                if not replanned and planned is not None and now - t0 >= 0.25 * budget_s and step < 0.5 * planned:
                    replanned = True
                    rate = (step - timing_from[0]) / (now - timing_from[1])
                    planned = int(min(loop.max_steps, step + max(0.0, budget_s - (now - t0)) * rate * 0.97))
                    record["planned_steps"], record["steps_per_s"] = planned, rate
                    record["examples_per_s"] = rate * examples_per_step
                    log(f"{name}: {rate:.2f} steps/s steady: {planned} steps planned")
                elapsed = seconds_before + now - t0
                history.append([step, round(elapsed, 2)] + [round(v, 6) for v in values.values()])
                record["history_columns"] = ["step", "seconds"] + list(values)
                log(f"{name} {step}/{planned or loop.max_steps} {_fmt(values)} lr {lr:.2e} {elapsed:.0f} s")
            if now - last_save >= loop.save_every_s:
                save()
                last_save = time.monotonic()
    save()
    return state, record
