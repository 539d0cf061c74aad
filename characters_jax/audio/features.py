"""Log-mel audio features in JAX, pooled into the generator's audio tokens.

For step s the front end looks at a fixed-length window that ENDS at the last sample of
the step's frames (Timeline.step_span(s)[1]) and reaches back a little into the previous
step (the STFT's context): no look-ahead, so frame k of the output only ever depends on
audio up to the end of its own step, and the step's tokens describe exactly the audio its
frames carry. One fixed window length means one compiled program for the whole session.

Shapes: window [window_samples] float32 in [-1, 1) -> mel frames [n_frames, n_mels] ->
tokens [audio_tokens_per_step, audio_feature_dim] float32 (n_mels == audio_feature_dim).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.audio.timeline import Timeline
from characters_jax.config import Config, ConfigError


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def _mel_to_hz(m):
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """HTK-style triangular mel filters, area-normalised. Returns [n_fft // 2 + 1, n_mels] float32."""
    n_bins = n_fft // 2 + 1
    freqs = np.linspace(0.0, sample_rate / 2, n_bins)
    mels = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2)
    edges = _mel_to_hz(mels)
    fb = np.zeros((n_bins, n_mels))
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        up = (freqs - lo) / max(mid - lo, 1e-9)
        down = (hi - freqs) / max(hi - mid, 1e-9)
        fb[:, m] = np.maximum(0.0, np.minimum(up, down)) * (2.0 / max(hi - lo, 1e-9))
    return fb.astype(np.float32)


def pooling_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] rows that average n_in frames into n_out equal spans (fractional overlap)."""
    out = np.zeros((n_out, n_in), dtype=np.float64)
    for j in range(n_out):
        a, b = j * n_in / n_out, (j + 1) * n_in / n_out
        for i in range(int(math.floor(a)), int(math.ceil(b))):
            out[j, i] = max(0.0, min(b, i + 1) - max(a, i))
        out[j] /= out[j].sum()
    return out.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class FrontEndSpec:
    """Static shapes of the front end for one config."""

    sample_rate: int
    n_fft: int
    hop: int
    n_mels: int
    n_frames: int  # STFT frames per step window
    window_samples: int  # = n_fft + hop * (n_frames - 1)
    tokens: int  # audio tokens per step

    @classmethod
    def from_config(cls, cfg: Config) -> "FrontEndSpec":
        a, m = cfg.audio, cfg.model
        if a.n_mels != m.audio_feature_dim:
            raise ConfigError(f"audio.n_mels: must equal model.audio_feature_dim={m.audio_feature_dim}, got {a.n_mels}")
        if a.hop_length <= 0 or a.n_fft < a.hop_length:
            raise ConfigError(f"audio.hop_length: must be in (0, n_fft={a.n_fft}], got {a.hop_length}")
        step = Timeline.from_config(cfg).max_step_samples
        n_frames = max(m.audio_tokens_per_step, -(-step // a.hop_length))
        return cls(a.sample_rate, a.n_fft, a.hop_length, a.n_mels, n_frames, a.n_fft + a.hop_length * (n_frames - 1), m.audio_tokens_per_step)


def log_mel(window: jax.Array, mel_fb: jax.Array, spec: FrontEndSpec) -> jax.Array:
    """[window_samples] f32 -> [n_frames, n_mels] f32 log10-mel, floored at 1e-8 and scaled ~[-1, 1]."""
    idx = jnp.arange(spec.n_frames)[:, None] * spec.hop + jnp.arange(spec.n_fft)[None, :]
    frames = window[idx] * jnp.hanning(spec.n_fft + 1)[:-1].astype(jnp.float32)
    power = jnp.abs(jnp.fft.rfft(frames, axis=-1)) ** 2
    mel = power @ mel_fb
    return (jnp.log10(jnp.maximum(mel, 1e-8)) + 4.0) / 4.0


class AudioFrontEnd:
    """Turns step windows into audio tokens; one compiled program per config.

    `window(pcm, s)` cuts the host-side window of step s out of the samples received so far
    (zeros before the start and after the end of the audio); `tokens(window)` runs on the
    device and returns [tokens, n_mels] float32 (asynchronously dispatched).
    """

    def __init__(self, cfg: Config):
        self.spec = FrontEndSpec.from_config(cfg)
        self.timeline = Timeline.from_config(cfg)
        fb = jnp.asarray(mel_filterbank(self.spec.sample_rate, self.spec.n_fft, self.spec.n_mels))
        pool = jnp.asarray(pooling_matrix(self.spec.n_frames, self.spec.tokens))
        spec = self.spec

        def _tokens(window):
            return pool @ log_mel(window, fb, spec)

        self._tokens = jax.jit(_tokens)

    def window_bounds(self, s: int) -> tuple[int, int]:
        """[start, end) samples of step s's window; start may be negative (zeros before the audio)."""
        end = self.timeline.step_span(s)[1]
        return end - self.spec.window_samples, end

    def window(self, read, s: int) -> np.ndarray:
        """Step s's window [window_samples] float32 in [-1, 1).

        read(lo, hi) -> int16 samples [lo, hi) received so far (may be shorter at the end of
        the audio); the window is zero before sample 0 and after the last sample."""
        start, end = self.window_bounds(s)
        out = np.zeros(self.spec.window_samples, dtype=np.float32)
        pcm = np.asarray(read(max(start, 0), end))
        lo = max(start, 0) - start
        out[lo : lo + len(pcm)] = pcm.astype(np.float32) / 32768.0
        return out

    def tokens(self, window: np.ndarray) -> jax.Array:
        """[window_samples] float32 -> [audio_tokens_per_step, audio_feature_dim] float32."""
        return self._tokens(window)
