"""The one audio format the service accepts: 16 kHz mono PCM, signed 16-bit little-endian.

`check_format` names what is wrong with any other declaration; `read_wav` loads a WAV file
for the client and reports its real format (the worker, not the client, refuses it).
"""

from __future__ import annotations

import dataclasses
import io
import wave

import numpy as np

SAMPLE_RATE = 16000
CHANNELS = 1
SAMPLE_BYTES = 2


class AudioFormatError(ValueError):
    """The audio is not 16 kHz mono PCM s16le; the message says what it is instead."""


@dataclasses.dataclass(frozen=True)
class PcmFormat:
    sample_rate_hz: int
    channels: int
    encoding: str  # "s16le" | "f32le" | "unknown"


def check_format(fmt: PcmFormat, expected_rate: int = SAMPLE_RATE) -> None:
    """Raises AudioFormatError unless fmt is `expected_rate` Hz mono s16le."""
    problems = []
    if fmt.sample_rate_hz != expected_rate:
        problems.append(f"sample rate {fmt.sample_rate_hz} Hz (need {expected_rate})")
    if fmt.channels != CHANNELS:
        problems.append(f"{fmt.channels} channels (need 1, mono)")
    if fmt.encoding != "s16le":
        problems.append(f"encoding {fmt.encoding} (need PCM signed 16-bit little-endian)")
    if problems:
        raise AudioFormatError("audio must be 16 kHz mono PCM s16le; got " + ", ".join(problems))


def pcm_to_int16(data: bytes) -> np.ndarray:
    """bytes (s16le) -> [n] int16. Raises AudioFormatError on a partial sample."""
    if len(data) % SAMPLE_BYTES:
        raise AudioFormatError(f"audio chunk of {len(data)} bytes is not a whole number of 16-bit samples")
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


def read_wav(path_or_bytes) -> tuple[np.ndarray, PcmFormat]:
    """Reads a PCM WAV. Returns (samples [n, channels] as stored, int16 or other, format)."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray)) else path_or_bytes
    with wave.open(src, "rb") as w:
        rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        raw = w.readframes(w.getnframes())
    enc = {2: "s16le"}.get(width, f"pcm{8 * width}")
    dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}.get(width, np.uint8)
    samples = np.frombuffer(raw, dtype=dtype).reshape(-1, channels)
    return samples, PcmFormat(rate, channels, enc)


def write_wav(path, samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Writes [n] int16 mono samples as a WAV file."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.asarray(samples, dtype="<i2").tobytes())
