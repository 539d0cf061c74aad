"""What one live session's threads wait on: received audio, the client's playout clock,
the end of the audio and cancellation, all under one condition variable.

The step loop waits here for (a) the audio its step carries and (b) room under the bounded
lead over the client's playout clock. Waiting for the playout clock is pacing, never a
fixed sleep after a step: a slow step simply leaves less (or no) time to wait.
"""

from __future__ import annotations

import threading
import time

import numpy as np


class SessionSignals:
    def __init__(self, fps: int, frames_per_step: int, playout_reports: bool, audio_timeout_s: float = 30.0):
        self.cond = threading.Condition()
        self.audio_timeout_s = audio_timeout_s
        self.last_audio = self.last_report = time.monotonic()
        self._pcm = bytearray()
        self.audio_ended = False
        self.cancelled = False
        self.cancel_reason: tuple | None = None  # (grpc.StatusCode, message)
        self.fps = fps
        self.frames_per_step = frames_per_step
        self.playout_reports = playout_reports
        self.frames_played = 0
        self.underruns = 0
        self.first_chunk_time: float | None = None  # when the first chunk left (clock estimate)

    # -- writers -------------------------------------------------------------------------
    def add_audio(self, pcm: bytes) -> None:
        with self.cond:
            self._pcm += pcm
            self.last_audio = time.monotonic()
            self.cond.notify_all()

    def end_audio(self) -> None:
        with self.cond:
            self.audio_ended = True
            self.cond.notify_all()

    def report_playout(self, frames_played: int, underruns: int) -> int:
        """Returns the number of new underruns."""
        with self.cond:
            new = max(0, underruns - self.underruns)
            self.frames_played = max(self.frames_played, frames_played)
            self.last_report = time.monotonic()
            self.underruns = max(self.underruns, underruns)
            self.cond.notify_all()
            return new

    def chunk_sent(self) -> None:
        with self.cond:
            if self.first_chunk_time is None:
                self.first_chunk_time = time.monotonic()
                self.cond.notify_all()

    def cancel(self, code, message: str) -> bool:
        """Returns False if already cancelled (the first reason wins)."""
        with self.cond:
            if self.cancelled:
                return False
            self.cancelled, self.cancel_reason = True, (code, message)
            self.cond.notify_all()
            return True

    # -- readers -------------------------------------------------------------------------
    def samples(self) -> int:
        with self.cond:
            return len(self._pcm) // 2

    def pcm(self, start: int, end: int) -> np.ndarray:
        """Samples [start, end) received so far, int16."""
        with self.cond:
            return np.frombuffer(bytes(self._pcm[2 * start : 2 * end]), "<i2").astype(np.int16)

    def played_steps(self, now: float) -> float:
        """The client's playout position in steps (reported, or estimated from the wall clock)."""
        if self.playout_reports:
            frames = self.frames_played
        elif self.first_chunk_time is None:
            frames = 0
        else:
            frames = (now - self.first_chunk_time) * self.fps
        return frames / self.frames_per_step

    def wait_for_step(self, step: int, end_sample: int, total_steps_if_ended, lead: int) -> str:
        """Blocks until step `step` may run. Returns "run", "done" (audio over), "cancelled", or
        "stalled" (no audio, or no playout report, for audio_timeout_s while the step waits for it).

        total_steps_if_ended(samples) -> steps needed once the audio has ended.
        """
        with self.cond:
            while True:
                if self.cancelled:
                    return "cancelled"
                n = len(self._pcm) // 2
                if self.audio_ended and step >= total_steps_if_ended(n):
                    return "done"
                audio_ok = n >= end_sample or self.audio_ended
                now = time.monotonic()
                ahead = step - self.played_steps(now)
                if audio_ok and ahead < lead:
                    return "run"
                timeout = None
                if not audio_ok:
                    idle = now - self.last_audio
                    if idle >= self.audio_timeout_s:
                        return "stalled"
                    timeout = self.audio_timeout_s - idle
                elif self.playout_reports:  # a client that stops reporting must not hold the worker
                    idle = now - self.last_report
                    if idle >= self.audio_timeout_s:
                        return "stalled"
                    timeout = self.audio_timeout_s - idle
                elif self.first_chunk_time is not None:
                    # estimated clock: wake when it has advanced enough
                    timeout = max(0.001, (ahead - lead + 1e-3) * self.frames_per_step / self.fps)
                self.cond.wait(timeout)
