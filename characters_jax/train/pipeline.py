"""`train all`: data, VAE, latents, DiT, self-rollout, weights and evaluation within one deadline.

Output directory (everything a rerun resumes from):
  plans/     clip plans (train, heldout, session shards; made by worker processes from the
             start, beside the VAE, which needs no speech)
  vae/ dit/ rollout/  the stages' checkpoints (`state_io.StageStore`; done.json when
             finished); the self-rollout stage (`self_rollout`) runs when the settings give
             it a share of the deadline, from the DiT stage's weights
  weights/   the result: a weights directory (`characters_jax.weights.directory`), EMA
             weights stored as bfloat16
  weights.tar  the same, as one file to carry
  eval/      eval.json and eval.md (`evaluate`)
  summary.json  stage times, steps, examples/s, loss histories, the evaluation's table
Time: the VAE and the self-rollout stage get their shares of the deadline (`BudgetSettings`),
the DiT what the deadline leaves after them, the evaluation's share and the packing. A
stage that already finished is not run again; one that was cut off resumes from its last
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import tarfile
import time
import traceback
from collections.abc import Callable

import jax
import numpy as np

from characters_jax.config import Config
from characters_jax.data.clips import ClipSpec
from characters_jax.weights.directory import LatentStats, open_weights, save_weights
from characters_jax.train.evaluate import evaluate, markdown
from characters_jax.train.latents import build_dit_data
from characters_jax.data.plans import PlanMaker, load_plans
from characters_jax.train.settings import TrainSettings
from characters_jax.train.state_io import StageStore, write_json

PACK_RESERVE_S = 20.0
EVAL_MARGIN_S = 10.0  # the evaluation stops starting clips this long before the deadline


class Clock:
    """Seconds since this run started, and the log line prefix."""

    def __init__(self, deadline_s: float):
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def left(self) -> float:
        return self.deadline_s - self.elapsed

    def logger(self, stream=None):
        def log(msg: str) -> None:
            print(f"[{self.elapsed:6.1f}s] {msg}", file=stream, flush=True)

        return log


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run of a `train` stage command: its output directory (made), its deadline
    (seconds; default the settings' budget.deadline_s), its Clock and its log (default the
    clock's logger)."""

    out: pathlib.Path
    deadline_s: float
    clock: Clock
    log: Callable[[str], None]

    @classmethod
    def open(cls, s: TrainSettings, out, deadline_s: float | None, log) -> RunDir:
        deadline_s = deadline_s or s.budget.deadline_s
        clock = Clock(deadline_s)
        out = pathlib.Path(out).resolve()
        out.mkdir(parents=True, exist_ok=True)
        return cls(out, deadline_s, clock, log or clock.logger())

    def budget_before_eval(self, s: TrainSettings, store: StageStore, reserve_s: float = 0.0) -> float:
        """Seconds for a stage: what the deadline leaves after `reserve_s`, the evaluation's
        share and the packing (0 once `store` is done)."""
        if store.done:
            return 0.0
        return max(0.0, self.clock.left - reserve_s - s.budget.eval * self.deadline_s - PACK_RESERVE_S)

    def finish(self, command: str, summary: dict, export=None) -> dict:
        """Writes the summary with the run's seconds (also to `export`), logs the end of
        `train {command}` and returns the summary."""
        summary["seconds"] = round(self.clock.elapsed, 1)
        write_json(self.out / "summary.json", summary)
        _export(export, self.out / "summary.json")
        self.log(f"train {command}: done in {self.clock.elapsed:.0f} s")
        return summary


def plan_makers(cfg: Config, s: TrainSettings, plans_dir: pathlib.Path) -> dict[str, PlanMaker]:
    d, v = s.data, cfg.video
    spec = lambda seconds: ClipSpec(seconds=seconds, height=v.height, width=v.width, fps=v.fps,  # noqa: E731
                                    chunk_frames=v.frames_per_step)
    workers = d.workers or None
    makers = {
        "heldout": PlanMaker(plans_dir, "heldout", d.heldout_clips, spec(d.heldout_seconds), s.seed, workers, d.shard_size),
        "train": PlanMaker(plans_dir, "train", d.train_clips, spec(d.clip_seconds), s.seed, workers, d.shard_size),
    }
    if d.session_seconds > 0:
        # the drift sessions: held-out clips past the evaluation's indices
        makers["session"] = PlanMaker(plans_dir / "session", "heldout", d.sessions, spec(d.session_seconds), s.seed, workers, 1,
                                      first=d.heldout_clips)
    return makers


class PlanQueue:
    """Runs the plan makers one after another in the background (held-out first)."""

    def __init__(self, makers: dict[str, PlanMaker]):
        self.makers = makers
        order = [k for k in ("heldout", "session", "train") if k in makers]
        import threading

        self._thread = threading.Thread(target=self._run, args=(order,), daemon=True, name="plan-queue")
        self.error: BaseException | None = None

    def _run(self, order):
        for k in order:
            m = self.makers[k]
            m.start()
            m.wait()

    def start(self) -> "PlanQueue":
        self._thread.start()
        return self

    def stop(self) -> None:
        for m in self.makers.values():
            m.stop()

    def wait_for(self, name: str, clips: int, done: bool = False, poll_s: float = 0.5) -> None:
        m = self.makers[name]
        while not (m.done() if done else m.available() >= min(clips, m.count)):
            if m.error is not None:
                raise m.error
            if not self._thread.is_alive() and not m.done():
                raise RuntimeError(f"plan making stopped before the {name} plans were made")
            time.sleep(poll_s)


def pure(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def train_all(cfg: Config, s: TrainSettings, out, deadline_s: float | None = None, log=None, export=None) -> dict:
    """Runs or resumes every stage into `out`; returns the summary (also summary.json).
    export: a directory that gets weights.tar, eval.json, eval.md and summary.json copied
    as soon as each exists (what a machine with a hard time limit hands back)."""
    from characters_jax.train.dit_train import train_dit
    from characters_jax.train.vae_train import train_vae

    run = RunDir.open(s, out, deadline_s, log)
    out, deadline_s, clock, log = run.out, run.deadline_s, run.clock, run.log
    b = s.budget
    summary: dict = {"config": cfg.name, "deadline_s": deadline_s, "stages": {}}
    log(f"train all: config {cfg.name}, deadline {deadline_s:.0f} s, backend {jax.default_backend()}, into {out}")

    use_compile_cache(out / "xla-cache")
    queue = PlanQueue(plan_makers(cfg, s, out / "plans")).start()
    try:
        # VAE
        t = clock.elapsed
        store = StageStore(out / "vae")
        vae_budget = 0.0 if store.done else b.vae * deadline_s
        vae, vae_params, vae_record = train_vae(cfg, s.vae, store, vae_budget, log, s.seed)
        if not store.done:
            store.mark_done({"step": vae_record.get("planned_steps")})
        summary["stages"]["vae"] = stage_summary(vae_record, clock.elapsed - t)

        # latents
        dit_store = StageStore(out / "dit")
        data, stats = stage_data(cfg, s, out, queue, dit_store, vae, vae_params, summary, clock, log)

        # DiT
        t = clock.elapsed
        # the DiT takes what the deadline leaves after the self-rollout's and the evaluation's
        # shares and the packing
        rollout_store = StageStore(out / "rollout") if b.rollout > 0 else None
        dit_budget = run.budget_before_eval(s, dit_store, reserve_s=b.rollout * deadline_s)
        graphdef, dit_params, dit_record = train_dit(cfg, s.dit, data, dit_store, dit_budget, log, s.seed)
        if not dit_store.done:
            dit_store.mark_done({"step": dit_record.get("planned_steps")})
        summary["stages"]["dit"] = stage_summary(dit_record, clock.elapsed - t)

        # self-rollout, from the DiT stage's weights
        if rollout_store is not None:
            t = clock.elapsed
            budget = run.budget_before_eval(s, rollout_store)
            dit_params, rollout_record = run_rollout_stage(cfg, s, data, rollout_store, budget, log, dit_params)
            summary["stages"]["rollout"] = stage_summary(rollout_record, clock.elapsed - t)
        del data
        pack_and_evaluate(cfg, s, out, queue, dit_params, vae_params, stats, summary, clock, log, export)
    finally:
        queue.stop()
    return run.finish("all", summary, export)


def stage_data(cfg: Config, s: TrainSettings, out: pathlib.Path, queue: PlanQueue, store: StageStore, vae, vae_params,
               summary: dict, clock: Clock, log, stats: LatentStats | None = None):
    """The DiT stages' training set from the train plans (as many as the resumed checkpoint of
    `store` used, else those planned once min_train_clips are), encoded by the VAE and
    normalised with `stats` (measured here if None). Returns (DitData, stats); records the
    'latents' stage in summary."""
    t = clock.elapsed
    resumed = store.steps()
    clips = None
    if resumed:
        clips = json.loads((store.dir / f"step-{resumed[-1]:07d}.json").read_text()).get("clips")
    queue.wait_for("train", clips or s.data.min_train_clips)
    if clips is None and not queue.makers["train"].done():
        log(f"latents: {queue.makers['train'].available()} of {s.data.train_clips} train clips planned; using those")
    queue.makers["train"].stop()
    plans = load_plans(out / "plans", "train", limit=clips)
    data, stats = build_dit_data(cfg, vae, vae_params, plans, stats=stats, mouth_weight=s.dit.mouth_weight)
    jax.block_until_ready(data)
    summary["stages"]["latents"] = {"seconds": round(clock.elapsed - t, 1), "clips": len(plans),
                                    "steps_per_clip": int(data.latents.shape[1])}
    log(f"latents: {len(plans)} clips x {data.latents.shape[1]} steps in {clock.elapsed - t:.1f} s")
    return data, stats


def pack_and_evaluate(cfg: Config, s: TrainSettings, out: pathlib.Path, queue: PlanQueue, dit_params, vae_params,
                      stats: LatentStats, summary: dict, clock: Clock, log, export=None) -> None:
    """Writes the weights (and weights.tar), then evaluates them on the held-out plans in
    the time left; an evaluation that fails still leaves the weights and the summary."""
    t = clock.elapsed
    weights_dir = pack(cfg, out, dit_params, vae_params, stats, summary)
    summary["stages"]["pack"] = {"seconds": round(clock.elapsed - t, 1)}
    log(f"weights: {weights_dir} ({_size_mb(weights_dir):.1f} MB), {out / 'weights.tar'}")
    write_json(out / "summary.json", summary)
    _export(export, out / "weights.tar", out / "summary.json")

    t = clock.elapsed
    try:
        result = run_eval(cfg, s, out, queue, weights_dir, log, time_limit_s=clock.left - EVAL_MARGIN_S)
        _export(export, out / "eval" / "eval.json", out / "eval" / "eval.md")
        summary["eval"] = {k: result[k] for k in ("table", "targets", "identity", "fidelity", "drift") if k in result}
        log("eval:\n" + markdown(result))
    except Exception as err:
        log("eval failed:\n" + traceback.format_exc())
        summary["eval"] = {"error": f"{type(err).__name__}: {err}"}
    summary["stages"]["eval"] = {"seconds": round(clock.elapsed - t, 1)}


def run_rollout_stage(cfg: Config, s: TrainSettings, data, store: StageStore, budget_s: float, log, init_params):
    """The self-rollout stage from init_params (resumed from `store` if it has a
    checkpoint); marks it done. Returns (ema params, record)."""
    from characters_jax.train.self_rollout import train_rollout

    _, params, record = train_rollout(cfg, s.rollout, data, store, budget_s, log, init_params, s.seed)
    if not store.done:
        store.mark_done({"step": record.get("planned_steps")})
    return params, record


def _export(directory, *paths) -> None:
    if directory is None:
        return
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    for p in paths:
        if p.is_file():
            shutil.copy2(p, pathlib.Path(directory) / p.name)


def run_eval(cfg: Config, s: TrainSettings, out: pathlib.Path, queue: PlanQueue, weights_dir, log,
             time_limit_s: float | None = None) -> dict:
    """Evaluates weights_dir on the held-out plans (and the drift sessions); writes
    out/eval/eval.json and eval.md."""
    queue.wait_for("heldout", s.data.heldout_clips, done=True)
    heldout = load_plans(out / "plans", "heldout", limit=s.eval.clips)
    session = None
    if "session" in queue.makers:
        queue.wait_for("session", 1, done=True)
        session = load_plans(out / "plans" / "session", "heldout")
    result = evaluate(cfg, open_weights(weights_dir, cfg), heldout, s.eval, session=session, log=log,
                      time_limit_s=time_limit_s)
    (out / "eval").mkdir(exist_ok=True)
    write_json(out / "eval" / "eval.json", result)
    (out / "eval" / "eval.md").write_text(markdown(result))
    return result


def use_compile_cache(directory: pathlib.Path) -> None:
    """XLA's persistent compilation cache in `directory`, unless one is set already: the
    evaluation's generators (trained and random weights: the same programs) and a rerun
    compile once."""
    if jax.config.jax_compilation_cache_dir:
        return
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))


def pack(cfg: Config, out: pathlib.Path, dit_params, vae_params, stats: LatentStats, summary: dict) -> pathlib.Path:
    """Writes out/weights (replacing it) and out/weights.tar. The manifest's training record:
    the stages of the weights a fine-tune started from (summary's `from_training`), then this
    run's."""
    weights_dir = out / "weights"
    if weights_dir.exists():
        shutil.rmtree(weights_dir)
    training = {**summary.get("from_training", {}), **summary["stages"]}
    save_weights(weights_dir, cfg, pure(dit_params), pure(vae_params), stats, training)
    with tarfile.open(out / "weights.tar", "w") as tar:
        tar.add(weights_dir, arcname=cfg.name)
    return weights_dir


def stage_summary(record: dict, seconds: float) -> dict:
    hist = record.get("history", [])
    return {"seconds_this_run": round(seconds, 1), "seconds_total": round(record.get("seconds", 0.0), 1),
            "steps": hist[-1][0] if hist else None, "planned_steps": record.get("planned_steps"),
            "examples_per_s": round(record.get("examples_per_s") or 0.0, 1),
            "history_columns": record.get("history_columns"), "history": hist}


def _size_mb(path: pathlib.Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6
