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

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax
import numpy as np

from characters_jax.config import Config
from characters_jax.weights.directory import Weights, abstract_tree, check_tree, open_weights, tree_spec
from characters_jax.weights.dit import dit_target
from characters_jax.train.settings import TrainSettings

if TYPE_CHECKING:
    from characters_jax.train.pipeline import PlanQueue, RunDir


def load_trained(weights: Weights, cfg: Config):
    """(DiT pure dict, Vae, VAE params {"decoder", "encoder"}) of an opened weights
    directory, in the config's dtypes, on the first device."""
    from characters_jax.train.vae_train import Vae

    target = dit_target(cfg)
    check_tree(f"{weights.path}: dit", weights.manifest["trees"]["dit"], tree_spec(target))
    vae = Vae(cfg)
    return weights.restore("dit", abstract_tree(target)), vae, weights.restore("vae", abstract_tree(vae.initial))


@dataclasses.dataclass(frozen=True)
class _Finetune:
    """A fine-tune's run under way: its RunDir, the weights directory it starts from, its
    summary, its plan queue and the directory's trained (DiT params, Vae, VAE params)."""

    run: RunDir
    weights: Weights
    summary: dict
    queue: PlanQueue
    dit_params: object
    vae: object
    vae_params: dict


@contextlib.contextmanager
def _finetune_run(cfg: Config, s: TrainSettings, command: str, detail: str, weights_dir, out, deadline_s, log,
                  train_plans: bool) -> Iterator[_Finetune]:
    """Opens `out` for `train {command}` from `weights_dir` (logged with `detail`), starts the
    plan makers (train plans only if train_plans) and loads the trained weights; stops the
    plan makers on leaving."""
    from characters_jax.train.pipeline import PlanQueue, RunDir, plan_makers, use_compile_cache

    run = RunDir.open(s, out, deadline_s, log)
    weights = open_weights(weights_dir, cfg)
    summary: dict = {"config": cfg.name, "deadline_s": run.deadline_s, "from_weights": str(weights.path),
                     "from_training": weights.manifest.get("training", {}), "stages": {}}
    run.log(f"train {command}: config {cfg.name} from {weights.path}{detail}, deadline {run.deadline_s:.0f} s, backend "
            f"{jax.default_backend()}, into {run.out}")
    use_compile_cache(run.out / "xla-cache")
    makers = plan_makers(cfg, s, run.out / "plans")
    if not train_plans:
        makers.pop("train")
    queue = PlanQueue(makers).start()
    try:
        yield _Finetune(run, weights, summary, queue, *load_trained(weights, cfg))
    finally:
        queue.stop()


def finetune(cfg: Config, s: TrainSettings, weights_dir, out, deadline_s: float | None = None, log=None,
             export=None) -> dict:
    """Runs or resumes the self-rollout stage from `weights_dir` into `out` within the
    deadline (the rollout gets what the evaluation's share and the packing leave); returns
    the summary (also out/summary.json)."""
    from characters_jax.train.pipeline import pack_and_evaluate, run_rollout_stage, stage_data, stage_summary
    from characters_jax.train.state_io import StageStore

    with _finetune_run(cfg, s, "rollout", "", weights_dir, out, deadline_s, log, train_plans=True) as ft:
        run, summary = ft.run, ft.summary
        store = StageStore(run.out / "rollout")
        data, stats = stage_data(cfg, s, run.out, ft.queue, store, ft.vae, ft.vae_params, summary, run.clock, run.log,
                                 stats=ft.weights.stats)
        t = run.clock.elapsed
        dit_params, record = run_rollout_stage(cfg, s, data, store, run.budget_before_eval(s, store), run.log,
                                               ft.dit_params)
        summary["stages"]["rollout"] = stage_summary(record, run.clock.elapsed - t)
        del data
        pack_and_evaluate(cfg, s, run.out, ft.queue, dit_params, ft.vae_params, stats, summary, run.clock, run.log,
                          export)
    return run.finish("rollout", summary)


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
    from characters_jax.train.pipeline import pack_and_evaluate, stage_summary
    from characters_jax.train.state_io import StageStore

    with _finetune_run(cfg, s, "decoder", f", {s.vae.chunks}-chunk streams", weights_dir, out, deadline_s, log,
                       train_plans=False) as ft:
        run, summary = ft.run, ft.summary
        store = StageStore(run.out / "decoder")
        t = run.clock.elapsed
        decoder, record = tune_decoder(cfg, s, ft.vae, ft.vae_params, store, run.budget_before_eval(s, store), run.log)
        if not store.done:
            store.mark_done({"step": record.get("planned_steps")})
        summary["stages"]["decoder"] = stage_summary(record, run.clock.elapsed - t)
        pack_and_evaluate(cfg, s, run.out, ft.queue, ft.dit_params, {**ft.vae_params, "decoder": decoder},
                          ft.weights.stats, summary, run.clock, run.log, export)
    return run.finish("decoder", summary)
