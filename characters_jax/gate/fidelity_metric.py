"""Fidelity on the trained model's held-out clips: does the character keep its colours?

Each clip's frames (as the decoder process decodes them) against the clip's ground-truth
renders (`lipsync.fidelity.FidelityReference`): the worst region's mean-colour difference,
per channel, in /255 (`FidelityScore.colour_error`: background, skin, hair, clothes; the
pixels no head motion, blink or open jaw takes from a region). One score of
`metric.ScoreMetric`, judged like lip sync against the reference's run-to-run variation.
"""

from __future__ import annotations

import numpy as np

from characters_jax.gate.metric import ScoreMetric, Scores


class FidelityMetric(ScoreMetric):
    name = "fidelity"
    scores = ("fidelity",)
    labels = {"fidelity": "fidelity: colour error (/255)"}

    def __init__(self, variation: str = "max", factor: float = 2.0, floor: float = 1e-6):
        super().__init__(variation, factor, floor)
        self.references: list = []

    def prepare(self, bench) -> None:
        """Each clip's ground truth rendered once, its region masks and colours (no KID: the
        colour error needs no feature network)."""
        from characters_jax.data.face import render_frames
        from characters_jax.lipsync.fidelity_eval import references

        plans, clips = bench.workload.plans, bench.workload.clips
        h, w = bench.config.video.height, bench.config.video.width
        with bench.timer("fidelity references"):
            truth = [render_frames(plans.identity[i], plans.params[i], h, w) for i in range(len(plans))]
            self.references = references(plans.identity, truth, clips.portrait, features=None)

    def evaluate(self, outputs, base=None) -> Scores:
        errors = [ref.score(f).colour_error for ref, f in zip(self.references, outputs.frames)]
        return Scores({"fidelity": np.asarray(errors, np.float64)}, outputs.finite)

    def describe(self) -> str:
        return "fidelity (the worst region's mean-colour error against the ground truth)"

    def summary(self, base: Scores) -> str:
        return f"base reference run: mean colour error {base.values['fidelity'].mean():.2f}/255"
