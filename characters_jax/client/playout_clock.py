"""The client's playout clock: a display that shows frames at `fps` from a buffer.

Playback starts once `prebuffer_frames` have arrived; every 1/fps it shows the next frame.
If the next frame has not arrived, that is an underrun: the clock stalls until it does
(it never skips); a stream that ends while the clock waits has finished playing, no underrun. `flush()` (an interrupt) drops the frames not yet shown; the wait for the
frames after it is a gap, not an underrun. `frames_played` and `underruns` are what the
client reports to the worker, which paces its step loop to them.
"""

from __future__ import annotations

import threading
import time


class PlayoutClock:
    def __init__(self, fps: int, prebuffer_frames: int = 4, realtime: bool = True, on_report=None, report_every: int = 1):
        """realtime=False: frames count as played the moment they arrive (no pacing, no underruns).

        on_report(frames_played, underruns) is called every `report_every` frames played."""
        self.fps, self.prebuffer, self.realtime = fps, prebuffer_frames, realtime
        self.on_report, self.report_every = on_report, report_every
        self._cond = threading.Condition()
        self.received = 0
        self.played = 0
        self.underruns = 0
        self.stall_s = 0.0  # time spent in underruns
        self.gap_s = 0.0  # time spent waiting after flushes
        self.ended = False
        self.started_at: float | None = None
        self._gap = False
        self._thread = threading.Thread(target=self._run, name="playout", daemon=True) if realtime else None
        if self._thread:
            self._thread.start()

    def add_frames(self, n: int) -> None:
        with self._cond:
            self.received += n
            if not self.realtime:
                self.played = self.received
            self._cond.notify_all()
        if not self.realtime and self.on_report:
            self.on_report(self.played, 0)

    def flush(self) -> int:
        """Drops the frames received and not shown; returns the frames played so far."""
        with self._cond:
            self.received = self.played
            self._gap = True
            self._cond.notify_all()
            return self.played

    def end(self) -> None:
        """No more frames will arrive; playout drains what it has."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait_drained(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        period = 1.0 / self.fps
        with self._cond:
            while self.received < self.prebuffer and not self.ended:
                self._cond.wait()
        self.started_at = t_next = time.monotonic()
        while True:
            now = time.monotonic()
            if t_next > now:
                time.sleep(t_next - now)  # the display's own frame clock
            with self._cond:
                if self.played >= self.received:
                    if self.ended:
                        return
                    gap = self._gap
                    t0 = time.monotonic()
                    while self.played >= self.received and not self.ended:
                        self._cond.wait()
                    if self.played >= self.received:
                        return  # the stream ended while the clock waited: playback finished
                    stalled = time.monotonic() - t0
                    if gap:
                        self.gap_s += stalled
                    else:
                        self.underruns += 1
                        self.stall_s += stalled
                    t_next = max(t_next, time.monotonic())
                self._gap = False
                self.played += 1
                played, under = self.played, self.underruns
            t_next += period
            if self.on_report and played % self.report_every == 0:
                self.on_report(played, under)
