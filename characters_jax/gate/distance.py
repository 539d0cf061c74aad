"""Divergence metrics and the verdict against the reference's run-to-run spread (numpy only).

Trajectories are host arrays: latents [K, grid_h, grid_w, C] float32 (one latent frame per
step) and decoded frames [K, frames_per_step, H, W, 3] float32 in [-1, 1].

The reference path is run several times under perturbations a deployment has anyway
(another tensor-parallel size, i.e. another reduction order; a one-ulp nudge of the
inputs; on GPUs XLA's own nondeterminism). Its distances to the first (base) reference run
form the spread. A variant is "within spread" when its distance to the base run is no
larger than `factor` times that spread, both on average over steps and runs ("mean") and
at its worst step ("worst"), for latents (relative L2) and decoded frames (PSNR).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PSNR_CAP_DB = 150.0  # identical frames: reported as the cap, not infinity
FRAME_RANGE = 2.0  # decoded frames lie in [-1, 1]


def rel_l2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-step relative L2 distance ||a - b|| / ||b||: [K, ...] x [K, ...] -> [K] float64."""
    a = np.asarray(a, np.float64).reshape(len(a), -1)
    b = np.asarray(b, np.float64).reshape(len(b), -1)
    return np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)


def psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-step PSNR in dB of frames in [-1, 1] (peak-to-peak 2), capped at PSNR_CAP_DB: -> [K]."""
    a = np.asarray(a, np.float64).reshape(len(a), -1)
    b = np.asarray(b, np.float64).reshape(len(b), -1)
    mse = np.mean((a - b) ** 2, axis=1)
    with np.errstate(divide="ignore"):
        db = 10.0 * np.log10(FRAME_RANGE**2 / mse)
    return np.minimum(db, PSNR_CAP_DB)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One trajectory against the base reference run. latent: [K] relative L2;
    frames: [K] PSNR dB (None when frames were not decoded)."""

    latent: np.ndarray
    frames: np.ndarray | None

    @classmethod
    def between(cls, latents: np.ndarray, base_latents: np.ndarray, frames_psnr: np.ndarray | None = None) -> "Divergence":
        """latents, base_latents: [K, ...]; frames_psnr: [K] dB of the decoded frames, or None."""
        return cls(latent=rel_l2(latents, base_latents), frames=None if frames_psnr is None else np.asarray(frames_psnr, np.float64))


@dataclasses.dataclass(frozen=True)
class Spread:
    """The reference's run-to-run spread over its perturbed runs (R-1 of them).

    band: [K] tolerance band of the latent distance per step: `factor` x the largest
    reference distance at that step, never below `floor`.
    """

    latent_mean: float
    latent_worst: float
    psnr_mean: float | None
    psnr_worst: float | None
    band: np.ndarray
    factor: float

    @classmethod
    def of(cls, runs: list[Divergence], factor: float, floor: float) -> "Spread":
        """Runs identical to the base (e.g. a GPU repeat that happened to be deterministic)
        show determinism, not spread: they are left out, unless every run is identical
        (then the spread is zero and `floor` sets the band). Counting them would pull the
        mean distance towards 0 and the mean PSNR towards the cap."""
        if not runs:
            raise ValueError("the spread needs at least one perturbed reference run")
        runs = [d for d in runs if float(np.max(d.latent)) > 0.0] or runs
        lat = np.stack([d.latent for d in runs])  # [R-1, K]
        frames = [d.frames for d in runs if d.frames is not None]
        fr = np.stack(frames) if len(frames) == len(runs) else None
        return cls(
            latent_mean=float(lat.mean()),
            latent_worst=float(lat.max()),
            psnr_mean=float(fr.mean()) if fr is not None else None,
            psnr_worst=float(fr.min()) if fr is not None else None,
            band=np.maximum(factor * lat.max(axis=0), floor),
            factor=factor,
        )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Summary of one trajectory against the spread (the table row)."""

    name: str
    latent_mean: float
    latent_worst: float
    psnr_mean: float | None
    psnr_worst: float | None
    leaves_band_at: int | None  # first step whose latent distance exceeds the band
    mean_ok: bool
    worst_ok: bool
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.mean_ok and self.worst_ok


def judge(name: str, div: Divergence, spread: Spread, note: str = "") -> Verdict:
    """Is `div` within `spread.factor` x the reference spread, on average and at worst?

    Latents: mean (worst) relative L2 <= factor x the reference's mean (worst).
    Frames: mean (worst) PSNR >= the reference's mean (worst) - 20 log10(factor) dB.
    """
    f = spread.factor
    db = 20.0 * math.log10(f)
    lat_mean, lat_worst = float(div.latent.mean()), float(div.latent.max())
    mean_ok = lat_mean <= f * spread.latent_mean
    worst_ok = lat_worst <= f * spread.latent_worst
    p_mean = p_worst = None
    if div.frames is not None and spread.psnr_mean is not None:
        p_mean, p_worst = float(div.frames.mean()), float(div.frames.min())
        mean_ok = mean_ok and p_mean >= spread.psnr_mean - db
        worst_ok = worst_ok and p_worst >= spread.psnr_worst - db
    out = np.nonzero(div.latent > spread.band)[0]
    return Verdict(
        name=name,
        latent_mean=lat_mean,
        latent_worst=lat_worst,
        psnr_mean=p_mean,
        psnr_worst=p_worst,
        leaves_band_at=int(out[0]) if out.size else None,
        mean_ok=bool(mean_ok),
        worst_ok=bool(worst_ok),
        note=note,
    )
