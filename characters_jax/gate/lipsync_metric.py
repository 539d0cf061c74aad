"""Lip sync and identity on the trained model's held-out clips, and their drift.

The shipped probes read each clip's frames as the decoder process decodes them: the mouth
probe's lip-sync confidence against the clip's ground-truth mouth track
(`lipsync.score`), the identity probe's distance to the clip's portrait
(`lipsync.identity`; not measured without its weights). Drift: over longer held-out clips
(`lipsync.drift_clips` of `drift_seconds`), the change of both from the first to the last
`drift_window_s` seconds. Each is a score of `metric.ScoreMetric`; a run whose latents or
confidences are not finite fails lip sync.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from characters_jax.gate.metric import Judgement, ScoreMetric, Scores
from characters_jax.gate.options import LipsyncOptions


@dataclasses.dataclass(frozen=True)
class Probes:
    """The shipped probes: mouth (lip sync) and identity (None: not shipped)."""

    mouth: object
    identity: object | None

    @classmethod
    def load(cls) -> "Probes":
        from characters_jax.lipsync.probe import load_probe

        try:
            ident = load_probe("identity")
        except FileNotFoundError:
            ident = None
        return cls(load_probe("mouth"), ident)


class LipsyncMetric(ScoreMetric):
    name = "lipsync"
    scores = ("lipsync", "identity", "drift_lipsync", "drift_identity")
    labels = {"lipsync": "lip-sync confidence", "identity": "identity distance", "drift_lipsync": "drift of lip sync",
              "drift_identity": "drift of identity"}

    def __init__(self, options: LipsyncOptions = LipsyncOptions(), variation: str = "max", factor: float = 2.0,
                 floor: float = 1e-6):
        super().__init__(variation, factor, floor)
        self.options = options
        self.probes: Probes | None = None
        self.clips = self.long = None
        self.window = 0

    def check(self, settings) -> None:
        """The clips must hold the score's lags (clips.seconds, lipsync.drift_window_s)."""
        from characters_jax.lipsync.score import MAX_LAG

        fps, o = settings.config.video.fps, self.options
        least = (2 * MAX_LAG + 2) / fps
        if settings.clips.seconds < least:
            raise ValueError(f"clips.seconds: {settings.clips.seconds:g} is too short for the lip-sync score "
                             f"(at least {least:.2f} s)")
        if o.drift_clips and o.drift_window_s < least:
            raise ValueError(f"lipsync.drift_window_s: {o.drift_window_s:g} is too short for the lip-sync score "
                             f"(at least {least:.2f} s)")

    def prepare(self, bench) -> None:
        self.probes = Probes.load()
        w, o = bench.workload, self.options
        if o.drift_clips:
            w.add_long_clips(bench, o.drift_clips, o.drift_seconds)
        self.clips, self.long = w.clips, w.long
        self.window = int(round(o.drift_window_s * bench.config.video.fps))
        if self.probes.identity is None:
            bench.notes.append("no identity probe weights: identity not measured")
        if not o.drift_clips:
            bench.notes.append("drift not measured (lipsync.drift_clips = 0)")

    def _identity(self, frames, portrait) -> float:
        from characters_jax.lipsync.identity import identity_distance

        p = self.probes.identity
        return identity_distance(frames, portrait, p) if p is not None else float("nan")

    def evaluate(self, outputs, base=None) -> Scores:
        from characters_jax.lipsync.score import score

        clips, mouth = self.clips, self.probes.mouth
        conf = [score(f, clips.track[i], mouth).confidence for i, f in enumerate(outputs.frames)]
        ident = [self._identity(f, clips.portrait[i]) for i, f in enumerate(outputs.frames)]
        values = {"lipsync": np.asarray(conf, np.float64), "identity": np.asarray(ident, np.float64),
                  "drift_lipsync": None, "drift_identity": None}
        if outputs.long is not None:
            long, n = self.long, self.long.frames
            first, last = slice(0, self.window), slice(n - self.window, n)
            dc, di = [], []
            for i, f in enumerate(outputs.long.frames):
                c = [score(f[w], long.track[i][w], mouth).confidence for w in (first, last)]
                d = [self._identity(f[w], long.portrait[i]) for w in (first, last)]
                dc.append(c[1] - c[0])
                di.append(d[1] - d[0])
            values.update(drift_lipsync=np.asarray(dc, np.float64), drift_identity=np.asarray(di, np.float64))
        return Scores(values, outputs.finite)

    def judge(self, band: dict, base: Scores, run: Scores) -> Judgement:
        j = super().judge(band, base, run)
        if not run.finite or not np.isfinite(run.values["lipsync"]).all():
            j.ok["lipsync"] = False
        return j

    def describe(self) -> str:
        o = self.options
        drift = (f"drift over {o.drift_clips} x {o.drift_seconds:g} s clips, last {o.drift_window_s:g} s vs first"
                 if o.drift_clips else "drift not measured")
        return f"lip sync and identity ({drift})"

    def summary(self, base: Scores) -> str:
        v = base.values
        return (f"base reference run: mean lip-sync confidence {v['lipsync'].mean():.4f}, identity distance "
                f"{np.nanmean(v['identity']) if np.isfinite(v['identity']).any() else float('nan'):.4f}")
