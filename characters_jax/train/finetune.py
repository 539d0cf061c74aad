"""Fine-tunes of a trained weights directory (e.g. `checkpoints/talking`), each one stage.

`train rollout` (`finetune`): the self-rollout stage. The directory's DiT is the stage's
start, its VAE encodes the training clips, normalised with its own latent statistics (the
DiT's latent space stays the one it was trained in).

`train decoder` (`finetune_decoder`): the VAE's decoder trained again on longer streams
(`vae.chunks` latent frames from an empty history, e.g. 6) with the encoder held fixed: the
latent space, its statistics and the DiT are kept as they are. A decoder trained on
3-chunk streams only has never seen its temporal state past the stream's start, and drifts
there (the shipped one: BUILD_NOTES, Fidelity).

Output directory as `train all`'s: plans/ (the held-out clips of the evaluation; train clips
for `rollout`), rollout/ or decoder/ (the stage's checkpoints: a rerun resumes), weights/ and
weights.tar (the directory with the fine-tuned part), eval/ and summary.json.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np

from characters_jax.config import Config
from characters_jax.weights.directory import Weights, abstract_tree, check_tree, open_weights, tree_spec
from characters_jax.weights.dit import dit_target
from characters_jax.train.settings import TrainSettings


def load_trained(weights: Weights, cfg: Config):
    """(DiT pure dict, Vae, VAE params {"decoder", "encoder"}) of an opened weights
    directory, in the config's dtypes, on the first device."""
    from characters_jax.train.vae_train import Vae

    target = dit_target(cfg)
    check_tree(f"{weights.path}: dit", weights.manifest["trees"]["dit"], tree_spec(target))
    vae = Vae(cfg)
    return weights.restore("dit", abstract_tree(target)), vae, weights.restore("vae", abstract_tree(vae.initial))


def finetune(cfg: Config, s: TrainSettings, weights_dir, out, deadline_s: float | None = None, log=None,
             export=None) -> dict:
    """Runs or resumes the self-rollout stage from `weights_dir` into `out` within the
    deadline (the rollout gets what the evaluation's share and the packing leave); returns
    the summary (also out/summary.json)."""
    from characters_jax.train.pipeline import (PACK_RESERVE_S, Clock, PlanQueue, pack_and_evaluate, plan_makers,
                                               run_rollout_stage, stage_data, stage_summary, use_compile_cache)
    from characters_jax.train.state_io import StageStore, write_json

    deadline_s = deadline_s or s.budget.deadline_s
    clock = Clock(deadline_s)
    log = log or clock.logger()
    out = pathlib.Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    weights = open_weights(weights_dir, cfg)
    summary: dict = {"config": cfg.name, "deadline_s": deadline_s, "from_weights": str(weights.path), "stages": {}}
    log(f"train rollout: config {cfg.name} from {weights.path}, deadline {deadline_s:.0f} s, backend "
        f"{jax.default_backend()}, into {out}")
    use_compile_cache(out / "xla-cache")
    queue = PlanQueue(plan_makers(cfg, s, out / "plans")).start()
    try:
        dit_params, vae, vae_params = load_trained(weights, cfg)
        store = StageStore(out / "rollout")
        data, stats = stage_data(cfg, s, out, queue, store, vae, vae_params, summary, clock, log, stats=weights.stats)
        t = clock.elapsed
        budget = 0.0 if store.done else max(0.0, clock.left - s.budget.eval * deadline_s - PACK_RESERVE_S)
        dit_params, record = run_rollout_stage(cfg, s, data, store, budget, log, dit_params)
        summary["stages"]["rollout"] = stage_summary(record, clock.elapsed - t)
        del data
        pack_and_evaluate(cfg, s, out, queue, dit_params, vae_params, stats, summary, clock, log, export)
    finally:
        queue.stop()
    summary["seconds"] = round(clock.elapsed, 1)
    write_json(out / "summary.json", summary)
    log(f"train rollout: done in {clock.elapsed:.0f} s")
    return summary


def tune_decoder(cfg: Config, s: TrainSettings, vae, vae_params, store, budget_s: float, log):
    """The decoder trained (or resumed) on `s.vae`'s streams for up to budget_s seconds with
    the encoder of vae_params fixed (no mouth read-out: the encoder does not change). Returns
    (the EMA decoder params, record)."""
    from characters_jax.train.faces import FacePool
    from characters_jax.train.loop import run_stage
    from characters_jax.train.optim import init_state, make_optimizer
    from characters_jax.train.vae_train import make_step

    vs = dataclasses.replace(s.vae, mouth_aux=0.0)
    tx = make_optimizer(vs.optim)
    state = init_state({"decoder": vae_params["decoder"]}, tx)
    record = {"stage": "decoder", "chunks": vs.chunks}
    resumed = store.restore_latest(state)
    if resumed is not None:
        state, record = resumed
        log(f"decoder: resuming at step {int(state.step)}")
    if budget_s > 0:
        pool = FacePool.make(np.random.default_rng([s.seed, 1]), vs.pool_identities, vs.pool_motions, vs.pool_span,
                             cfg.video.fps)
        key, fixed = jax.random.key(s.seed + 4), {"encoder": vae_params["encoder"]}
        state, record = run_stage("decoder", state, make_step(vae, vs, tx),
                                  lambda i: (pool, jax.random.fold_in(key, i), fixed), store=store, record=record,
                                  budget_s=budget_s, loop=vs.loop, optim=vs.optim, examples_per_step=vs.batch, log=log)
    return state.ema["decoder"], record


def finetune_decoder(cfg: Config, s: TrainSettings, weights_dir, out, deadline_s: float | None = None, log=None,
                     export=None) -> dict:
    """Runs or resumes the decoder's fine-tune from `weights_dir` into `out` within the
    deadline (the stage gets what the evaluation's share and the packing leave); returns the
    summary (also out/summary.json)."""
    from characters_jax.train.pipeline import (PACK_RESERVE_S, Clock, PlanQueue, pack_and_evaluate, plan_makers,
                                               stage_summary, use_compile_cache)
    from characters_jax.train.state_io import StageStore, write_json

    deadline_s = deadline_s or s.budget.deadline_s
    clock = Clock(deadline_s)
    log = log or clock.logger()
    out = pathlib.Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    weights = open_weights(weights_dir, cfg)
    summary: dict = {"config": cfg.name, "deadline_s": deadline_s, "from_weights": str(weights.path), "stages": {}}
    log(f"train decoder: config {cfg.name} from {weights.path}, {s.vae.chunks}-chunk streams, deadline "
        f"{deadline_s:.0f} s, backend {jax.default_backend()}, into {out}")
    use_compile_cache(out / "xla-cache")
    makers = plan_makers(cfg, s, out / "plans")
    makers.pop("train")
    queue = PlanQueue(makers).start()
    try:
        dit_params, vae, vae_params = load_trained(weights, cfg)
        store = StageStore(out / "decoder")
        t = clock.elapsed
        budget = 0.0 if store.done else max(0.0, clock.left - s.budget.eval * deadline_s - PACK_RESERVE_S)
        decoder, record = tune_decoder(cfg, s, vae, vae_params, store, budget, log)
        if not store.done:
            store.mark_done({"step": record.get("planned_steps")})
        summary["stages"]["decoder"] = stage_summary(record, clock.elapsed - t)
        pack_and_evaluate(cfg, s, out, queue, dit_params, {**vae_params, "decoder": decoder}, weights.stats, summary,
                          clock, log, export)
    finally:
        queue.stop()
    summary["seconds"] = round(clock.elapsed, 1)
    write_json(out / "summary.json", summary)
    log(f"train decoder: done in {clock.elapsed:.0f} s")
    return summary
