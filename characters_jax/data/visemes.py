"""Phonemes -> mouth targets -> a causal per-frame mouth track.

A mouth state is (jaw, width): jaw opening in [0, 1] (0 closed lips, 1 wide open) and lip
width in [0, 1] (0 rounded/protruded, 0.5 neutral, 1 spread). IPA symbols map to targets by
their place on the vowel chart (height -> jaw, rounding/frontness -> width) and by place of
articulation for consonants (bilabials close the lips, labiodentals nearly, /w/ rounds).

The track at frame k is built from audio up to the end of k's own chunk of
`chunk` frames, nothing later: the per-frame target averages the targets over the frame's
span (pauses count as the closed rest state), anticipation looks ahead at most
`lookahead` frames and never past the chunk's last frame, and the smoothing is a causal
one-pole filter. A generator that sees one chunk's audio per step can therefore produce
exactly this track.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Sequence

import numpy as np

from characters_jax.data.speech import Phoneme

REST = (0.0, 0.5)  # closed, neutral: silence

# IPA vowels: (jaw, width)
_VOWELS = {
    "i": (0.25, 0.95), "y": (0.25, 0.10), "ɨ": (0.28, 0.60), "ʉ": (0.28, 0.15), "ɯ": (0.28, 0.70), "u": (0.28, 0.05),
    "ɪ": (0.32, 0.85), "ʏ": (0.32, 0.15), "ʊ": (0.35, 0.20), "ᵻ": (0.30, 0.70),
    "e": (0.45, 0.85), "ø": (0.45, 0.15), "ɘ": (0.45, 0.60), "ɵ": (0.45, 0.20), "ɤ": (0.48, 0.60), "o": (0.48, 0.10),
    "ə": (0.45, 0.50), "ɚ": (0.45, 0.40), "ɝ": (0.50, 0.40),
    "ɛ": (0.62, 0.75), "œ": (0.62, 0.20), "ɜ": (0.55, 0.50), "ɞ": (0.55, 0.25), "ʌ": (0.65, 0.50), "ɔ": (0.68, 0.20),
    "æ": (0.80, 0.75), "ɐ": (0.72, 0.50),
    "a": (0.92, 0.60), "ɶ": (0.88, 0.25), "ɑ": (1.00, 0.50), "ɒ": (0.90, 0.25),
}
_CONSONANTS = {
    **dict.fromkeys("pbmɓʙ", (0.0, 0.50)),  # bilabial: lips closed
    **dict.fromkeys("ɸβ", (0.06, 0.40)),
    **dict.fromkeys("fvɱʋ", (0.10, 0.55)),  # labiodental
    **dict.fromkeys("wʍɥ", (0.15, 0.05)),  # rounded approximants
    **dict.fromkeys("θð", (0.20, 0.55)),
    **dict.fromkeys("tdnlɾrɹɬɮɺ", (0.18, 0.60)),  # alveolar
    **dict.fromkeys("szʦʣ", (0.12, 0.65)),
    **dict.fromkeys("ʃʒɕʑ", (0.15, 0.25)),  # postalveolar: protruded
    **dict.fromkeys("ʈɖɳɭʂʐɻ", (0.20, 0.50)),
    **dict.fromkeys("jçʝɲʎcɟ", (0.20, 0.72)),  # palatal
    **dict.fromkeys("kgɡŋxɣɰ", (0.30, 0.55)),  # velar
    **dict.fromkeys("qɢɴχʁʀ", (0.35, 0.50)),  # uvular
    **dict.fromkeys("ħʕhɦʔ?", (0.40, 0.50)),  # pharyngeal, glottal
}
_DEFAULT_CONSONANT = (0.20, 0.55)
_STRESS = "ˈˌ"
_STRESS_GAIN = 1.15
_IGNORED = set("ːˑ:‿͜͡-_'")


@dataclasses.dataclass(frozen=True)
class MouthDynamics:
    """How targets become a track. lookahead: frames of anticipation (clipped at the chunk's end);
    smoothing: the causal filter's weight of the previous frame (0: none)."""

    lookahead: int = 1
    smoothing: float = 0.45
    chunk: int = 4


def phoneme_targets(symbol: str) -> list[tuple[float, float]]:
    """The (jaw, width) targets of one IPA phoneme, in order ("aɪ" -> two; "ˈa" stressed)."""
    stressed = any(c in _STRESS for c in symbol)
    out = []
    for ch in unicodedata.normalize("NFD", symbol):
        if ch in _STRESS or ch in _IGNORED or unicodedata.combining(ch) or unicodedata.category(ch) == "Lm" \
                or ch.isspace():
            continue
        if ch in _VOWELS:
            jaw, width = _VOWELS[ch]
            out.append((min(1.0, jaw * _STRESS_GAIN) if stressed else jaw, width))
        else:
            out.append(_CONSONANTS.get(ch, _DEFAULT_CONSONANT))
    return out


def segments(phonemes: Sequence[Phoneme]) -> np.ndarray:
    """float64 [S, 4] rows (start_s, end_s, jaw, width): each phoneme's span split evenly among its targets."""
    rows = []
    for p in phonemes:
        targets = phoneme_targets(p.symbol)
        if not targets or p.end <= p.start:
            continue
        step = (p.end - p.start) / len(targets)
        rows += [(p.start + i * step, p.start + (i + 1) * step, jaw, width) for i, (jaw, width) in enumerate(targets)]
    return np.asarray(rows, np.float64).reshape(-1, 4)


def frame_targets(phonemes: Sequence[Phoneme], num_frames: int, fps: int) -> np.ndarray:
    """float64 [T, 2]: each frame's (jaw, width) target, the time-weighted mean over [k/fps, (k+1)/fps)
    (time that no phoneme covers counts as REST)."""
    seg = segments(phonemes)
    k = np.arange(num_frames, dtype=np.float64)
    lo, hi = k / fps, (k + 1) / fps
    overlap = np.clip(np.minimum(hi[:, None], seg[None, :, 1]) - np.maximum(lo[:, None], seg[None, :, 0]), 0, None)
    covered = np.clip(overlap.sum(1) * fps, 0.0, 1.0)
    mean = overlap @ seg[:, 2:] * fps
    return mean + (1.0 - covered)[:, None] * np.asarray(REST)


def mouth_track(phonemes: Sequence[Phoneme], num_frames: int, fps: int = 24,
                dynamics: MouthDynamics = MouthDynamics(), jaw_scale: float = 1.0) -> np.ndarray:
    """float32 [T, 2] (jaw, width) per frame: frame k depends on phonemes before the end of its chunk only."""
    raw = frame_targets(phonemes, num_frames, fps)
    ahead = np.empty_like(raw)
    for k in range(num_frames):
        last = min(k + dynamics.lookahead, (k // dynamics.chunk + 1) * dynamics.chunk - 1, num_frames - 1)
        ahead[k] = raw[k:last + 1].mean(0)
    out = np.empty_like(raw)
    prev = np.asarray(REST, np.float64)
    for k in range(num_frames):
        prev = dynamics.smoothing * prev + (1.0 - dynamics.smoothing) * ahead[k]
        out[k] = prev
    out[:, 0] = np.clip(out[:, 0] * jaw_scale, 0.0, 1.0)
    return out.astype(np.float32)
