"""The demo's bundled inputs, made by the project (no downloads): a drawn portrait and a
speech-like clip from a small source-filter synthesizer (glottal pulses through vowel
formant resonators, syllable envelopes, fricative noise, a falling intonation).

`python -m characters_jax.demo.assets` regenerates `assets/portrait.png` and
`assets/speech.wav` (16 kHz mono s16le); the output is deterministic.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

ASSET_DIR = pathlib.Path(__file__).resolve().parent / "assets"
PORTRAIT = ASSET_DIR / "portrait.png"
SPEECH = ASSET_DIR / "speech.wav"

# (F1, F2, F3) Hz of a few vowels
_VOWELS = {"a": (730, 1090, 2440), "e": (530, 1840, 2480), "i": (270, 2290, 3010), "o": (570, 840, 2410), "u": (300, 870, 2240)}


def make_portrait(width: int = 384, height: int = 256):
    """A front-facing cartoon face on a soft background. Returns a PIL image (RGB)."""
    from PIL import Image, ImageDraw, ImageFilter

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    bg = np.stack([40 + 60 * y / height, 70 + 50 * x / width, 110 + 40 * (1 - y / height)], -1)
    img = Image.fromarray(bg.clip(0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    cx, cy = width // 2, int(height * 0.55)
    d.ellipse([cx - 95, cy - 150, cx + 95, cy + 20], fill=(60, 38, 30))  # hair
    d.rectangle([cx - 40, cy + 60, cx + 40, height], fill=(205, 160, 130))  # neck
    d.ellipse([cx - 140, cy + 100, cx + 140, cy + 260], fill=(50, 90, 140))  # shoulders
    d.ellipse([cx - 78, cy - 115, cx + 78, cy + 95], fill=(232, 188, 155))  # face
    d.ellipse([cx - 92, cy - 25, cx - 72, cy + 15], fill=(220, 172, 140))  # ears
    d.ellipse([cx + 72, cy - 25, cx + 92, cy + 15], fill=(220, 172, 140))
    d.chord([cx - 82, cy - 125, cx + 82, cy - 20], 180, 360, fill=(60, 38, 30))  # fringe
    for sx in (-1, 1):
        ex = cx + sx * 32
        d.ellipse([ex - 16, cy - 22, ex + 16, cy - 2], fill=(250, 250, 250))
        d.ellipse([ex - 7, cy - 19, ex + 7, cy - 5], fill=(70, 110, 60))
        d.ellipse([ex - 3, cy - 15, ex + 3, cy - 9], fill=(10, 10, 10))
        d.line([ex - 18, cy - 34, ex + 16, cy - 38 + (4 if sx > 0 else 0)], fill=(50, 30, 25), width=4)  # brows
    d.polygon([(cx, cy - 5), (cx - 10, cy + 28), (cx + 8, cy + 30)], fill=(215, 165, 135))  # nose
    d.chord([cx - 30, cy + 35, cx + 30, cy + 68], 0, 180, fill=(160, 60, 70))  # mouth
    d.line([cx - 30, cy + 51, cx + 30, cy + 51], fill=(110, 40, 50), width=2)
    return img.filter(ImageFilter.SMOOTH)


def _resonator(x: np.ndarray, f: float, bw: float, sr: int) -> np.ndarray:
    """Second-order IIR band-pass (one formant)."""
    r = math.exp(-math.pi * bw / sr)
    a1, a2 = -2 * r * math.cos(2 * math.pi * f / sr), r * r
    g = 1 - r
    y = np.zeros_like(x)
    y1 = y2 = 0.0
    for n, xn in enumerate(x):
        yn = g * xn - a1 * y1 - a2 * y2
        y[n] = yn
        y2, y1 = y1, yn
    return y


def make_speech(seconds: float = 3.0, sr: int = 16000, seed: int = 7) -> np.ndarray:
    """Speech-like audio: int16 mono [seconds * sr]."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    out = np.zeros(n, np.float64)
    syllables = "a e i o a u e o i a e u o a".split()
    pos = int(0.15 * sr)
    for k, v in enumerate(syllables):
        dur = int(rng.uniform(0.14, 0.24) * sr)
        if pos + dur >= n - int(0.1 * sr):
            break
        seg_t = t[pos : pos + dur]
        f0 = 165 - 45 * (pos / n) + 12 * np.sin(2 * np.pi * 3 * seg_t)  # falling intonation
        phase = np.cumsum(f0 / sr)
        pulses = (np.diff(np.floor(phase), prepend=np.floor(phase[0])) > 0).astype(np.float64)
        src = np.convolve(pulses, np.exp(-np.arange(64) / 8.0))[:dur]  # glottal pulse shape
        voiced = sum(_resonator(src, f, 80 + 0.05 * f, sr) * (1.0 / (i + 1)) for i, f in enumerate(_VOWELS[v]))
        env = np.sin(np.pi * np.linspace(0, 1, dur)) ** 0.7
        out[pos : pos + dur] += voiced * env
        if k % 3 == 1:  # a fricative before the next syllable
            fl = int(0.07 * sr)
            noise = rng.standard_normal(fl)
            fric = _resonator(noise, 4500, 1500, sr) * np.hanning(fl) * 0.3
            end = min(n, pos + dur + fl)
            out[pos + dur : end] += fric[: end - pos - dur]
            dur += fl
        pos += dur + int(rng.uniform(0.02, 0.12) * sr) + (int(0.25 * sr) if k == 6 else 0)
    out /= max(np.abs(out).max(), 1e-9)
    return (out * 0.8 * 32767).astype(np.int16)


def main() -> None:
    from characters_jax.audio.pcm import write_wav

    ASSET_DIR.mkdir(exist_ok=True)
    make_portrait().save(PORTRAIT, optimize=True)
    write_wav(SPEECH, make_speech())
    for p in (PORTRAIT, SPEECH):
        print(f"{p.relative_to(ASSET_DIR.parent.parent.parent)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
