"""The lip-sync gate's statistics: mean score differences and the reference's variation (numpy only).

For one score (lip-sync confidence, identity distance, or a drift figure) every run gives
one value per clip, s_run [n]. The reference's base run is the anchor; its R-1 perturbed
runs (one-ulp nudges, another tp size, a repeat) give the run-to-run differences

    d_r = mean_c (s_r[c] - s_base[c])           (r = 1 .. R-1, paired over the same clips)

and a variant's difference is D = mean_c (s_variant[c] - s_base[c]). The variation:

    rule 'max': V = max_r |d_r|      the largest shift of the mean score that a perturbation
                                     the deployment has anyway produced (the default: it
                                     needs no assumption on the shape of the distribution,
                                     and with few reference runs it is the value seen, not
                                     an extrapolation from three samples)
    rule 'rms': V = sqrt(mean_r d_r^2)   the standard deviation of d around 0 (its expected
                                     value: the perturbations have no direction)

A variant passes when |D| <= max(factor * V, floor). An honest variant is one more
perturbation of the same kind: with the 'max' rule and factor 1 it would exceed the
largest of R-1 such shifts with probability 1/R; the factor (2 by default) leaves margin
for that, while a systematic change of the score (a wrong RoPE offset, a mis-scaled cache)
moves D by many times V.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

RULES = ("max", "rms")


def mean_difference(scores: np.ndarray, base: np.ndarray) -> float:
    """mean_c (scores[c] - base[c]) over the clips both have a finite value for (NaN: none)."""
    d = np.asarray(scores, np.float64) - np.asarray(base, np.float64)
    d = d[np.isfinite(d)]
    return float(d.mean()) if d.size else float("nan")


@dataclasses.dataclass(frozen=True)
class Variation:
    """The reference's run-to-run variation of one score: diffs [R-1] (d_r per perturbed
    run), rule, value V, factor; tolerance = max(factor * V, floor)."""

    diffs: tuple[float, ...]
    rule: str
    value: float
    factor: float
    floor: float

    @classmethod
    def of(cls, diffs, rule: str = "max", factor: float = 2.0, floor: float = 0.0) -> "Variation":
        if rule not in RULES:
            raise ValueError(f"unknown variation rule {rule!r}; known: {', '.join(RULES)}")
        d = np.asarray([x for x in diffs if math.isfinite(x)], np.float64)
        if d.size == 0:
            return cls(tuple(float(x) for x in diffs), rule, float("nan"), factor, floor)
        value = float(np.abs(d).max()) if rule == "max" else float(np.sqrt((d * d).mean()))
        return cls(tuple(float(x) for x in diffs), rule, value, factor, floor)

    @property
    def tolerance(self) -> float:
        return max(self.factor * self.value, self.floor) if math.isfinite(self.value) else float("nan")

    def within(self, diff: float) -> bool | None:
        """|diff| <= tolerance; None when either is not measured."""
        if not (math.isfinite(diff) and math.isfinite(self.tolerance)):
            return None
        return abs(diff) <= self.tolerance
