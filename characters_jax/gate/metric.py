"""What a metric of the gate is: the `Metric` protocol, a run's `Judgement`, and `ScoreMetric`,
the common verdict of the metrics that score each held-out clip.

A score metric gives every run one value per clip for each of its scores (lip-sync
confidence, identity distance, a drift, the fidelity colour error). Against the base
reference run on the same clips and seeds, a run's difference is D = mean_c (s_run[c] -
s_base[c]); the perturbed reference runs' differences d_r give the variation V
(`variation.Variation`: max or rms of |d_r|), and a run passes a score when |D| <=
max(factor x V, floor). A score not measured (no identity probe, no drift clips) is None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from characters_jax.gate.variation import Variation, mean_difference


@dataclasses.dataclass(frozen=True)
class Judgement:
    """One run judged by one metric: figures {column: value} (NaN: not measured), ok
    {score: within the reference's variation (None: not measured)}, detail: the metric's
    own record (the latent distance's `distance.Verdict` and curves)."""

    figures: dict
    ok: dict
    detail: Any = None


class Metric(Protocol):
    """A measure of what a run shows, judged against the reference's run-to-run variation.
    Besides these, a metric gives the report its text: describe(), rule(), headers(),
    cells(judgement, reference), band_cells(band), summary(base), notes(band), band_json(band),
    judgement_json(judgement), evaluation_json(evaluation), panels(result)."""

    name: str
    min_runs: int  # reference runs it needs (the base and min_runs - 1 perturbed ones)
    needs_clips: bool  # it reads the trained model's held-out clips (a checkpoint)

    def check(self, settings) -> None:
        """ValueError naming a setting that cannot work with this metric."""

    def prepare(self, bench) -> None:
        """Makes what it needs once (probes, ground truth, decoders; more clips)."""

    def evaluate(self, outputs, base) -> Any:
        """One run's outputs (`workloads.Outputs`) -> its evaluation; base: the base run's
        evaluation (None: this is the base run)."""

    def band(self, base, reference: list) -> Any:
        """The reference's run-to-run variation from the base run's and the perturbed
        reference runs' evaluations."""

    def judge(self, band, base, evaluation) -> Judgement:
        """A run against the band."""


@dataclasses.dataclass(frozen=True)
class Scores:
    """One run's scores: values {score: float64 [clips] (None: not measured)}; finite: the
    run's latents are all finite."""

    values: dict
    finite: bool = True


def cell(x, spec: str = "+.4f") -> str:
    """A table cell: x formatted with `spec`; '-' for None or NaN, 'inf' for an infinity."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


class ScoreMetric:
    """The verdict of per-clip scores (module docstring). Subclasses set name, scores,
    labels {score: what it is} and evaluate()."""

    name = ""
    scores: tuple[str, ...] = ()
    labels: dict = {}
    min_runs = 3  # V from at least two perturbed runs
    needs_clips = True

    def __init__(self, variation: str = "max", factor: float = 2.0, floor: float = 1e-6):
        self.variation, self.factor, self.floor = variation, factor, floor

    def check(self, settings) -> None:
        pass

    def diffs(self, base: Scores, run: Scores) -> dict:
        """{score: mean difference from the base run (NaN: not measured)}."""
        out = {}
        for s in self.scores:
            v, b = run.values.get(s), base.values.get(s)
            out[s] = float("nan") if v is None or b is None else mean_difference(v, b)
        return out

    def band(self, base: Scores, reference: list[Scores]) -> dict:
        """{score: Variation}."""
        ref = [self.diffs(base, r) for r in reference]
        return {s: Variation.of([d[s] for d in ref], self.variation, self.factor, self.floor) for s in self.scores}

    def judge(self, band: dict, base: Scores, run: Scores) -> Judgement:
        d = self.diffs(base, run)
        return Judgement(d, {s: band[s].within(d[s]) for s in self.scores})

    def notes(self, band: dict) -> list[str]:
        return [f"{s}: every perturbed reference run scored exactly as the base run: the tolerance is the floor "
                f"({self.floor:g})" for s in self.scores if math.isfinite(band[s].value) and band[s].value == 0.0]

    # -- the report ----------------------------------------------------------------------------
    def rule(self) -> str:
        v = ("the largest |d_r| over the perturbed reference runs r" if self.variation == "max"
             else "sqrt(mean of d_r^2 over the perturbed reference runs r)")
        return (f"{self.name} ({', '.join(self.labels[s] for s in self.scores)}): passes when |D| <= "
                f"max({self.factor:g} x V, {self.floor:g}) for every measured score, D the mean per-clip difference from "
                f"the base reference run on the same clips and seeds, d_r the same for reference run r, V = {v} "
                f"(gate.variation = \"{self.variation}\", gate.factor = {self.factor:g})")

    def headers(self) -> list[str]:
        return [h for s in self.scores for h in (f"{self.labels[s]} diff", "allowed")]

    def cells(self, j: Judgement | None, reference: bool, band: dict | None = None) -> list[str]:
        out = []
        for s in self.scores:
            if j is None:
                out += ["-", ""]
                continue
            ok = None if reference else j.ok[s]
            mark = "" if ok is None or ok else " **x**"
            out += [cell(j.figures[s]) + mark, "" if reference or band is None else "+-" + cell(band[s].tolerance, ".4f")]
        return out

    def band_cells(self, band: dict) -> list[str]:
        return [c for s in self.scores for c in (f"V {cell(band[s].value, '.4f')}", cell(band[s].tolerance, ".4f"))]

    def band_json(self, band: dict) -> dict:
        def clean(x):
            return None if isinstance(x, float) and math.isnan(x) else x

        return {s: {"rule": v.rule, "value": clean(v.value), "tolerance": clean(v.tolerance),
                    "diffs": [clean(x) for x in v.diffs]} for s, v in band.items()}

    def judgement_json(self, j: Judgement) -> dict:
        return {}

    def evaluation_json(self, ev: Scores) -> dict:
        return {s: None if v is None else [None if not np.isfinite(x) else round(float(x), 6) for x in v]
                for s, v in ev.values.items()}

    def panels(self, result) -> list:
        """One panel per measured score: each run's mean difference from the base run, the
        allowed band (+-tolerance) shaded; reference runs grey, variants coloured by verdict."""
        band = result.bands[self.name]
        rows = [(r, True) for r in result.ref_rows] + [(r, False) for r in result.rows if r.status == "ran"]

        def panel(s):
            def draw(ax):
                tol = band[s].tolerance
                ax.axvspan(-tol, tol, color="0.85", label=f"allowed (x{self.factor:g} variation)")
                for i, (r, ref) in enumerate(rows):
                    j = r.judgements[self.name]
                    ax.plot([j.figures[s]], [i], "o", color="0.5" if ref else ("tab:green" if j.ok[s] else "tab:red"))
                ax.set_yticks(range(len(rows)), [r.name for r, _ in rows], fontsize=7)
                ax.invert_yaxis()
                ax.axvline(0, color="k", lw=0.5)
                ax.set_xlabel(f"{self.labels[s]}: variant - base")
                ax.set_xscale("symlog", linthresh=max(tol / 10, 1e-9) if math.isfinite(tol) and tol > 0 else 1e-6)
                ax.legend(fontsize=7, loc="lower right")
            return draw

        return [panel(s) for s in self.scores if math.isfinite(band[s].value)]
