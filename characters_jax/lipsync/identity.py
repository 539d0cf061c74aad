"""Identity of generated frames, read by the identity probe (the renderer's parameters).

A clip's descriptor is the probe's standardised identity parameters (colours of skin,
hair, clothes, background, eyes and lips; face and hair shape) averaged over its frames.
The distance between two descriptors is a weighted RMS, each parameter weighted by how well
the probe reads it (the weights ship with the probe). `identify` says which of several
references (portraits) a clip is nearest to; `identity_distance` is the continuous measure.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class IdentityMatch:
    """index: the nearest reference; distances: float32 [R] to every reference."""

    index: int
    distances: np.ndarray

    def rank_of(self, reference: int) -> int:
        """0 when `reference` is the nearest, 1 when it is second, ..."""
        return int(np.sum(self.distances < self.distances[reference]))


def _probe(probe):
    from characters_jax.lipsync.probe import load_probe

    return probe if probe is not None else load_probe("identity")


def _frames(frames) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3] (or one [H, W, 3] image), got {frames.shape}")
    return frames


def describe(frames, probe=None) -> np.ndarray:
    """float32 [IDENTITY_SIZE]: the standardised identity of frames [T, H, W, 3] (or an image)."""
    return _probe(probe).predict_standardised(_frames(frames)).mean(0)


def descriptor_distance(a, b, probe=None) -> float:
    """Weighted RMS distance between two descriptors (standardised units)."""
    w = np.asarray(_probe(probe).cfg.weights, np.float64)
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.sqrt((w * d * d).sum() / w.sum()))


def identity_distance(frames, reference, probe=None) -> float:
    """How far frames [T, H, W, 3] look from the reference image [H', W', 3] (0 = same)."""
    probe = _probe(probe)
    return descriptor_distance(describe(frames, probe), describe(reference, probe), probe)


def identify(frames, references, probe=None) -> IdentityMatch:
    """Which of the references ([R, H', W', 3] images, or a list of frame stacks) frames look like."""
    probe = _probe(probe)
    clip = describe(frames, probe)
    refs = [describe(r, probe) for r in references] if isinstance(references, (list, tuple)) else \
        list(probe.predict_standardised(_frames(references)))
    if not refs:
        raise ValueError("identify needs at least one reference")
    w = np.asarray(probe.cfg.weights, np.float64)
    d = np.stack(refs).astype(np.float64) - clip
    dist = np.sqrt((w * d * d).sum(1) / w.sum()).astype(np.float32)
    return IdentityMatch(int(np.argmin(dist)), dist)
