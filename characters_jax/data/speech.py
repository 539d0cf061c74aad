"""Speech with per-phoneme timings from espeak-ng, driven through ctypes.

espeak-ng comes from the PyPI wheel `espeakng-loader` (the optional `train` extra: it
bundles libespeak-ng 1.52 and its data; espeak-ng is GPL-3.0-or-later). Only data and
training code import this module; the serving path never does.

The library keeps synthesis state between calls (the pitch flutter index, the wave
generator's filters), so the same text said twice in one process gives slightly different
samples, and it seeds its noise generator from the clock. Every `EspeakVoice.say`
therefore synthesizes in a forked child of a process that has initialised the library but
never synthesized, with the noise seeded per utterance: each call starts from the same
state and gives the same bytes whatever ran before. The child runs only espeak-ng and
writes raw samples to a pipe (no numpy, no jax), which is what makes the fork safe in a
process with threads.

Output: 16 kHz mono int16 (resampled from espeak's 22,050 Hz with a polyphase filter) and
the phonemes as IPA with start and end times. Linux and macOS (needs os.fork).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pickle
import warnings

import numpy as np

SAMPLE_RATE = 16000  # Hz, the project's audio rate

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INIT_PHONEME_EVENTS = 0x0001
_INIT_PHONEME_IPA = 0x0002
_INIT_DONT_EXIT = 0x8000
_EVENT_LIST_TERMINATED = 0
_EVENT_END = 5
_EVENT_MSG_TERMINATED = 6
_EVENT_PHONEME = 7
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH, _PARAM_RANGE = 1, 2, 3, 4
_CHARS_UTF8 = 1
_POS_CHARACTER = 1


class EspeakError(RuntimeError):
    """espeak-ng is missing, rejected a voice, or failed to synthesize."""


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


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


def library_paths() -> tuple[str, str]:
    """(libespeak-ng path, espeak-ng-data path) from the espeakng-loader wheel."""
    try:
        import espeakng_loader
    except ImportError as err:
        raise EspeakError("espeak-ng is not installed: pip install -e '.[train]' (espeakng-loader)") from err
    return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()


class EspeakVoice:
    """espeak-ng loaded and initialised in this process (synchronous mode, IPA phoneme events).

    One per process is enough; the library is process-global and not thread-safe, so calls
    to `say` from several threads must not overlap.
    """

    def __init__(self):
        lib_path, data_path = library_paths()
        lib = ctypes.CDLL(lib_path)
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_Callback]
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(),
                                     _INIT_PHONEME_EVENTS | _INIT_PHONEME_IPA | _INIT_DONT_EXIT)
        if rate <= 0:
            raise EspeakError(f"espeak_Initialize failed ({rate}) with data at {data_path}")
        self._lib = lib
        self.native_rate = int(rate)  # Hz (22050)

    def say(self, utterances: list[Utterance] | tuple[Utterance, ...]) -> list[Speech]:
        """Each utterance's speech, synthesized from the library's initial state."""
        raw = _run_in_child(self._synthesize, list(utterances))
        return [_to_speech(pcm, events, self.native_rate) for pcm, events in raw]

    def _synthesize(self, utterances: list[Utterance]) -> list[tuple[bytes, list[tuple[int, str, int]]]]:
        """Runs in the child: [(int16 PCM bytes at native_rate, [(event type, phoneme, sample)])]."""
        lib = self._lib
        pcm: list[bytes] = []
        events: list[tuple[int, str, int]] = []

        def on_audio(wav, num, ev):
            i = 0
            while ev[i].type != _EVENT_LIST_TERMINATED:
                e = ev[i]
                name = e.id.string.decode("utf-8", "replace") if e.type == _EVENT_PHONEME else ""
                events.append((e.type, name, e.sample))
                i += 1
            if num > 0:
                pcm.append(ctypes.string_at(wav, 2 * num))
            return 0

        callback = _Callback(on_audio)
        lib.espeak_SetSynthCallback(callback)
        libc = ctypes.CDLL(None)
        out = []
        for u in utterances:
            pcm.clear()
            events.clear()
            if lib.espeak_SetVoiceByName(u.voice.encode()) != 0:
                raise EspeakError(f"espeak-ng has no voice {u.voice!r}")
            for param, value in ((_PARAM_RATE, u.rate), (_PARAM_VOLUME, u.volume), (_PARAM_PITCH, u.pitch),
                                 (_PARAM_RANGE, u.pitch_range)):
                lib.espeak_SetParameter(param, int(value), 0)
            lib.espeak_ng_SetRandSeed(ctypes.c_long(u.noise_seed))  # breath noise (seeded from the clock otherwise)
            libc.srand(ctypes.c_uint(u.noise_seed & 0xFFFFFFFF))  # libc rand(), which the library reads too
            text = u.text.encode()
            status = lib.espeak_Synth(text, len(text) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
            lib.espeak_Synchronize()
            if status != 0:
                raise EspeakError(f"espeak_Synth failed ({status}) on {u.text!r}")
            out.append((b"".join(pcm), list(events)))
        return out


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
    marks = [(name, sample) for kind, name, sample in events if kind == _EVENT_PHONEME and not name.startswith("(")]
    ends = [sample for kind, _, sample in events if kind in (_EVENT_END, _EVENT_MSG_TERMINATED)]
    last = max(ends + [len(x)]) if marks else 0
    phonemes = []
    for k, (name, sample) in enumerate(marks):
        end = marks[k + 1][1] if k + 1 < len(marks) else last
        if name and end > sample:
            phonemes.append(Phoneme(name, sample / native_rate, min(end, len(x)) / native_rate))
    return Speech(audio, tuple(phonemes))


def _run_in_child(fn, arg):
    """fn(arg) in a forked child; its result (or its error) comes back through a pipe."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # The child touches no lock another thread could hold: espeak-ng, ctypes and a pipe.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            os.close(read_fd)
            try:
                payload = pickle.dumps(("ok", fn(arg)))
            except Exception as err:  # reported to the parent
                payload = pickle.dumps(("error", f"{type(err).__name__}: {err}"))
            view = memoryview(payload)
            while view:
                view = view[os.write(write_fd, view):]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as f:
        while block := f.read(1 << 20):
            chunks.append(block)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        raise EspeakError(f"the espeak-ng child exited without a result (status {status})")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "error":
        raise EspeakError(value)
    return value
