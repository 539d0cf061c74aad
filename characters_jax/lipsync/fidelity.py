"""Fidelity of generated frames: does the character stay itself (colours, detail, look)?

It reads generated frames only (uint8 [T, H, W, 3]) and compares them with the clip's
ground-truth renders and the reference portrait, in ways that the head's motion and blinks
(random in the renderer, not asked of the generator) do not move:

  colour     per region (background, skin, hair, clothes: `regions.region_masks` of the
             reference identity, the pixels no head motion, blink or open jaw takes from the
             region), the mean colour over all frames; per channel |generated - truth| and
             |generated - reference| in /255 units. `colour_error`: the worst region and
             channel against the truth.
  sharpness  Laplacian energy of the frames' luma at the scale of SHARPNESS_SCALE pixels
             (area-averaged down by that factor first), generated over truth. A decoder
             that redraws a 32x-compressed latent keeps little single-pixel detail (the
             shipped VAE's round trip keeps ~0.2 of it, ~0.7 at 4 px, ~0.9 at 6 px, where a
             1.5-pixel Gaussian blur keeps ~0.7), so the full-resolution ratio
             (`sharpness_full`) is reported beside it as a diagnostic, not judged.
  KID        the kernel inception distance in the features of a small network trained on
             the renderer's faces (`feature_net`: it reads the identity's colours and shapes
             and the image's softness): the squared MMD between the generated and the
             truth frames' features with the polynomial kernel k(x, y) = (x.y / d + 1)^3,
             unbiased estimator.

`FidelityReference.make` prepares one clip's truth once (masks, region colours, sharpness,
features); its `score(frames)` gives a `FidelityScore`; `verdict` judges one (or the mean
of several) against `Thresholds`: every region's mean colour within 5/255 of the truth's,
sharpness at least 0.8 of the truth's, KID at most 2x the VAE round trip's (the baseline the
caller measures on the same clips).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from characters_jax.lipsync.regions import REGIONS, region_masks

SHARPNESS_SCALE = 6  # pixels: the frames are area-averaged by this factor before the Laplacian
MIN_REGION_PIXELS = 8  # a region with fewer pixels (short hair at a small size) is not scored
_LUMA = np.asarray([0.299, 0.587, 0.114])


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """colour: largest |mean colour difference| from the truth per region and channel (/255);
    sharpness: least sharpness ratio; kid_factor: KID at most this times the baseline's."""

    colour: float = 5.0
    sharpness: float = 0.8
    kid_factor: float = 2.0


THRESHOLDS = Thresholds()


def _frames(frames) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"frames must be [T, H, W, 3] (T >= 1) or one [H, W, 3] image, got {frames.shape}")
    return frames


def region_colours(frames, masks: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """{region: float64 [3]}: the mean colour (0..255) of each region over all frames
    uint8 [T, H, W, 3]; None for a region of fewer than MIN_REGION_PIXELS pixels."""
    frames = _frames(frames)
    out = {}
    for name, m in masks.items():
        if m.shape != frames.shape[1:3]:
            raise ValueError(f"the {name} mask is {m.shape}, the frames {frames.shape[1:3]}")
        out[name] = frames[:, m].reshape(-1, 3).astype(np.float64).mean(0) if m.sum() >= MIN_REGION_PIXELS else None
    return out


def _area_down(y: np.ndarray, factor: int) -> np.ndarray:
    t, h, w = y.shape
    h, w = h // factor * factor, w // factor * factor
    return y[:, :h, :w].reshape(t, h // factor, factor, w // factor, factor).mean((2, 4))


def laplacian_energy(frames, scale: int = SHARPNESS_SCALE) -> np.ndarray:
    """float64 [T]: mean squared 4-neighbour Laplacian of each frame's luma (0..1), after
    area-averaging by `scale` (1: full resolution)."""
    frames = _frames(frames)
    y = _area_down(frames.astype(np.float64) @ _LUMA / 255.0, scale)
    if min(y.shape[1:]) < 3:
        raise ValueError(f"frames of {frames.shape[1:3]} are too small for the Laplacian at scale {scale}")
    lap = y[:, 1:-1, :-2] + y[:, 1:-1, 2:] + y[:, :-2, 1:-1] + y[:, 2:, 1:-1] - 4.0 * y[:, 1:-1, 1:-1]
    return (lap * lap).mean((1, 2))


def kid(x, y, degree: int = 3) -> float:
    """Unbiased squared MMD between feature sets x [n, d] and y [m, d] (n, m >= 2) with the
    polynomial kernel (a.b / d + 1)^degree (the kernel inception distance)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1] or len(x) < 2 or len(y) < 2:
        raise ValueError(f"kid needs [n, d] and [m, d] features with n, m >= 2, got {x.shape} and {y.shape}")
    d = x.shape[1]
    kxx, kyy, kxy = ((a @ b.T / d + 1.0) ** degree for a, b in ((x, x), (y, y), (x, y)))
    n, m = len(x), len(y)
    return float((kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                 - 2.0 * kxy.mean())


@dataclasses.dataclass(frozen=True)
class FidelityScore:
    """One clip's figures. colour_vs_truth / colour_vs_reference: {region: per-channel
    |difference| of mean colours (/255), or None (region too small)}; colour_error /
    colour_error_reference: their largest entry; sharpness, sharpness_full: Laplacian energy
    ratios (at SHARPNESS_SCALE, at full resolution); kid: KID against the truth's frames."""

    colour_vs_truth: dict
    colour_vs_reference: dict
    colour_error: float
    colour_error_reference: float
    sharpness: float
    sharpness_full: float
    kid: float

    def as_dict(self) -> dict:
        def r(c):
            return None if c is None else [round(float(v), 2) for v in c]

        return {"colour_error": round(self.colour_error, 3), "colour_error_reference": round(self.colour_error_reference, 3),
                "sharpness": round(self.sharpness, 4), "sharpness_full": round(self.sharpness_full, 4),
                "kid": round(self.kid, 5),
                "colour_vs_truth": {k: r(v) for k, v in self.colour_vs_truth.items()},
                "colour_vs_reference": {k: r(v) for k, v in self.colour_vs_reference.items()}}


def _worst(diffs: dict) -> float:
    vals = [float(np.max(v)) for v in diffs.values() if v is not None]
    return max(vals) if vals else float("nan")


def _diffs(a: dict, b: dict) -> dict:
    return {k: None if a[k] is None or b[k] is None else np.abs(a[k] - b[k]) for k in a}


@dataclasses.dataclass(frozen=True)
class FidelityReference:
    """One clip's truth, prepared once: masks {region: bool [H, W]}, the truth's and the
    reference portrait's region colours, the truth's Laplacian energies (at SHARPNESS_SCALE
    and full resolution) and its features [T, d] (None: no feature network, KID NaN)."""

    masks: dict
    truth_colours: dict
    reference_colours: dict
    truth_energy: float
    truth_energy_full: float
    truth_features: np.ndarray | None
    features: object  # the feature network (a Probe), or None

    @classmethod
    def make(cls, identity, truth, reference, features="shipped") -> "FidelityReference":
        """identity float32 [IDENTITY_SIZE]; truth uint8 [T, H, W, 3] (the clip's renders);
        reference uint8 [H, W, 3] (the portrait); features: a feature network (`feature_net`),
        'shipped' (the shipped one) or None (no KID)."""
        from characters_jax.lipsync.feature_net import embed, load_features

        truth = _frames(truth)
        h, w = truth.shape[1:3]
        if np.shape(reference) != (h, w, 3):
            raise ValueError(f"the reference image must be [{h}, {w}, 3] like the truth's frames, got {np.shape(reference)}")
        net = load_features() if isinstance(features, str) and features == "shipped" else features
        masks = region_masks(identity, h, w)
        return cls(masks=masks, truth_colours=region_colours(truth, masks),
                   reference_colours=region_colours(reference, masks),
                   truth_energy=float(laplacian_energy(truth).mean()),
                   truth_energy_full=float(laplacian_energy(truth, 1).mean()),
                   truth_features=None if net is None else embed(net, truth), features=net)

    def score(self, frames) -> FidelityScore:
        """The figures of generated frames uint8 [T', H, W, 3] against this truth."""
        from characters_jax.lipsync.feature_net import embed

        frames = _frames(frames)
        colours = region_colours(frames, self.masks)
        vs_truth, vs_ref = _diffs(colours, self.truth_colours), _diffs(colours, self.reference_colours)
        k = float("nan") if self.features is None else kid(embed(self.features, frames), self.truth_features)
        return FidelityScore(colour_vs_truth=vs_truth, colour_vs_reference=vs_ref, colour_error=_worst(vs_truth),
                             colour_error_reference=_worst(vs_ref),
                             sharpness=float(laplacian_energy(frames).mean() / max(self.truth_energy, 1e-12)),
                             sharpness_full=float(laplacian_energy(frames, 1).mean() / max(self.truth_energy_full, 1e-12)),
                             kid=k)


def summary(scores: list[FidelityScore]) -> dict:
    """Means over clips of colour_error, colour_error_reference, sharpness, sharpness_full
    and kid, and the worst clip's colour_error; per region the mean of its largest channel
    difference against the truth."""
    if not scores:
        raise ValueError("summary needs at least one score")
    out = {k: round(float(np.nanmean([getattr(s, k) for s in scores])), 5)
           for k in ("colour_error", "colour_error_reference", "sharpness", "sharpness_full", "kid")}
    out["colour_error_worst_clip"] = round(float(np.nanmax([s.colour_error for s in scores])), 3)
    out["region_colour_error"] = {}
    for r in REGIONS:
        vals = [float(np.max(s.colour_vs_truth[r])) for s in scores if s.colour_vs_truth.get(r) is not None]
        out["region_colour_error"][r] = round(float(np.mean(vals)), 3) if vals else None
    return out


def verdict(figures: dict, kid_baseline: float | None, thresholds: Thresholds = THRESHOLDS) -> dict:
    """Pass or fail of `summary` figures: {'colour', 'sharpness', 'kid' (None: no baseline or
    no KID), 'pass'} with the limits used. Colour: every region's mean (over clips) of its
    worst channel's difference from the truth."""
    k = figures.get("kid")
    kid_limit = None if kid_baseline is None or not np.isfinite(kid_baseline) else thresholds.kid_factor * max(kid_baseline, 0.0)
    kid_ok = None if kid_limit is None or k is None or not np.isfinite(k) else bool(k <= kid_limit)
    regions = [v for v in figures["region_colour_error"].values() if v is not None]
    out = {"colour": bool(regions) and max(regions) <= thresholds.colour,
           "sharpness": bool(figures["sharpness"] >= thresholds.sharpness), "kid": kid_ok,
           "limits": {"colour": thresholds.colour, "sharpness": thresholds.sharpness,
                      "kid": None if kid_limit is None else round(kid_limit, 5)}}
    out["pass"] = out["colour"] and out["sharpness"] and kid_ok is not False
    return out
