"""The latent distance: how far a run's latents (and, on the random session, its decoded
frames) move from the base reference run's, against how far the perturbed reference runs
move (`distance`).

Every run's latents, [items * steps, gh, gw, C] (clips one after the other), against the
base run's: relative L2 per step; on the random session the latents are also decoded by a
VAE decoder with fixed random weights (`latent.decoder`; `decode`) and compared by PSNR.
A run is within when its mean and worst distance are <= factor x the reference's mean and
worst, and its mean and worst PSNR >= the reference's minus 20 log10(factor) dB
(`distance.judge`); the per-step band (factor x the reference's largest distance at that
step) says where a run leaves it. On the trained model this is the diagnostic beside the
scores; on random weights (characters-57b) the only measure there is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from characters_jax.gate.distance import Divergence, Spread, Verdict, judge
from characters_jax.gate.metric import Judgement, cell
from characters_jax.gate.options import LatentOptions


@dataclasses.dataclass(frozen=True)
class LatentEvaluation:
    """latents float32 [items * steps, gh, gw, C] (host); psnr [items * steps] dB against
    the base run's frames (None: not decoded, or the base run)."""

    latents: np.ndarray
    psnr: np.ndarray | None = None


class LatentMetric:
    name = "latent"
    min_runs = 2
    needs_clips = False

    def __init__(self, options: LatentOptions = LatentOptions(), factor: float = 2.0, floor: float = 1e-6):
        self.options, self.factor, self.floor = options, factor, floor
        self.decoder = None
        self._base_frames = None
        self._timer = None

    def check(self, settings) -> None:
        pass

    def prepare(self, bench) -> None:
        """On the random session, the frame decoder of `latent.decoder` (fixed random weights)."""
        from characters_jax.gate.workloads import RandomSession

        self._timer = bench.timer
        if not isinstance(bench.workload, RandomSession) or self.options.decoder == "none":
            return
        from characters_jax.gate.decode import FrameDecoder, decoder_config

        dcfg = decoder_config(bench.config, self.options.decoder)
        self.decoder = FrameDecoder(dcfg, seed=bench.config.seed)
        which = "a reduced decoder" if self.options.decoder != "config" else "the config's decoder"
        bench.notes.append(f"frames decoded with {which} (channels {list(dcfg.decoder.channels)}), fixed random weights, "
                           "every step")

    @property
    def decodes(self) -> bool:
        return self.decoder is not None

    def evaluate(self, outputs, base: LatentEvaluation | None) -> LatentEvaluation:
        latents = outputs.latents.reshape((-1,) + outputs.latents.shape[2:])
        if self.decoder is None:
            return LatentEvaluation(latents)
        from characters_jax.gate.decode import frame_psnr

        with self._timer("decode"):
            frames = self.decoder(latents)
        if base is None:
            self._base_frames = frames  # on the device, for the other runs' PSNR
            return LatentEvaluation(latents)
        return LatentEvaluation(latents, frame_psnr(frames, self._base_frames))

    def band(self, base: LatentEvaluation, reference: list[LatentEvaluation]) -> Spread:
        return Spread.of([Divergence.between(r.latents, base.latents, r.psnr) for r in reference], self.factor, self.floor)

    def judge(self, band: Spread, base: LatentEvaluation, ev: LatentEvaluation) -> Judgement:
        d = Divergence.between(ev.latents, base.latents, ev.psnr)
        if not np.isfinite(ev.latents).all():
            d = Divergence(np.full_like(d.latent, np.inf), d.frames)
        v = judge("", d, band)
        figures = {"latent_mean": v.latent_mean, "latent_worst": v.latent_worst}
        if self.decodes:
            figures.update(psnr_mean=v.psnr_mean, psnr_worst=v.psnr_worst)
        return Judgement(figures, {"latent": v.ok}, (v, d))

    def notes(self, band: Spread) -> list[str]:
        return []

    # -- the report ----------------------------------------------------------------------------
    def describe(self) -> str:
        return "latent distance" + (" and decoded-frame PSNR" if self.decodes else "")

    def rule(self) -> str:
        f = self.factor
        psnr = (f", and mean and worst frame PSNR >= the reference's minus {20 * math.log10(f):.1f} dB" if self.decodes
                else "")
        return (f"latent: within when the mean and worst relative L2 distance of its latents to the base run's are "
                f"<= {f:g} x the perturbed reference runs' mean and worst{psnr}; the band per step is {f:g} x the "
                f"reference's largest distance at that step (floor {self.floor:g})")

    def headers(self) -> list[str]:
        psnr = ["frame PSNR mean dB", "worst dB"] if self.decodes else []
        return ["latent rel-L2 mean", "worst", *psnr, "leaves band at step", "latent verdict"]

    def cells(self, j: Judgement | None, reference: bool, band: Spread | None = None) -> list[str]:
        if j is None:
            return ["-"] * len(self.headers())
        v: Verdict = j.detail[0]
        psnr = [cell(v.psnr_mean, ".1f"), cell(v.psnr_worst, ".1f")] if self.decodes else []
        leave = "-" if v.leaves_band_at is None else str(v.leaves_band_at)
        verdict = "(ref)" if reference else ("within" if v.ok else "outside")
        return [cell(v.latent_mean, ".2e"), cell(v.latent_worst, ".2e"), *psnr, leave, verdict]

    def band_cells(self, s: Spread) -> list[str]:
        psnr = [cell(s.psnr_mean, ".1f"), cell(s.psnr_worst, ".1f")] if self.decodes else []
        return [f"{s.latent_mean:.2e}", f"{s.latent_worst:.2e}", *psnr, "", f"x{s.factor:g} allowed"]

    def summary(self, base: LatentEvaluation) -> str:
        return ""

    def band_json(self, s: Spread) -> dict:
        return {"latent_mean": s.latent_mean, "latent_worst": s.latent_worst, "psnr_mean": s.psnr_mean,
                "psnr_worst": s.psnr_worst, "factor": s.factor, "band": [float(x) for x in s.band]}

    def judgement_json(self, j: Judgement) -> dict:
        v, d = j.detail
        return {"leaves_band_at": v.leaves_band_at, "mean_ok": v.mean_ok, "worst_ok": v.worst_ok,
                "curve": {"latent": [float(x) for x in d.latent],
                          "psnr": None if d.frames is None else [float(x) for x in d.frames]}}

    def evaluation_json(self, ev: LatentEvaluation) -> dict | None:
        return None

    def panels(self, result) -> list:
        """Divergence against step: latent relative L2 (log scale) with the band, and frame
        PSNR when decoded. Reference runs grey, variants in colour."""
        spread = result.bands[self.name]
        rows = [(r, True) for r in result.ref_rows] + [(r, False) for r in result.rows if r.status == "ran"]
        low = self.floor / 10  # zero distances (bit-identical steps) are drawn here

        def curves(ax, which: str):
            for r, ref in rows:
                d = r.judgements[self.name].detail[1]
                values = d.latent if which == "latent" else d.frames
                if values is None:
                    continue
                style = dict(color="0.6", lw=1, ls="--") if ref else dict(lw=1.6)
                label = r.name + (" (ref)" if ref else "")
                ax.plot(range(len(values)), [max(x, low) for x in values] if which == "latent" else values,
                        label=label, **style)
            ax.set_xlabel("step")

        def latent(ax):
            curves(ax, "latent")
            ax.plot(range(len(spread.band)), spread.band, color="k", lw=1, ls=":", label="band")
            ax.set_yscale("log")
            ax.set_ylim(bottom=low / 2)
            ax.set_ylabel("latent relative L2 vs base reference run")
            ax.legend(fontsize=7)

        def psnr(ax):
            curves(ax, "psnr")
            ax.set_ylabel("decoded frames PSNR vs base run (dB)")

        return [latent, psnr] if self.decodes else [latent]
