"""The quality gate's one harness: reference runs -> run-to-run variation; variant runs ->
each metric's verdict against it.

    result = run(Settings(config=cfg, metrics=("lipsync", "fidelity"), checkpoint="checkpoints/talking"))

    bench = prepare(settings)                     # the workload's inputs and weights, each metric's inputs
    base, reference = run_reference(bench)        # the base run and the perturbed reference runs
    record = run_variant(bench, "ring-fp8")       # one variant on the same inputs, seeds and weights
    result = evaluate(bench, base, reference, [record, ...])

A workload (`workloads`) is what every run runs: random weights and one random session
(no checkpoint), or the trained model's held-out clips (a weights directory). A `Metric`
prepares what it needs once, evaluates each run's outputs, and judges a variant against
the band the reference runs give it:

  latent    latent relative L2 (and, on the random session, decoded-frame PSNR) against
            the reference's spread (`latent_metric`, `distance`)
  lipsync   lip-sync confidence and identity distance on held-out clips, and their drift
            over longer clips (`lipsync_metric`)
  fidelity  the worst region's mean-colour error against the clip's ground truth
            (`fidelity_metric`, `lipsync.fidelity`)

The named metrics judge: a variant passes when every score they measured is within the
reference's variation. The latent distance is measured on every run; unless named it is a
diagnostic beside the verdict. A run is made once and every metric reads its outputs. The
command exits 1 when a default-path variant (`DEFAULT_PATH`) fails.

Reference runs: the reference path (launch cache, reference attention, plain GEMMs, psum)
as the base run and under perturbations a deployment has anyway (`runs.reference_plan`).
Variants whose own arithmetic cannot run here (Pallas kernels off Hopper, a tp size above
the device count) are rows that say so, never dropped. A variant name may carry a
tensor-parallel size: 'production@tp2'. Tests inject faults by patching the cache functions
(`characters_jax.cache.kv_cache`) around `run_variant`: every variant builds a fresh engine,
so a patch in place while it runs is traced into that variant only.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from typing import Any

import jax

from characters_jax.config import Config, ConfigError
from characters_jax.gate import runs as R
from characters_jax.gate.options import ClipOptions, GateOptions, LatentOptions, LipsyncOptions

METRICS = ("latent", "lipsync", "fidelity")
# Variants whose failure fails the command (exit 1): the path that serves by default.
DEFAULT_PATH = ("production",)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to run. config: the model config as given (`--set` applied); metrics: the
    metrics that judge (the latent distance is measured beside them anyway); checkpoint:
    a weights directory (the trained model on held-out clips) or None (random weights, one
    random session); tp: the base run's and the variants' tp size (a variant's '@tpN'
    overrides it); variants: None for the workload's default set; the tables: options.py."""

    config: Config
    metrics: tuple[str, ...] = ("latent",)
    checkpoint: str | None = None
    tp: int = 1
    variants: tuple[str, ...] | None = None
    gate: GateOptions = GateOptions()
    latent: LatentOptions = LatentOptions()
    clips: ClipOptions = ClipOptions()
    lipsync: LipsyncOptions = LipsyncOptions()


def make_metrics(settings: Settings) -> list:
    """The judging metrics in `METRICS` order, then the latent distance as a diagnostic
    when it is not named."""
    from characters_jax.gate.fidelity_metric import FidelityMetric
    from characters_jax.gate.latent_metric import LatentMetric
    from characters_jax.gate.lipsync_metric import LipsyncMetric

    unknown = [m for m in settings.metrics if m not in METRICS]
    if unknown or not settings.metrics:
        raise ValueError(f"unknown metric(s) {unknown}; known: {', '.join(METRICS)} (comma-separated)")
    g = settings.gate
    make = {"latent": lambda: LatentMetric(settings.latent, g.factor, g.floor),
            "lipsync": lambda: LipsyncMetric(settings.lipsync, g.variation, g.factor, g.floor),
            "fidelity": lambda: FidelityMetric(g.variation, g.factor, g.floor)}
    return [make[m]() for m in METRICS if m in settings.metrics or m == "latent"]


def make_workload(settings: Settings):
    from characters_jax.gate.workloads import HeldOutClips, RandomSession

    if settings.checkpoint:
        return HeldOutClips(settings.checkpoint, settings.clips)
    return RandomSession(settings.latent)


def variants_of(settings: Settings, workload) -> tuple[str, ...]:
    return settings.variants if settings.variants is not None else workload.default_variants


def check(settings: Settings, metrics: list | None = None) -> None:
    """ValueError naming the setting that cannot work (before anything runs)."""
    metrics = metrics if metrics is not None else make_metrics(settings)
    clip_metrics = [m.name for m in metrics if m.needs_clips]
    if clip_metrics and not settings.checkpoint:
        raise ValueError(f"{', '.join(clip_metrics)} needs --checkpoint (the trained config's weights directory, "
                         "e.g. checkpoints/talking)")
    need = max(m.min_runs for m in metrics)
    if settings.gate.runs < need:
        raise ValueError(f"gate.runs: must be >= {need} with {', '.join(settings.metrics)} (a base run and at least "
                         f"{need - 1} perturbed ones), got {settings.gate.runs}")
    settings.config.validate_tp(settings.tp)
    for m in metrics:
        m.check(settings)
    for v in variants_of(settings, make_workload(settings)):
        R.parse_variant(v)


@dataclasses.dataclass
class Bench:
    """The prepared gate: the reference path's config, the config as given, the workload,
    the metrics, the reference engine and its params, timings, notes."""

    settings: Settings
    config: Config  # the reference path's
    given_config: Config  # as given (the production variant's cache and [engine])
    workload: Any
    metrics: list
    engine: Any = None
    params: Any = None
    timer: R.Timer = dataclasses.field(default_factory=R.Timer)
    notes: list = dataclasses.field(default_factory=list)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def judging(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metrics if m.name in self.settings.metrics)

    def log(self, msg: str) -> None:
        """A progress line on stderr (unless gate.quiet)."""
        if not self.settings.gate.quiet:
            print(f"[gate] [{time.perf_counter() - self.started:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One run: status 'ran' | 'not run here (...)' | 'not run (time budget ...)' |
    'failed (...)'; evaluations {metric: evaluation} when it ran."""

    name: str
    status: str
    evaluations: dict = dataclasses.field(default_factory=dict)
    note: str = ""
    tp: int = 1

    @property
    def ran(self) -> bool:
        return self.status == "ran"


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant (or perturbed reference run) against the base run: judgements {metric:
    Judgement} (empty when it did not run); judging: the metrics of the verdict."""

    name: str
    status: str
    judgements: dict
    judging: tuple[str, ...]
    note: str = ""

    @property
    def figures(self) -> dict:
        """Every metric's figures, by column."""
        return {k: v for j in self.judgements.values() for k, v in j.figures.items()}

    @property
    def ok(self) -> dict:
        """Every judging metric's scores: within the variation (None: not measured)."""
        return {k: v for m in self.judging if m in self.judgements for k, v in self.judgements[m].ok.items()}

    @property
    def verdict(self) -> str:
        """'pass' | 'FAIL' | the status of a row that did not run."""
        if self.status != "ran":
            return self.status
        measured = [v for v in self.ok.values() if v is not None]
        return "pass" if measured and all(measured) else "FAIL"


@dataclasses.dataclass
class GateResult:
    settings: Settings
    config: Config  # the reference path's
    workload: Any
    metrics: list
    judging: tuple[str, ...]
    plan: list
    base: RunRecord
    reference: list
    bands: dict  # metric -> its band
    ref_rows: list
    rows: list
    notes: list
    seconds: dict

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.rows if r.verdict == "FAIL"]

    @property
    def failed_default_path(self) -> list[str]:
        return [n for n in self.failed if n.partition("@")[0] in DEFAULT_PATH]


def prepare(settings: Settings) -> Bench:
    """Checks the settings, then the workload's inputs and weights (FileNotFoundError /
    WeightsError before anything runs) and each metric's inputs."""
    metrics = make_metrics(settings)
    check(settings, metrics)
    given = settings.config
    bench = Bench(settings, R.reference_config(given, settings.gate.ref_cache_dtype), given, make_workload(settings),
                  metrics)
    bench.engine, bench.params = bench.workload.prepare(bench)
    for m in metrics:
        m.prepare(bench)
    return bench


def measure(bench: Bench, outputs, base: dict | None) -> dict:
    """{metric: evaluation} of one run's outputs; base: the base run's evaluations (None:
    this is the base run)."""
    return {m.name: m.evaluate(outputs, None if base is None else base[m.name]) for m in bench.metrics}


def run_reference(bench: Bench) -> tuple[list, RunRecord, list[RunRecord]]:
    """(the plan, the base run, the perturbed reference runs)."""
    st, w = bench.settings, bench.workload
    kinds = st.gate.perturb or w.default_perturbations
    plan = R.reference_plan(st.gate.runs, st.tp, bench.config.model.num_heads, len(jax.devices()),
                            jax.default_backend() == "gpu", kinds)
    need = max(m.min_runs for m in bench.metrics)
    if len(plan) < need:
        raise ValueError(f"the reference needs >= {need} runs; the perturbations {kinds} give {len(plan)} here")
    engines = {(st.tp, None): (bench.engine, bench.params)}
    base, perturbed = None, []
    for rr in plan:
        bench.log(rr.label)
        ulp = rr.ulp_seed if rr.kind == "ulp" else None  # an ulp run also nudges the in-step noise
        with bench.timer("reference runs"):
            if (rr.tp, ulp) not in engines:
                e = R.make_engine(bench.config, rr.tp, noise_ulp_seed=ulp)
                engines[(rr.tp, ulp)] = (e, R.place_params(e, bench.params, bench.engine))
            engine, params = engines[(rr.tp, ulp)]
            outputs = w.run(engine, params, rr, bench.log)
            evaluations = measure(bench, outputs, None if base is None else base.evaluations)
        record = RunRecord(rr.label, "ran", evaluations, note=_REF_NOTES.get(rr.kind, ""), tp=rr.tp)
        if rr.kind == "base":
            base = record
        else:
            perturbed.append(record)
        del outputs
    del engines
    return plan, base, perturbed


_REF_NOTES = {"tp": "other reduction order", "ulp": "inputs and noise nudged 1 ulp", "repeat": "identical rerun",
              "seed": "other noise seeds (the sampler's own variation)"}


def run_variant(bench: Bench, name: str, base: RunRecord) -> RunRecord:
    """One variant ('name' or 'name@tpN') on the reference's inputs, seeds and weights."""
    variant, tp = R.parse_variant(name)
    tp = tp or bench.settings.tp
    if tp > len(jax.devices()):
        return RunRecord(name, f"not run here (needs {tp} devices, {len(jax.devices())} here)", tp=tp)
    res = R.resolve(variant, tp)
    if res.variant is None:
        return RunRecord(name, f"not run here ({res.note})", tp=tp)
    bench.log(name + (f" ({res.note})" if res.note else ""))
    try:
        with bench.timer(f"variant {name}"):
            cfg = R.variant_config(bench.config, res.variant, bench.given_config)
            engine = R.make_engine(cfg, tp)
            params = R.place_params(engine, bench.params, bench.engine)
            outputs = bench.workload.run(engine, params, None, bench.log)
            del params, engine
            evaluations = measure(bench, outputs, base.evaluations)
    except ConfigError as err:  # a kernel the variant names does not run here
        return RunRecord(name, f"not run here ({err})", tp=tp)
    except Exception as err:  # one failing variant must not hide the others' results
        bench.log(f"{name} failed:\n{traceback.format_exc()}")
        return RunRecord(name, f"failed ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})",
                         tp=tp)
    return RunRecord(name, "ran", evaluations, note=res.note, tp=tp)


def evaluate(bench: Bench, plan, base: RunRecord, reference: list[RunRecord], variants: list[RunRecord]) -> GateResult:
    """Each metric's band from the reference runs; a row per perturbed reference run and per variant."""
    bands = {m.name: m.band(base.evaluations[m.name], [r.evaluations[m.name] for r in reference]) for m in bench.metrics}
    judging = bench.judging

    def row(record: RunRecord) -> Row:
        if not record.ran:
            return Row(record.name, record.status, {}, judging, record.note)
        return Row(record.name, record.status,
                   {m.name: m.judge(bands[m.name], base.evaluations[m.name], record.evaluations[m.name])
                    for m in bench.metrics}, judging, record.note)

    notes = list(bench.notes)
    for m in bench.metrics:
        notes += m.notes(bands[m.name])
    return GateResult(bench.settings, bench.config, bench.workload, bench.metrics, judging, plan, base, reference, bands,
                      [row(r) for r in reference], [row(r) for r in variants], notes, dict(bench.timer.seconds))


def run(settings: Settings, on_progress=None) -> GateResult:
    """Everything; on_progress(result so far) after the reference and after each variant
    (a run cut short still leaves its results)."""
    bench = prepare(settings)
    plan, base, reference = run_reference(bench)
    budget = settings.gate.time_budget_s
    variants = []
    for name in variants_of(settings, bench.workload):
        if on_progress is not None:
            on_progress(evaluate(bench, plan, base, reference, variants))
        if budget and time.perf_counter() - bench.started > budget:
            variants.append(RunRecord(name, f"not run (time budget of {budget:g} s spent)"))
            continue
        variants.append(run_variant(bench, name, base))
    return evaluate(bench, plan, base, reference, variants)
