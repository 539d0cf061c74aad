"""The viewer's media: the microphone resampled for the worker, and the character's frames and
voice played out on one clock as WebRTC tracks.

- `MicResampler`: the browser's audio track (48 kHz, any layout) -> 16 kHz mono s16le.
- `Upsampler`: the chunks' 16 kHz audio -> the outgoing track's rate (an integer multiple),
  exactly `ratio` output samples per input sample, so sample positions stay frame-aligned.
- `TrackPlayoutClock`: a jitter buffer of the worker's chunks and the clock both tracks read. Frame k
  plays at media time k / fps and audio sample p at p / rate; media time m is due at wall
  time t0 + shift + m. Playback starts once `prebuffer_frames` frames are in; a frame (or
  audio) not there when due is an underrun: the clock stalls (shift grows) until the buffer
  holds `prebuffer_frames` again, so one late chunk costs one stall, not a shallow buffer
  that runs dry at every chunk after it. A flush (interrupt) rebuffers the same way.
  A buffer that has held more than `prebuffer_frames + catchup_frames` for `catchup_after_s`
  (chunks that came in a burst after a late start or a stall) drops its oldest
  `catchup_frames` frames and their audio, so latency returns to the target (shift shrinks).
- `CharacterVideoTrack` / `CharacterAudioTrack`: aiortc tracks that hand out one frame every
  1 / fps and one 20 ms audio packet every 20 ms, at their due times, never in bursts.
"""

from __future__ import annotations

import asyncio
import fractions
import time

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

VIDEO_CLOCK_HZ = 90000  # RTP clock of video
AUDIO_PACKET_S = 0.020  # one Opus packet


class PlayoutEnded(Exception):
    """The session is over and the buffer has been played out."""


class MicResampler:
    """av.AudioFrame (any rate, layout, sample format) -> 16 kHz mono s16le bytes."""

    def __init__(self, rate: int = 16000):
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)

    def __call__(self, frame) -> bytes:
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in self._resampler.resample(frame))


def _lowpass_taps(ratio: int, half_width: int, beta: float = 8.0) -> np.ndarray:
    """Kaiser-windowed sinc interpolation filter: [2 * ratio * half_width + 1] float64, cutoff
    at the input's Nyquist frequency, unity gain on the input samples' grid."""
    n = np.arange(-ratio * half_width, ratio * half_width + 1)
    return np.sinc(n / ratio) * np.kaiser(n.size, beta)


class Upsampler:
    """Integer-ratio upsampling of a mono int16 stream, block by block.

    Each input sample yields exactly `ratio` output samples; the output lags the input by
    `half_width` input samples (0.75 ms at 16 kHz), a constant that A/V sync does not see."""

    def __init__(self, ratio: int, half_width: int = 12):
        if ratio < 1:
            raise ValueError(f"upsampling ratio must be a positive integer, got {ratio}")
        self.ratio, self.half_width = ratio, half_width
        self._taps = _lowpass_taps(ratio, half_width)
        self._history = np.zeros(2 * half_width, np.float64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[n] int16 -> [n * ratio] int16."""
        x = np.asarray(x, np.float64)
        if self.ratio == 1:
            return x.astype(np.int16)
        ext = np.concatenate([self._history, x])
        self._history = ext[-2 * self.half_width :]
        stuffed = np.zeros(ext.size * self.ratio)
        stuffed[:: self.ratio] = ext
        y = np.convolve(stuffed, self._taps)
        start = 2 * self.half_width * self.ratio  # output j <-> input position j / ratio - half_width
        y = y[start : start + x.size * self.ratio]
        return np.clip(np.rint(y), -32768, 32767).astype(np.int16)


class TrackPlayoutClock:
    """The jitter buffer and playout clock shared by the video and the audio track.

    push() takes the frames of one chunk and their audio at `audio_rate`, in order. The
    tracks call next_frame() / next_audio(); both wait for their due time on the same clock.
    `frames_played` and `underruns` are what the gateway reports to the worker."""

    def __init__(self, fps: int = 24, audio_rate: int = 48000, prebuffer_frames: int = 8, catchup_frames: int = 4,
                 catchup_after_s: float = 1.0, clock=time.monotonic):
        self.fps, self.audio_rate, self.prebuffer = fps, audio_rate, prebuffer_frames
        self.catchup_frames, self.catchup_after_s = catchup_frames, catchup_after_s
        self.clock = clock
        self._cond = asyncio.Condition()
        self._frames: dict[int, np.ndarray] = {}
        self._frames_in = 0  # index one past the last frame pushed
        self._audio = np.zeros(0, np.int16)
        self._audio_base = 0  # absolute index of self._audio[0]
        self._next_frame = 0
        self._next_audio = 0  # absolute sample index of the next audio packet
        self.t0: float | None = None
        self.shift_s = 0.0  # total stall time minus total time dropped by catch-ups
        self.stalled_s = 0.0
        self._stall_start: float | None = None
        self._over_since: float | None = None  # since when the buffer holds more than the target
        self._audio_skips: list[tuple[int, int]] = []  # (first sample, samples) dropped by catch-ups, for the audio track
        self.underruns = 0
        self.catchups = 0
        self._stall_counted = True  # whether the stall on now is an underrun (not a flush's rebuffering)
        self.frames_played = 0
        self.ended = False
        self.started = asyncio.Event()
        self.drained = asyncio.Event()  # ended and every frame played

    # -- producer ----------------------------------------------------------------------------
    async def push(self, frames: list[np.ndarray], audio: np.ndarray) -> int:
        """frames: [H, W, 3] uint8 each; audio: the int16 samples at `audio_rate` they carry.
        Returns the first frame's playback index. The audio is anchored to the frames: it
        starts at the first frame's media time (padded or trimmed by the odd sample)."""
        async with self._cond:
            first = self._frames_in
            for f in frames:
                self._frames[self._frames_in] = f
                self._frames_in += 1
            gap = first * self.audio_rate // self.fps - (self._audio_base + self._audio.size)
            audio = np.asarray(audio, np.int16)
            audio = np.concatenate([np.zeros(gap, np.int16), audio]) if gap > 0 else audio[-gap:]
            self._audio = np.concatenate([self._audio, audio])
            now = self.clock()
            if self._stall_start is not None and self.buffered_frames >= self.prebuffer:
                self._end_stall(now)
            if self.t0 is None and self._frames_in >= self.prebuffer:
                self._start(now)
            self._cond.notify_all()
            return first

    def _begin_stall(self, now: float, counted: bool) -> None:
        if self._stall_start is None:
            self._stall_start, self._stall_counted = now, counted
            self.underruns += int(counted)

    def _end_stall(self, now: float) -> None:
        if self._stall_counted:
            self.stalled_s += now - self._stall_start
        self.shift_s += now - self._stall_start
        self._stall_start = None

    async def flush(self) -> None:
        """Drops every frame not yet played and its audio (after an interrupt); playback
        resumes once the buffer is refilled, and that wait is not an underrun."""
        async with self._cond:
            for k in range(self._next_frame, self._frames_in):
                self._frames.pop(k, None)
            self._frames_in = self._next_frame
            keep = max(self._next_frame * self.audio_rate // self.fps, self._next_audio) - self._audio_base
            self._audio = self._audio[: max(keep, 0)]
            self._over_since = None
            if self.t0 is not None:
                self._begin_stall(self.clock(), counted=False)

    async def end(self) -> None:
        """No more chunks will come: what is buffered plays out, then the tracks end."""
        async with self._cond:
            self.ended = True
            now = self.clock()
            if self.t0 is None and self._frames_in:
                self._start(now)
            if self._stall_start is not None:
                self._end_stall(now)
            self._cond.notify_all()

    def _start(self, now: float) -> None:
        self.t0 = now
        self.started.set()

    # -- clock -------------------------------------------------------------------------------
    def due(self, media_s: float) -> float:
        """Wall time (of `clock`) at which media time `media_s` plays."""
        return self.t0 + self.shift_s + media_s

    @property
    def buffered_frames(self) -> int:
        return self._frames_in - self._next_frame

    async def _wait_due(self, media_s: float) -> None:
        async with self._cond:
            while self.t0 is None:
                if self.ended:
                    raise PlayoutEnded
                await self._cond.wait()
        while True:
            wait = self.due(media_s) - self.clock()
            if wait <= 0:
                return
            await asyncio.sleep(wait)

    async def _wait_for(self, available) -> None:
        """Waits until available() and no stall is on (under the lock); data missing at its
        due time starts a stall (an underrun)."""
        async with self._cond:
            while self._stall_start is not None or not available():
                if self.ended:
                    if available():
                        return
                    raise PlayoutEnded
                if not available():
                    self._begin_stall(self.clock(), counted=True)
                await self._cond.wait()

    # -- consumers ---------------------------------------------------------------------------
    def _catch_up(self, k: int) -> int:
        """Drops frames [k, k + catchup_frames) and their audio when the buffer has been over
        its target for catchup_after_s. Returns the next frame to play."""
        now = self.clock()
        if self._frames_in - k <= self.prebuffer + self.catchup_frames:
            self._over_since = None
            return k
        if self._over_since is None:
            self._over_since = now
            return k
        if now - self._over_since < self.catchup_after_s:
            return k
        for i in range(k, k + self.catchup_frames):
            self._frames.pop(i, None)
        self._over_since = None
        self.catchups += 1
        self.shift_s -= self.catchup_frames / self.fps
        start = k * self.audio_rate // self.fps
        self._audio_skips.append((start, (k + self.catchup_frames) * self.audio_rate // self.fps - start))
        return k + self.catchup_frames

    async def next_frame(self) -> tuple[int, np.ndarray]:
        """(frame index, [H, W, 3] uint8), returned at the frame's due time."""
        k = self._next_frame
        try:
            await self._wait_due(k / self.fps)
            k = self._catch_up(k)
            await self._wait_for(lambda: k < self._frames_in)
        except PlayoutEnded:
            self.drained.set()
            raise
        self._next_frame = k + 1
        self.frames_played = k + 1
        return k, self._frames.pop(k)

    async def next_audio(self, samples: int) -> tuple[int, np.ndarray]:
        """(first sample index, [samples] int16), returned at its due time. The last packet of
        a session is padded with silence."""
        p = self._next_audio
        while True:
            while self._audio_skips and p + samples > self._audio_skips[0][0]:  # a catch-up dropped this span
                p += self._audio_skips.pop(0)[1]
            await self._wait_due(p / self.audio_rate)
            if not (self._audio_skips and p + samples > self._audio_skips[0][0]):
                break
        try:
            await self._wait_for(lambda: self._audio_base + self._audio.size >= p + samples)
        except PlayoutEnded:
            if self._audio_base + self._audio.size <= p:
                raise
        async with self._cond:
            lo = p - self._audio_base
            out = self._audio[lo : lo + samples]
            self._audio = self._audio[lo + samples :]
            self._audio_base = p + samples
        self._next_audio = p + samples
        if out.size < samples:
            out = np.concatenate([out, np.zeros(samples - out.size, np.int16)])
        return p, out


class CharacterVideoTrack(MediaStreamTrack):
    """The character's video: frame k with pts k x 90000 / fps, sent when it is due."""

    kind = "video"

    def __init__(self, playout: TrackPlayoutClock, on_frame=None):
        super().__init__()
        self.playout = playout
        self.on_frame = on_frame  # on_frame(index) after each frame is handed to the encoder

    async def recv(self):
        try:
            k, rgb = await self.playout.next_frame()
        except PlayoutEnded:
            self.stop()
            raise MediaStreamError
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts = k * VIDEO_CLOCK_HZ // self.playout.fps
        frame.time_base = fractions.Fraction(1, VIDEO_CLOCK_HZ)
        if self.on_frame:
            self.on_frame(k)
        return frame


class CharacterAudioTrack(MediaStreamTrack):
    """The character's voice: 20 ms packets of mono s16 at the playout's rate."""

    kind = "audio"

    def __init__(self, playout: TrackPlayoutClock):
        super().__init__()
        self.playout = playout
        self.samples = round(AUDIO_PACKET_S * playout.audio_rate)

    async def recv(self):
        try:
            p, pcm = await self.playout.next_audio(self.samples)
        except PlayoutEnded:
            self.stop()
            raise MediaStreamError
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.playout.audio_rate
        frame.pts = p
        frame.time_base = fractions.Fraction(1, self.playout.audio_rate)
        return frame
