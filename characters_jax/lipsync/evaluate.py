"""Figures of the measure on held-out clips, and scoring of a data directory.

`evaluate` makes held-out clips (espeak-ng speech, held-out identities, voices and words),
renders them and reports: the mouth probe's per-clip correlation with the ground-truth jaw
(clean and degraded frames), the score of the ground-truth renders, of the same renders
against another clip's track (shuffled audio) and of renders shifted 3 frames late, and the
identity probe's identification of held-out identities among each other.
"""

from __future__ import annotations

import numpy as np

from characters_jax.lipsync.score import MAX_LAG, probe_track, score, sync_score

SHIFT = 3


def _summary(values) -> dict:
    v = np.asarray(values, np.float64)
    return {"mean": round(float(v.mean()), 4), "min": round(float(v.min()), 4), "max": round(float(v.max()), 4)}


def shifted_late(params: np.ndarray, frames: int) -> np.ndarray:
    """params [T, F] delayed by `frames`: row t holds row t - frames (the first rows repeat row 0)."""
    idx = np.clip(np.arange(len(params)) - frames, 0, None)
    return params[idx]


def evaluate(clips: int = 24, seconds: float = 8.0, height: int = 64, width: int = 96, seed: int = 0,
             identities: int = 24, mouth_probe=None, identity_probe=None) -> dict:
    """The measure's figures on `clips` held-out clips and `identities` held-out identities."""
    from characters_jax.data import motion
    from characters_jax.data.clips import ClipSpec, plan_clip, render_plans
    from characters_jax.data.face import render_batch
    from characters_jax.data.speech import EspeakVoice
    from characters_jax.lipsync.identity import identify
    from characters_jax.lipsync.probe import load_probe
    from characters_jax.lipsync.train import degraded

    mouth = mouth_probe if mouth_probe is not None else load_probe("mouth")
    ident_probe = identity_probe if identity_probe is not None else load_probe("identity")
    spec = ClipSpec(seconds=seconds, height=height, width=width)
    voice = EspeakVoice()
    plans = [plan_clip("heldout", i, spec, seed, voice) for i in range(max(clips, identities))]
    rendered = render_plans(plans, height, width)
    late = render_batch(np.stack([p.identity for p in plans[:clips]]),
                        np.stack([shifted_late(p.params, SHIFT) for p in plans[:clips]]), height, width)

    corr, corr_degraded, gt, shuffled, shift = [], [], [], [], []
    for i, clip in enumerate(rendered[:clips]):
        jaw = clip.plan.track[:, 0]
        corr.append(sync_score(probe_track(clip.frames, mouth), jaw, 0).peak)
        corr_degraded.append(sync_score(probe_track(degraded(clip.frames, seed + i), mouth), jaw, 0).peak)
        gt.append(score(clip.frames, jaw, mouth))
        shuffled.append(score(clip.frames, rendered[(i + 1) % clips].plan.track, mouth))
        shift.append(score(late[i], jaw, mouth))

    refs = []
    for p in plans[:identities]:
        still = motion.still(1)
        refs.append(render_batch(p.identity[None], still[None], height, width)[0, 0])
    matches = [identify(c.frames, np.stack(refs), ident_probe) for c in rendered[:identities]]
    top1 = [m.index == i for i, m in enumerate(matches)]
    own = [float(m.distances[i]) for i, m in enumerate(matches)]
    others = [float(np.delete(m.distances, i).min()) for i, m in enumerate(matches)]
    return {
        "clips": clips, "seconds": spec.num_frames / spec.fps, "frames": spec.num_frames, "size": [height, width],
        "seed": seed, "max_lag": MAX_LAG,
        "mouth_probe_corr": _summary(corr), "mouth_probe_corr_degraded": _summary(corr_degraded),
        "gt": {"peak": _summary([s.peak for s in gt]), "confidence": _summary([s.confidence for s in gt]),
               "lags": [s.lag for s in gt]},
        "shuffled": {"peak": _summary([s.peak for s in shuffled]),
                     "confidence": _summary([s.confidence for s in shuffled])},
        f"shift_{SHIFT}_late": {"peak": _summary([s.peak for s in shift]), "lags": [s.lag for s in shift]},
        "identity": {"identities": identities, "top1": float(np.mean(top1)), "own_distance": _summary(own),
                     "nearest_other_distance": _summary(others)},
    }


def score_directory(directory, max_lag: int = MAX_LAG, probe=None) -> dict:
    """Scores every clip of a data directory (its frames against its own mouth track)."""
    from characters_jax.data.shards import ShardReader
    from characters_jax.lipsync.probe import load_probe

    reader = ShardReader(directory)
    probe = probe if probe is not None else load_probe("mouth")
    scores = [score(c.frames, c.plan.track, probe, max_lag) for c in reader]
    return {"clips": len(scores), "peak": _summary([s.peak for s in scores]),
            "confidence": _summary([s.confidence for s in scores]), "lags": [s.lag for s in scores]}
