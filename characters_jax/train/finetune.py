"""`train rollout`: the self-rollout stage on a trained weights directory (a fine-tune).

From a weights directory (e.g. `checkpoints/talking`): its DiT is the stage's start, its
VAE encodes the training clips, normalised with its own latent statistics (the DiT's latent
space stays the one it was trained in). Output directory as `train all`'s: plans/, rollout/
(the stage's checkpoints: a rerun resumes), weights/ and weights.tar (the fine-tuned DiT
with the directory's VAE and statistics), eval/ and summary.json.
"""

from __future__ import annotations

import pathlib

import jax

from characters_jax.config import Config
from characters_jax.decoder.weights import Weights, abstract_tree, check_tree, dit_target, open_weights, tree_spec
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
