"""The session's audio timeline: speech segments placed in the order they arrived, silence
wherever no speech is queued when a step has to run.

Pure bookkeeping (no threads, no clocks): the caller decides when a step runs and whether
it may wait for more speech; `take(n)` then places the next n timeline samples. Queued
speech is bounded (`SpeechQueueFull`); the timeline keeps only the recent samples that the
audio front end's window reads (`history`).

Samples are int16, mono; positions are sample indices of the timeline (0 = the first
sample of the session's first step).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


class SpeechQueueFull(Exception):
    """More speech queued than the bound allows; the message says the bound."""


@dataclasses.dataclass(frozen=True)
class Span:
    """A run of one segment's samples on the timeline: `samples` samples from timeline
    position `position`, which are the segment's samples from `offset`."""

    segment: int
    position: int
    offset: int
    samples: int


@dataclasses.dataclass
class Segment:
    """One speech segment (numbered 1, 2, ... in arrival order) and where it went."""

    number: int
    received: int = 0  # samples received
    placed: int = 0  # samples placed on the timeline
    dropped: int = 0  # samples dropped by an interrupt
    ended: bool = False  # no more samples join it (end of speech, end of audio, interrupt)
    spans: list[Span] = dataclasses.field(default_factory=list)

    @property
    def start(self) -> int | None:
        """Timeline position of its first placed sample (None before any is placed)."""
        return self.spans[0].position if self.spans else None

    @property
    def end(self) -> int | None:
        """One past its last placed sample (None before any is placed)."""
        return self.spans[-1].position + self.spans[-1].samples if self.spans else None

    @property
    def complete(self) -> bool:
        """Ended, and every sample received is placed or dropped."""
        return self.ended and self.placed + self.dropped == self.received

    def samples_before(self, position: int) -> int:
        """Its placed samples at timeline positions before `position`."""
        return sum(min(max(position - s.position, 0), s.samples) for s in self.spans)


@dataclasses.dataclass(frozen=True)
class StepAudio:
    """The timeline samples of one step, as `SpeechTimeline.take` placed them.

    audio: int16 [n] (n = the step's samples; shorter only for the final step of a timeline
    ended by end of audio, which stops at the last speech sample).
    spans: where speech lies in `audio`; every other sample is inserted silence.
    started / completed: segments whose first sample / whose last sample this step placed.
    """

    start: int
    audio: np.ndarray
    spans: tuple[Span, ...]
    started: tuple[Segment, ...]
    completed: tuple[Segment, ...]

    @property
    def speech_samples(self) -> int:
        return sum(s.samples for s in self.spans)


class SpeechTimeline:
    def __init__(self, max_queued_samples: int, history_samples: int):
        """max_queued_samples: bound on speech received but not yet placed.
        history_samples: how many of the latest timeline samples `history` can read."""
        if max_queued_samples <= 0 or history_samples <= 0:
            raise ValueError("max_queued_samples and history_samples must be positive")
        self.max_queued = max_queued_samples
        self._queue: collections.deque[tuple[Segment, np.ndarray, int]] = collections.deque()  # (segment, samples, its offset)
        self.queued = 0
        self.position = 0  # timeline samples placed so far
        self._current: Segment | None = None  # the segment audio is joining
        self._count = 0
        self._history = np.zeros(history_samples, np.int16)  # the last history_samples timeline samples

    @property
    def open_segment(self) -> Segment | None:
        """The segment that new audio joins, until it ends."""
        return self._current

    def push(self, pcm: np.ndarray) -> Segment:
        """Queues speech; opens a segment if none is open. Returns the segment it joined.
        Raises SpeechQueueFull (nothing is queued then)."""
        pcm = np.asarray(pcm, np.int16)
        if self.queued + len(pcm) > self.max_queued:
            raise SpeechQueueFull(f"queued speech would be {self.queued + len(pcm)} samples, over the limit of {self.max_queued} "
                                  f"({self.max_queued / 16000:g} s at 16 kHz); send speech at most that far ahead of playback")
        if self._current is None:
            self._count += 1
            self._current = Segment(self._count)
        seg = self._current
        if len(pcm):
            self._queue.append((seg, pcm, seg.received))
            seg.received += len(pcm)
            self.queued += len(pcm)
        return seg

    def end_segment(self) -> Segment | None:
        """Ends the open segment (its queued samples still play). Returns it, or None."""
        seg, self._current = self._current, None
        if seg is not None:
            seg.ended = True
        return seg

    def must_wait(self, n: int) -> bool:
        """Whether a step of n samples would cut into a segment that is still arriving: fewer
        than n samples queued while a segment is open."""
        return self.queued < n and self._current is not None

    def take(self, n: int, end_of_audio: bool = False, hold: Segment | None = None) -> StepAudio:
        """Places the next n timeline samples: queued speech first, then silence.

        end_of_audio: no audio follows; if this take empties the queue, the step's audio stops
        at its last speech sample. hold: a segment not to start yet (its samples stay queued;
        silence goes in their place)."""
        start = self.position
        audio = np.zeros(n, np.int16)
        spans, started, completed = [], [], []
        filled = 0
        while filled < n and self._queue and self._queue[0][0] is not hold:
            seg, pcm, offset = self._queue[0]
            k = min(n - filled, len(pcm))
            audio[filled : filled + k] = pcm[:k]
            if not seg.spans:
                started.append(seg)
            span = Span(seg.number, start + filled, offset, k)
            if spans and spans[-1].segment == seg.number and spans[-1].offset + spans[-1].samples == offset:
                span = Span(seg.number, spans[-1].position, spans[-1].offset, spans[-1].samples + k)  # one run, two chunks
                spans[-1] = seg.spans[-1] = span
            else:
                seg.spans.append(span)
                spans.append(span)
            seg.placed += k
            filled += k
            self.queued -= k
            if k == len(pcm):
                self._queue.popleft()
            else:
                self._queue[0] = (seg, pcm[k:], offset + k)
            if seg.complete:
                completed.append(seg)
        if end_of_audio and not self._queue and spans:
            audio = audio[: spans[-1].position + spans[-1].samples - start]
        self._remember(audio, n)
        self.position += n
        return StepAudio(start, audio, tuple(spans), tuple(started), tuple(completed))

    def drop_queued(self) -> list[Segment]:
        """Drops every queued sample and ends the open segment (an interrupt). Returns the
        segments that lost samples."""
        hit: dict[int, Segment] = {}
        for seg, pcm, _ in self._queue:
            seg.dropped += len(pcm)
            hit[seg.number] = seg
        self._queue.clear()
        self.queued = 0
        for seg in hit.values():
            seg.ended = True
        self.end_segment()
        return list(hit.values())

    def export(self, segments=()) -> tuple[dict, dict[str, np.ndarray]]:
        """The timeline's state: JSON-ready fields (with every segment it or `segments`
        refer to) and its arrays (the queued speech, concatenated, and the history)."""
        refer = {seg.number: seg for seg, _, _ in self._queue}
        refer.update((seg.number, seg) for seg in segments)
        if self._current is not None:
            refer[self._current.number] = self._current
        meta = {"max_queued": self.max_queued, "queued": self.queued, "position": self.position, "count": self._count,
                "current": self._current.number if self._current is not None else None,
                "queue": [[seg.number, offset, len(pcm)] for seg, pcm, offset in self._queue],
                "segments": [dataclasses.asdict(seg) for seg in sorted(refer.values(), key=lambda x: x.number)]}
        pcm = np.concatenate([pcm for _, pcm, _ in self._queue]) if self._queue else np.zeros(0, np.int16)
        return meta, {"queued_pcm": pcm.astype(np.int16), "history": self._history.copy()}

    @classmethod
    def restored(cls, meta: dict, arrays: dict[str, np.ndarray]) -> tuple["SpeechTimeline", dict[int, Segment]]:
        """A timeline from `export`'s fields and arrays, and its segments by number (the
        objects the timeline refers to). Raises ValueError when they do not agree."""
        history = np.asarray(arrays["history"], np.int16)
        tl = cls(int(meta["max_queued"]), len(history))
        segs = {int(d["number"]): Segment(int(d["number"]), int(d["received"]), int(d["placed"]), int(d["dropped"]), bool(d["ended"]),
                                          [Span(**{k: int(v) for k, v in sp.items()}) for sp in d["spans"]]) for d in meta["segments"]}
        pcm = np.asarray(arrays["queued_pcm"], np.int16)
        at = 0
        for number, offset, n in meta["queue"]:
            if number not in segs or at + n > len(pcm):
                raise ValueError("the speech queue does not agree with its samples or segments")
            tl._queue.append((segs[number], pcm[at : at + n].copy(), int(offset)))
            at += n
        if at != len(pcm) or at != int(meta["queued"]):
            raise ValueError(f"the speech queue holds {at} samples, its record says {meta['queued']} ({len(pcm)} stored)")
        tl.queued, tl.position, tl._count = at, int(meta["position"]), int(meta["count"])
        tl._current = segs.get(meta["current"]) if meta["current"] is not None else None
        tl._history = history.copy()
        return tl, segs

    def history(self, lo: int, hi: int) -> np.ndarray:
        """Timeline samples [lo, hi) already placed, int16 (the part before 0 or not yet placed
        is left out; the part older than the kept history reads as zeros)."""
        lo, hi = max(lo, 0), min(hi, self.position)
        if hi <= lo:
            return np.zeros(0, np.int16)
        keep = len(self._history)
        out = np.zeros(hi - lo, np.int16)
        first = self.position - keep  # timeline position of _history[0]
        a = max(lo, first)
        if a < hi:
            out[a - lo :] = self._history[a - first : hi - first]
        return out

    def _remember(self, audio: np.ndarray, n: int) -> None:
        step = np.zeros(n, np.int16)
        step[: len(audio)] = audio
        keep = len(self._history)
        if n >= keep:
            self._history = step[n - keep :].copy()
        else:
            self._history = np.concatenate([self._history[n:], step])
