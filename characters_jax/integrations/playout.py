"""One conversation with a worker, played out for publishing: what both voice-agent
integrations share (asyncio, over the client library's AsyncConversationStream).

    session = CharacterSession("dns:///workers:50051", image=png)   # balanced targets work as in CharacterClient
    await session.open()                 # the worker's Session (RUNNING); raises SessionError
    session.push_audio(pcm16k)           # the agent's speech: int16 mono 16 kHz, as it arrives
    session.end_segment()                # the end of an utterance
    session.interrupt()                  # barge-in: drops every frame not yet published
    async for tick in session.ticks():   # one MediaTick per 1/fps: a frame and the audio it carries
        publish(tick.frame, tick.audio)
    await session.aclose()

One clock: each tick carries one frame and exactly the samples that play with it (frame k
carries samples [k*16000//fps, (k+1)*16000//fps) of the session's timeline), so audio and
video leave together and cannot drift apart, however bursty the worker's chunks are. The
ticks are paced by a `Clock` (the monotonic clock; `ScaledClock` runs faster than real
time for tests); the worker paces its steps to this playback (PlayoutReports after each
frame). When the next frame has not arrived, the tick holds the last frame with silence
(`held`: an underrun, or the wait after an interrupt); the playback timeline is never
skipped. Speech events (`pb.SpeechEvent`) go to `on_event` as they arrive.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import AsyncIterator, Callable, Protocol

import grpc
import numpy as np

from characters_jax.client.credentials import ClientCredentials
from characters_jax.client.requests import start_request
from characters_jax.client.stream import AsyncConversationStream
from characters_jax.client.targets import aio_channel
from characters_jax.protos_gen import characters_pb2 as pb

SAMPLE_RATE = 16000  # the worker's audio: 16 kHz mono s16le, in and out


class SessionError(Exception):
    """The worker refused or ended the session with an error: `code` is the gRPC status
    name, the message the worker's own."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class ScaledClock:
    """A clock that runs `speed` times faster than the monotonic clock (a 60 s exchange in
    60/speed s). Everything paced by it, the worker included (through the playout reports),
    keeps the same timeline."""

    def __init__(self, speed: float):
        self.speed, self._t0 = speed, time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    async def sleep_until(self, t: float) -> None:
        delay = (t - self.now()) / self.speed
        if delay > 0:
            await asyncio.sleep(delay)


@dataclasses.dataclass(frozen=True)
class PlayoutOptions:
    prebuffer_frames: int = 4  # frames received before the first tick (one chunk)
    open_timeout_s: float = 300.0  # how long to wait for a worker to take the session


@dataclasses.dataclass(frozen=True)
class MediaTick:
    """One frame period of the published media."""

    index: int  # ticks since playback began (held ticks included): the media clock
    time_s: float  # index / fps: its presentation time
    frame: np.ndarray  # [H, W, 3] uint8 RGB
    audio: np.ndarray  # int16 [n], 16 kHz mono: the samples that play with the frame (silence when held)
    played: int  # frames of the playback timeline shown, this one included (held ticks not counted)
    segment: int  # the speech segment the frame's audio belongs to (0: listening, or held)
    held: bool  # no frame had arrived: the last one again, with silence


@dataclasses.dataclass(frozen=True)
class _Frame:
    frame: np.ndarray
    audio: np.ndarray
    segment: int


def frame_start(k: int, fps: int) -> int:
    """Timeline sample where frame k's audio begins."""
    return k * SAMPLE_RATE // fps


def split_chunk(chunk: pb.VideoChunk, fps: int) -> list[_Frame]:
    """A VideoChunk's frames, each with its audio samples and its speech segment (0: none)."""
    audio = np.frombuffer(chunk.audio_pcm, "<i2")
    out = []
    for i, data in enumerate(chunk.frames):
        k = chunk.first_frame_index + i
        a, b = frame_start(k, fps), frame_start(k + 1, fps)
        piece = np.zeros(b - a, np.int16)
        have = audio[max(a - chunk.audio_first_sample, 0): max(b - chunk.audio_first_sample, 0)]
        piece[: len(have)] = have
        segment = next((sp.segment for sp in chunk.speech if sp.position_samples < b and sp.position_samples + sp.samples > a), 0)
        out.append(_Frame(np.frombuffer(data, np.uint8).reshape(chunk.height, chunk.width, 3), piece, segment))
    return out


def to_mono_16k(pcm: np.ndarray, rate: int, channels: int) -> np.ndarray:
    """int16 interleaved PCM at any rate and channel count -> int16 mono 16 kHz (the
    channels averaged, linear interpolation; a frame-accurate path for agents whose TTS
    speaks another rate). Raises ValueError for a partial sample frame or a bad format."""
    if rate <= 0 or channels <= 0:
        raise ValueError(f"audio format: sample rate {rate} Hz and {channels} channels must be positive")
    x = np.asarray(pcm, np.int16)
    if x.size % channels:
        raise ValueError(f"audio: {x.size} samples are not a whole number of {channels}-channel frames")
    x = x.reshape(-1, channels).astype(np.float32).mean(axis=1)
    if rate != SAMPLE_RATE and x.size:
        n = int(round(x.size * SAMPLE_RATE / rate))
        x = np.interp(np.arange(n) * rate / SAMPLE_RATE, np.arange(x.size), x)
    return np.clip(np.round(x), -32768, 32767).astype(np.int16)


class CharacterSession:
    def __init__(self, target: str, image: bytes, *, prompt: str = "", seed: int = 0, limits: pb.SessionLimits | None = None,
                 credentials: ClientCredentials | None = None, options: PlayoutOptions = PlayoutOptions(), clock: Clock | None = None,
                 on_event: Callable[[pb.SpeechEvent], None] | None = None):
        """target: 'host:port', a comma list or 'dns:///name:port' (balanced, as in
        CharacterClient); image: the reference image (PNG/JPEG/WebP bytes)."""
        self.target, self.image, self.prompt, self.seed, self.limits = target, image, prompt, seed, limits
        self.credentials, self.options = credentials, options
        self.clock = clock or MonotonicClock()
        self.on_event = on_event
        self.session: pb.Session | None = None
        self.final: pb.SessionEvent | None = None
        self.error: SessionError | None = None
        self.fps = 24
        self.played = 0
        self.underruns = 0
        self._buffer: collections.deque[_Frame] = collections.deque()
        self._arrived = asyncio.Event()
        self._ended = False
        self._gap = False  # the wait after an interrupt is not an underrun
        self._channel = None
        self._conv: AsyncConversationStream | None = None
        self._reader: asyncio.Task | None = None

    @property
    def ended(self) -> bool:
        """The worker's stream has ended (no more frames will arrive)."""
        return self._ended

    async def open(self) -> pb.Session:
        """Opens the session on a worker (a balanced target: an idle one). Raises SessionError
        (the worker's status, or DEADLINE_EXCEEDED when none took it within open_timeout_s)."""
        self._channel, target = aio_channel(self.target, credentials=self.credentials)
        start = start_request(image=self.image, prompt=self.prompt, seed=self.seed, limits=self.limits, playout_reports=True)
        self._conv = AsyncConversationStream.open(self._channel, start, balanced=target.balanced)
        opened = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read(opened))
        try:
            self.session = await asyncio.wait_for(asyncio.shield(opened), self.options.open_timeout_s)
        except asyncio.TimeoutError:
            await self.aclose()
            raise SessionError("DEADLINE_EXCEEDED", f"no worker opened the session within {self.options.open_timeout_s:g} s") from None
        except SessionError:
            await self.aclose()
            raise
        self.fps = self.session.fps or 24
        return self.session

    async def _read(self, opened: asyncio.Future) -> None:
        try:
            async for msg in self._conv:
                if isinstance(msg, pb.Session):
                    if not opened.done():
                        opened.set_result(msg)
                elif isinstance(msg, pb.VideoChunk):
                    self._buffer.extend(split_chunk(msg, self.fps))
                    self._arrived.set()
                elif isinstance(msg, pb.SpeechEvent):
                    if self.on_event is not None:
                        self.on_event(msg)
                elif isinstance(msg, pb.SessionEvent):
                    self.final = msg
        except grpc.RpcError as err:
            code = err.code().name if err.code() is not None else "UNKNOWN"
            self.error = SessionError(code, err.details() or code)
        except asyncio.CancelledError:
            pass
        finally:
            if not opened.done():
                opened.set_exception(self.error or SessionError("UNAVAILABLE", "the stream ended before the session opened"))
            self._ended = True
            self._arrived.set()

    # -- the agent's speech ------------------------------------------------------------
    def push_audio(self, pcm: np.ndarray) -> None:
        """Speech, int16 mono 16 kHz (to_mono_16k converts other formats)."""
        if self._conv is not None and len(pcm) and not self._ended:
            self._conv.send_audio(np.asarray(pcm, np.int16))

    def end_segment(self) -> None:
        if self._conv is not None and not self._ended:
            self._conv.end_speech()

    def interrupt(self) -> int:
        """Barge-in: drops the frames received and not yet published (the worker drops its
        queued speech and unsent chunks and answers INTERRUPTED at `played`). Returns the
        number of frames dropped here."""
        dropped = len(self._buffer)
        self._buffer.clear()
        self._gap = True
        if self._conv is not None and not self._ended:
            self._conv.interrupt(self.played, self.underruns)
        return dropped

    # -- publishing --------------------------------------------------------------------
    async def ticks(self) -> AsyncIterator[MediaTick]:
        """One MediaTick per 1/fps on the clock, until the stream has ended and every frame
        received is out."""
        while len(self._buffer) < self.options.prebuffer_frames and not self._ended:
            self._arrived.clear()
            await self._arrived.wait()
        if not self._buffer:
            return
        period = 1.0 / self.fps
        t0, n, last = self.clock.now(), 0, None
        stalled = False
        while True:
            await self.clock.sleep_until(t0 + n * period)
            if self._buffer:
                f = self._buffer.popleft()
                self.played += 1
                last, held, stalled, self._gap = f.frame, False, False, False
                tick = MediaTick(n, n * period, f.frame, f.audio, self.played, f.segment, False)
            elif self._ended:
                return
            else:
                if not stalled and not self._gap:
                    self.underruns += 1
                stalled, held = True, True
                silence = np.zeros(frame_start(n + 1, self.fps) - frame_start(n, self.fps), np.int16)
                tick = MediaTick(n, n * period, last, silence, self.played, 0, True)
            yield tick
            if not held and self._conv is not None and not self._ended:
                self._conv.report_playout(self.played, self.underruns)
            n += 1

    async def aclose(self) -> None:
        """Ends the stream (the worker ends the session CANCELLED, CLIENT_GONE, unless it has
        ended) and closes the channel."""
        if self._conv is not None and not self._ended:
            self._conv.cancel()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
