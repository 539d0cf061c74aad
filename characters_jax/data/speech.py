"""Speech with per-phoneme timings from espeak-ng.

espeak-ng comes from the PyPI wheel `espeakng-loader` (the optional `train` extra: it
bundles libespeak-ng 1.52 and its data; espeak-ng is GPL-3.0-or-later). Only data and
training code import this module; the serving path never does.

`EspeakVoice.say(utterances)` gives each utterance's speech: 16 kHz mono int16 (resampled
from espeak's 22,050 Hz with a polyphase filter) and its phonemes as IPA with start and end
times. The same call gives the same bytes whatever the process synthesized before (see
`espeak`: each call runs from the library's initial state in a forked child of a clean
helper process). Linux and macOS (needs os.fork).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import weakref

import numpy as np

from characters_jax.data import espeak
from characters_jax.data.espeak import EspeakError

SAMPLE_RATE = 16000  # Hz, the project's audio rate
__all__ = ["SAMPLE_RATE", "EspeakError", "EspeakVoice", "Phoneme", "Speech", "Utterance"]


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One stretch of speech in one voice."""

    text: str
    voice: str  # espeak voice name, optionally with a variant: "en-us+m3"
    rate: int = 175  # words per minute, 80..450
    pitch: int = 50  # base pitch, 0..100
    pitch_range: int = 50  # intonation range, 0..100
    volume: int = 100  # amplitude, 0..200
    noise_seed: int = 0  # seeds espeak-ng's noise sources (its own generator and libc rand())


@dataclasses.dataclass(frozen=True)
class Phoneme:
    """A phoneme (IPA, stress marks kept) and its span in seconds."""

    symbol: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Speech:
    """audio: int16 [N] at SAMPLE_RATE; phonemes in time order, pauses left out."""

    audio: np.ndarray
    phonemes: tuple[Phoneme, ...]

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


class EspeakVoice:
    """Speech synthesis from espeak-ng's initial state at every call.

    mode "helper" (the default) starts a helper process (`python -m characters_jax.data.espeak`:
    no threads, no jax) that forks a child per call; mode "fork" forks from this process
    itself, which must have no other threads at work (a data worker process). `close()` (or
    leaving a `with` block) stops the helper; so does garbage collection.
    """

    def __init__(self, mode: str = "helper"):
        if mode not in ("helper", "fork"):
            raise ValueError(f"mode must be 'helper' or 'fork', got {mode!r}")
        self._lib = None
        self._helper = None
        if mode == "fork":
            self._lib = espeak.Library()
            self.native_rate = self._lib.native_rate
            return
        proc = subprocess.Popen([sys.executable, "-m", "characters_jax.data.espeak"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        self._helper = proc
        self._close = weakref.finalize(self, _stop_helper, proc)
        kind, value = self._receive()
        if kind == "error":
            self.close()
            raise EspeakError(value)
        self.native_rate = int(value)

    @classmethod
    def for_this_process(cls) -> "EspeakVoice":
        """mode "fork" where that is safe here (no jax loaded, no other Python threads: a data
        worker), else "helper"."""
        clean = "jax" not in sys.modules and threading.active_count() == 1
        return cls(mode="fork" if clean else "helper")

    def _receive(self):
        try:
            return espeak.receive(self._helper.stdout)
        except EOFError as err:
            raise EspeakError(f"the espeak-ng helper process exited (status {self._helper.poll()})") from err

    def say(self, utterances: list[Utterance] | tuple[Utterance, ...]) -> list[Speech]:
        """Each utterance's speech (synthesized in order, from the initial state at every call)."""
        requests = [dataclasses.astuple(u) for u in utterances]
        if self._lib is not None:
            raw = self._lib.isolated(requests)
        else:
            if self._helper is None:
                raise EspeakError("this EspeakVoice is closed")
            try:
                espeak.send(self._helper.stdin, requests)
            except (BrokenPipeError, OSError) as err:
                raise EspeakError("the espeak-ng helper process is gone") from err
            kind, raw = self._receive()
            if kind == "error":
                raise EspeakError(raw)
        return [_to_speech(pcm, events, self.native_rate) for pcm, events in raw]

    def close(self) -> None:
        if self._helper is not None:
            self._close()
            self._helper = None

    def __enter__(self) -> "EspeakVoice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_helper(proc) -> None:
    try:
        espeak.send(proc.stdin, None)
        proc.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def _to_speech(pcm: bytes, events: list[tuple[int, str, int]], native_rate: int) -> Speech:
    """16 kHz audio and phoneme spans from the child's raw output."""
    from scipy.signal import resample_poly

    x = np.frombuffer(pcm, np.int16).astype(np.float64)
    n_out = -(-len(x) * SAMPLE_RATE // native_rate)
    g = np.gcd(SAMPLE_RATE, native_rate)
    y = resample_poly(x, SAMPLE_RATE // g, native_rate // g)[:n_out] if len(x) else np.zeros(0)
    audio = np.clip(np.rint(y), -32768, 32767).astype(np.int16)
    # A phoneme lasts until the next phoneme event (pauses included) or the end of the text;
    # "(en)"-style events mark a switch of language, not a sound.
    marks = [(name, sample) for kind, name, sample in events
             if kind == espeak.EVENT_PHONEME and not name.startswith("(")]
    ends = [sample for kind, _, sample in events if kind in (espeak.EVENT_END, espeak.EVENT_MSG_TERMINATED)]
    last = max(ends + [len(x)]) if marks else 0
    phonemes = []
    for k, (name, sample) in enumerate(marks):
        end = marks[k + 1][1] if k + 1 < len(marks) else last
        if name and end > sample:
            phonemes.append(Phoneme(name, sample / native_rate, min(end, len(x)) / native_rate))
    return Speech(audio, tuple(phonemes))
