"""The harness: reference runs -> spread; variant runs -> divergence and verdict.

    setup = prepare(Settings(config="tiny", tp=4, steps=12, runs=4))
    ref = run_reference(setup)                      # base + perturbed reference runs
    traj = run_variant(setup, "ring-fp8")           # one variant, same inputs and weights
    report = evaluate(setup, ref, [traj, ...])      # table rows, curves, band

`run(settings)` does all of it. Tests inject faults by patching the cache functions
(`characters_jax.cache.kv_cache`) around `run_variant`: every variant builds a fresh
engine, so a patch in place while it runs is traced into that variant only.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback

import jax
import numpy as np

from characters_jax.config import Config, ConfigError, load_config
from characters_jax.numerics import runs as R
from characters_jax.numerics.metrics import Divergence, Spread, Verdict, judge


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to run. blocks: override model.num_blocks (None: the config's); dtype: override
    the activation dtype; ref_cache_dtype: the reference's launch cache dtype; factor: how
    many times the reference's spread a variant may diverge; floor: lowest band value;
    decoder: 'config' | 'small' | 'none'; repeat: add an identical repeat to the reference
    runs (None: on GPUs, where XLA's reductions may differ run to run)."""

    config: str | Config = "tiny"  # a name or path, or a Config (e.g. with command-line overrides)
    tp: int = 1
    steps: int = 12
    runs: int = 4
    variants: tuple[str, ...] = tuple(R.VARIANTS)
    blocks: int | None = None
    dtype: str | None = None
    ref_cache_dtype: str = "bf16"
    factor: float = 2.0
    floor: float = 1e-6
    decoder: str = "config"
    repeat: bool | None = None
    seed: int = 0
    sync_each_step: bool | None = None  # None: on CPU
    verbose: bool = True
    time_budget_s: float | None = None  # variants not started by then are skipped (noted)
    fp8_grid_weights: bool = True  # reference block weights snapped to the FP8 grid (runs.snap_to_fp8_grid)


@dataclasses.dataclass
class Setup:
    settings: Settings
    config: Config  # the reference path's config
    base_config: Config  # the config as given (the production variant's cache and [engine])
    engine: object  # reference Engine at settings.tp
    params: object  # reference float weights (drawn once)
    inputs: R.Inputs
    decoder: object | None
    timer: R.Timer
    notes: list[str]
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        if self.settings.verbose:
            print(f"[numerics] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One run's result: latents [K, gh, gw, C] (host); psnr [K] vs the base run (None: not
    decoded, or this is the base); note; error (the run failed: no latents)."""

    name: str
    latents: np.ndarray | None
    psnr: np.ndarray | None = None
    note: str = ""
    error: str = ""
    skipped: bool = False


@dataclasses.dataclass
class Reference:
    plan: list[R.RefRun]
    base: Trajectory
    base_frames: object | None  # device frames of the base run
    perturbed: list[Trajectory]
    spread: Spread


@dataclasses.dataclass
class Report:
    settings: Settings
    config: Config
    reference: Reference
    ref_rows: list[Verdict]
    rows: list[Verdict]
    curves: dict[str, dict[str, list[float]]]  # name -> {"latent": [K], "psnr": [K]}
    notes: list[str]
    seconds: dict[str, float]

    @property
    def flagged(self) -> list[str]:
        """Variants that ran and are not within the reference's spread."""
        return [r.name for r in self.rows if not r.note.startswith("skipped") and not r.ok]


def _given_config(settings: Settings) -> Config:
    return settings.config if isinstance(settings.config, Config) else load_config(settings.config)


def build_config(settings: Settings) -> Config:
    cfg = _given_config(settings)
    model = {}
    if settings.blocks:
        model["num_blocks"] = settings.blocks
    if settings.dtype:
        model["dtype"] = settings.dtype
    return cfg.replace(model=model) if model else cfg


def prepare(settings: Settings) -> Setup:
    started = time.perf_counter()
    cfg = build_config(settings)
    ref_cfg = R.reference_config(cfg, settings.ref_cache_dtype)
    timer = R.Timer()
    notes = []
    if settings.fp8_grid_weights:
        notes.append("reference block weights on the FP8 grid (e4m3 x power-of-two scale per layer): "
                     "FP8-weight variants run the same model; their divergence is the FP8 arithmetic")
    full_depth = _given_config(settings).model.num_blocks
    if settings.blocks and settings.blocks != full_depth:
        notes.append(f"reduced depth: {cfg.name} with {settings.blocks} of {full_depth} blocks (full width)")
    with timer("init"):
        engine = R.make_engine(ref_cfg, settings.tp)
        params = engine.init_params(jax.random.key(settings.seed))
        if settings.fp8_grid_weights:
            params = R.snap_to_fp8_grid(params)
        inputs = R.make_inputs(ref_cfg, settings.steps, engine.pad_prompt, settings.seed)
        jax.block_until_ready(params)
    decoder = None
    if settings.decoder != "none":
        from characters_jax.numerics.decode import FrameDecoder, decoder_config

        dcfg = decoder_config(ref_cfg, settings.decoder)
        decoder = FrameDecoder(dcfg, seed=settings.seed)
        if settings.decoder != "config":
            notes.append(f"frames decoded with a reduced decoder (channels {list(dcfg.decoder.channels)}, same structure), fixed random weights")
        else:
            notes.append(f"frames decoded with the config's decoder (channels {list(dcfg.decoder.channels)}), fixed random weights, every step")
    return Setup(settings, ref_cfg, cfg, engine, params, inputs, decoder, timer, notes, started)


def _sync(setup: Setup) -> bool:
    s = setup.settings.sync_each_step
    return jax.default_backend() == "cpu" if s is None else s


def _decode(setup: Setup, latents):
    if setup.decoder is None:
        return None
    with setup.timer("decode"):
        return setup.decoder(latents)


def _psnr(setup: Setup, frames, base_frames):
    from characters_jax.numerics.decode import frame_psnr

    return None if frames is None or base_frames is None else frame_psnr(frames, base_frames)


def run_reference(setup: Setup) -> Reference:
    st = setup.settings
    repeat = st.repeat if st.repeat is not None else jax.default_backend() == "gpu"
    plan = R.reference_plan(st.runs, st.tp, setup.config.model.num_heads, len(jax.devices()), repeat)
    if len(plan) < 2:
        raise ValueError("the reference needs --runs >= 2 (a base run and at least one perturbed run)")
    engines = {(st.tp, None): (setup.engine, setup.params)}
    base = base_frames = None
    perturbed = []
    for rr in plan:
        setup.log(f"{rr.label}")
        key = (rr.tp, rr.ulp_seed or None)  # ulp runs also nudge the in-step noise
        if key not in engines:
            with setup.timer("compile+run reference"):
                e = R.make_engine(setup.config, rr.tp, noise_ulp_seed=key[1])
                engines[key] = (e, R.place_params(e, setup.params, setup.engine))
        engine, params = engines[key]
        inputs = R.perturb(setup.inputs, setup.config, rr.ulp_seed) if rr.ulp_seed else setup.inputs
        with setup.timer("compile+run reference"):
            lat = R.run_session(engine, params, inputs, _sync(setup))
        frames = _decode(setup, lat)
        if rr.kind == "base":
            base, base_frames = Trajectory(rr.label, lat), frames
        else:
            perturbed.append(Trajectory(rr.label, lat, _psnr(setup, frames, base_frames), note=_ref_note(rr)))
        del frames
    del engines
    divs = [Divergence.between(t.latents, base.latents, t.psnr) for t in perturbed]
    spread = Spread.of(divs, st.factor, st.floor)
    return Reference(plan, base, base_frames, perturbed, spread)


def _ref_note(rr: R.RefRun) -> str:
    return {"tp": "other reduction order", "ulp": "inputs and noise nudged 1 ulp", "repeat": "identical rerun"}.get(rr.kind, "")


def run_variant(setup: Setup, name: str, base_frames=None) -> Trajectory:
    """Runs one variant (by name, see runs.VARIANTS) on the reference's inputs and weights."""
    if name not in R.VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(R.VARIANTS)}")
    res = R.resolve(R.VARIANTS[name], setup.settings.tp)
    if res.variant is None:
        return Trajectory(name, None, note=f"skipped: {res.note}", skipped=True)
    setup.log(name + (f" ({res.note})" if res.note else ""))
    try:
        with setup.timer(f"compile+run {name}"):
            cfg = R.variant_config(setup.config, res.variant, setup.base_config)
            engine = R.make_engine(cfg, setup.settings.tp)
            params = R.place_params(engine, setup.params, setup.engine)
            lat = R.run_session(engine, params, setup.inputs, _sync(setup))
            del params, engine
    except ConfigError as err:  # a kernel the variant names does not run here
        return Trajectory(name, None, note=f"skipped: {err}", skipped=True)
    except Exception as err:  # one failing variant must not hide the others' results
        setup.log(f"{name} failed:\n{traceback.format_exc()}")
        return Trajectory(name, None, note=f"skipped: failed ({type(err).__name__}: {str(err).splitlines()[0][:120]})", error=repr(err), skipped=True)
    frames = _decode(setup, lat)
    return Trajectory(name, lat, _psnr(setup, frames, base_frames), note=res.note)


def evaluate(setup: Setup, ref: Reference, trajectories: list[Trajectory]) -> Report:
    spread = ref.spread
    base = ref.base.latents
    curves, ref_rows, rows = {}, [], []
    for t in ref.perturbed:
        d = Divergence.between(t.latents, base, t.psnr)
        ref_rows.append(judge(t.name, d, spread, t.note))
        curves[t.name] = _curve(d)
    for t in trajectories:
        if t.skipped or t.latents is None:
            rows.append(Verdict(t.name, float("nan"), float("nan"), None, None, None, False, False, t.note))
            continue
        d = Divergence.between(t.latents, base, t.psnr)
        if not np.isfinite(t.latents).all():
            d = Divergence(np.full_like(d.latent, np.inf), d.frames)
        rows.append(judge(t.name, d, spread, t.note))
        curves[t.name] = _curve(d)
    return Report(setup.settings, setup.config, ref, ref_rows, rows, curves, list(setup.notes), dict(setup.timer.seconds))


def _curve(d: Divergence) -> dict[str, list[float]]:
    return {"latent": [float(x) for x in d.latent], "psnr": None if d.frames is None else [float(x) for x in d.frames]}


def run(settings: Settings, on_progress=None) -> Report:
    """Everything; `on_progress(report)` is called after the reference and after each variant
    (the report so far: a run cut short still leaves its results)."""
    setup = prepare(settings)
    ref = run_reference(setup)
    trajs = []
    for name in settings.variants:
        if on_progress is not None:
            on_progress(evaluate(setup, ref, trajs))
        elapsed = time.perf_counter() - setup.started
        if settings.time_budget_s is not None and elapsed > settings.time_budget_s:
            trajs.append(Trajectory(name, None, note=f"skipped: time budget of {settings.time_budget_s:g} s spent", skipped=True))
            continue
        trajs.append(run_variant(setup, name, ref.base_frames))
    return evaluate(setup, ref, trajs)
