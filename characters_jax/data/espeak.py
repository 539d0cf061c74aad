"""libespeak-ng through ctypes, synthesizing each request from the library's initial state.

The library keeps synthesis state between calls (the pitch flutter index, the wave
generator's filters) and seeds its noise from the clock, so the same text said twice in one
process gives different samples. `isolated` therefore synthesizes in a forked child of a
process that has initialised the library but never synthesized, with the noise seeded per
utterance: every request starts from the same state and gives the same bytes.

A fork is only safe from a process without other threads at work: `python -m
characters_jax.data.espeak` is a helper process made for that (it imports nothing but this
module: no numpy, no jax; it serves requests on stdin/stdout); `speech.EspeakVoice` starts
and talks to it. A process that is itself clean (a data worker) may call `isolated` directly.

Requests are tuples (text, voice, rate, pitch, pitch_range, volume, noise_seed); results are
(int16 little-endian PCM bytes at the native rate, [(event type, phoneme name, sample)]).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import warnings

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INIT_PHONEME_EVENTS = 0x0001
_INIT_PHONEME_IPA = 0x0002
_INIT_DONT_EXIT = 0x8000
EVENT_LIST_TERMINATED = 0
EVENT_END = 5
EVENT_MSG_TERMINATED = 6
EVENT_PHONEME = 7
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH, _PARAM_RANGE = 1, 2, 3, 4
_CHARS_UTF8 = 1
_POS_CHARACTER = 1


class EspeakError(RuntimeError):
    """espeak-ng is missing, rejected a voice, or failed to synthesize."""


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


class Library:
    """libespeak-ng loaded and initialised in this process (synchronous, IPA phoneme events)."""

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

    def synthesize(self, requests: list[tuple]) -> list[tuple[bytes, list[tuple[int, str, int]]]]:
        """The requests in order, in this process (its state carries from one to the next)."""
        lib = self._lib
        pcm: list[bytes] = []
        events: list[tuple[int, str, int]] = []

        def on_audio(wav, num, ev):
            i = 0
            while ev[i].type != EVENT_LIST_TERMINATED:
                e = ev[i]
                name = e.id.string.decode("utf-8", "replace") if e.type == EVENT_PHONEME else ""
                events.append((e.type, name, e.sample))
                i += 1
            if num > 0:
                pcm.append(ctypes.string_at(wav, 2 * num))
            return 0

        callback = _Callback(on_audio)
        lib.espeak_SetSynthCallback(callback)
        libc = ctypes.CDLL(None)
        out = []
        for text, voice, rate, pitch, pitch_range, volume, noise_seed in requests:
            pcm.clear()
            events.clear()
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise EspeakError(f"espeak-ng has no voice {voice!r}")
            for param, value in ((_PARAM_RATE, rate), (_PARAM_VOLUME, volume), (_PARAM_PITCH, pitch),
                                 (_PARAM_RANGE, pitch_range)):
                lib.espeak_SetParameter(param, int(value), 0)
            lib.espeak_ng_SetRandSeed(ctypes.c_long(noise_seed))  # breath noise, else seeded from the clock
            libc.srand(ctypes.c_uint(noise_seed & 0xFFFFFFFF))  # libc rand(), which the library reads too
            data = text.encode()
            status = lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
            lib.espeak_Synchronize()
            if status != 0:
                raise EspeakError(f"espeak_Synth failed ({status}) on {text!r}")
            out.append((b"".join(pcm), list(events)))
        return out

    def isolated(self, requests: list[tuple]) -> list[tuple[bytes, list[tuple[int, str, int]]]]:
        """synthesize(requests) in a forked child: from the initial state, whatever ran before.
        Call it only from a process without other threads at work."""
        read_fd, write_fd = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # idle BLAS threads of a data worker
            pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(read_fd)
                try:
                    payload = pickle.dumps(("ok", self.synthesize(requests)))
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


def send(stream, obj) -> None:
    """One message on a binary stream: 8-byte length, then the pickle."""
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def receive(stream):
    """One message from a binary stream (EOFError at its end)."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the stream ended")
    n = int.from_bytes(head, "little")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)


def serve(inp, out) -> None:
    """The helper's loop: first ('ok', native rate) or ('error', message), then for each request
    list ('ok', results) or ('error', message); None or the end of the input stops it."""
    try:
        lib = Library()
    except Exception as err:
        send(out, ("error", f"{type(err).__name__}: {err}"))
        return
    send(out, ("ok", lib.native_rate))
    while True:
        try:
            requests = receive(inp)
        except EOFError:
            return
        if requests is None:
            return
        try:
            send(out, ("ok", lib.isolated(requests)))
        except EspeakError as err:
            send(out, ("error", str(err)))


def main() -> None:
    """`python -m characters_jax.data.espeak`: serve on stdin/stdout (stdout's descriptor is kept for
    the messages; anything else written to it goes to stderr)."""
    import sys

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
