"""Lip sync of generated frames: the mouth probe's jaw track against the ground-truth track.

`score(frames, gt_track)` reads the frames alone (uint8 [T, H, W, 3]), predicts the jaw
opening of each with the mouth probe, and correlates that track with the ground truth's
jaw over lags -max_lag..+max_lag frames (Pearson, over the frames both tracks cover at that
lag). Sign: a positive lag means the video is late, video frame t showing the mouth of
ground-truth frame t - lag. Peak: the largest correlation; lag: where it is; confidence:
peak minus the median over lags (as SyncNet's LSE-C); of tied lags the one nearest 0. A
constant track (silence, a frozen face) correlates 0 at every lag: peak 0, lag 0, no NaN.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_LAG = 15
_FLAT = 1e-6  # standard deviation below which a track counts as constant


@dataclasses.dataclass(frozen=True)
class SyncScore:
    """peak, lag (frames, positive = video late), confidence; correlations float32 [2 max_lag + 1]
    at lags -max_lag..max_lag."""

    peak: float
    lag: int
    confidence: float
    correlations: np.ndarray

    @property
    def max_lag(self) -> int:
        return (len(self.correlations) - 1) // 2

    def as_dict(self) -> dict:
        return {"peak": self.peak, "lag": self.lag, "confidence": self.confidence,
                "correlations": [round(float(c), 5) for c in self.correlations]}


def _jaw(track) -> np.ndarray:
    t = np.asarray(track, np.float64)
    if t.ndim == 2:
        t = t[:, 0]
    if t.ndim != 1:
        raise ValueError(f"a track must be [T] or [T, 2] (jaw first), got shape {np.shape(track)}")
    return t


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    sa, sb = np.sqrt((a * a).mean()), np.sqrt((b * b).mean())
    if sa < _FLAT or sb < _FLAT:
        return 0.0
    return float((a * b).mean() / (sa * sb))


def lag_correlations(video_track, gt_track, max_lag: int = MAX_LAG) -> np.ndarray:
    """float32 [2 max_lag + 1]: corr(video[t], gt[t - lag]) for lag = -max_lag..max_lag."""
    v, g = _jaw(video_track), _jaw(gt_track)
    if len(v) != len(g):
        raise ValueError(f"tracks differ in length: {len(v)} video frames, {len(g)} ground-truth frames")
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    if len(v) < 2 * max_lag + 2:
        raise ValueError(f"{len(v)} frames are too few for lags up to {max_lag} (need at least {2 * max_lag + 2})")
    n = len(v)
    out = [_pearson(v[lag:], g[:n - lag]) if lag >= 0 else _pearson(v[:n + lag], g[-lag:])
           for lag in range(-max_lag, max_lag + 1)]
    return np.asarray(out, np.float32)


def sync_score(video_track, gt_track, max_lag: int = MAX_LAG) -> SyncScore:
    """Peak, lag and confidence of two jaw tracks ([T] or [T, 2])."""
    c = lag_correlations(video_track, gt_track, max_lag)
    lags = np.arange(-max_lag, max_lag + 1)
    best = np.flatnonzero(c == c.max())
    i = int(best[np.argmin(np.abs(lags[best]))])  # ties (a constant track): the smallest |lag|
    return SyncScore(peak=float(c[i]), lag=int(lags[i]), confidence=float(c[i] - np.median(c)), correlations=c)


def probe_track(frames, probe=None) -> np.ndarray:
    """float32 [T]: the mouth probe's jaw opening of each frame (uint8 [T, H, W, 3])."""
    from characters_jax.lipsync.probe import load_probe

    probe = probe if probe is not None else load_probe("mouth")
    return probe.predict(frames)[:, probe.cfg.targets.index("jaw")]


def score(frames, gt_track, probe=None, max_lag: int = MAX_LAG) -> SyncScore:
    """Lip sync of frames uint8 [T, H, W, 3] against the ground-truth track [T] or [T, 2]."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got {frames.shape}")
    if len(frames) != len(_jaw(gt_track)):
        raise ValueError(f"{len(frames)} frames but a ground-truth track of {len(_jaw(gt_track))}")
    return sync_score(probe_track(frames, probe), gt_track, max_lag)
