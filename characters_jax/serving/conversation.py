"""What one live session's threads share (`ConversationState`): the speech timeline, the
client's playback position, the session's limits and its speech events, under one
condition variable.

The step loop asks `next_step(s)`, which returns when step s may run (its audio placed on
the timeline) or when the session has to end:
  - step s runs when it is less than `lead` steps ahead of the client's playback (the
    client's PlayoutReports, or the wall clock since the first chunk was sent);
  - its audio is the queued speech, and silence where none is queued; inside a segment
    that is still arriving the step waits for the speech, but only until playback comes
    within `margin` steps of it (margin: the recent step cost in steps + 0.25, so the chunk
    still arrives in time): then silence is inserted, and the video never stops;
  - with `begin_with_speech`, nothing runs before the first speech;
  - a segment starts (its first sample is placed) only once `jitter_buffer_s` of it has
    arrived, or its end is marked: the input jitter buffer, so speech that arrives at
    real-time pace with some jitter plays without silence inside it. Until then a step that
    must run places silence before the segment, never a piece of it. Adaptive (-1): 1.25
    steps (the first step's audio and the quarter-step margin), the largest chunk the client
    sends, and the arrival jitter the session has shown (`ArrivalJitter`; at least
    ADAPTIVE_MIN_JITTER_S), at most ADAPTIVE_MAX_S.
Waiting is on the condition variable with timeouts computed from the clocks and the
limits, never a fixed sleep after a step. Every state change notifies it.

Speech events (`Note`) and chunks (`Chunk`) go out through `emit(item)`, always called
under the lock, so their order is the order of the stream. A chunk's message is built
outside the lock (`chunk_placement`, then `emit_chunk`). A chunk counts as sent when the
stream has handed it to gRPC (`delivered`), which waits for flow control: a client that
stops reading holds the clock, and with it the step loop.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable

import numpy as np

from characters_jax.audio.speech import Segment, SpeechTimeline, StepAudio
from characters_jax.audio.timeline import Timeline

STARTED, STOPPED, FINISHED, INTERRUPTED = "SPEAKING_STARTED", "SPEAKING_STOPPED", "PLAYBACK_FINISHED", "INTERRUPTED"
RUN = "run"
ADAPTIVE_BASE_STEPS = 1.25  # the adaptive jitter buffer before the measured jitter: a step and the margin's quarter step
ADAPTIVE_MAX_S = 1.0  # the adaptive jitter buffer's largest size
ADAPTIVE_MIN_JITTER_S = 0.06  # the jitter the adaptive buffer allows at least (a session's first segment has no history)


class ArrivalJitter:
    """How late a session's speech arrives behind a steady real-time pace. Within a segment,
    each chunk's arrival is compared with the time its last sample would exist at the sample
    rate after the segment began, taking the earliest pace seen as the reference (a sender
    that runs ahead of real time shows none); the estimate is the largest lateness of the
    current and the previous segment, so it follows the sender both up and down."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate
        self._segment = 0
        self._reference: float | None = None
        self._current = 0.0
        self._previous = 0.0
        self.largest_chunk_s = 0.0  # a step's last sample comes with a whole chunk: up to this late

    def arrived(self, segment: int, samples_before: int, samples: int, now: float) -> None:
        if segment != self._segment:
            self._segment, self._reference = segment, None
            self._previous, self._current = self._current, 0.0
        self.largest_chunk_s = max(self.largest_chunk_s, samples / self.sample_rate)
        pace = now - (samples_before + samples) / self.sample_rate
        self._reference = pace if self._reference is None else min(self._reference, pace)
        self._current = max(self._current, pace - self._reference)

    @property
    def seconds(self) -> float:
        return max(self._current, self._previous)

    def export(self, now: float) -> dict:
        """Its state, clock readings as seconds relative to `now`."""
        return {"segment": self._segment, "reference_in_s": None if self._reference is None else self._reference - now,
                "current": self._current, "previous": self._previous, "largest_chunk_s": self.largest_chunk_s}

    def restore(self, d: dict, now: float) -> None:
        """`export`'s state, its clock readings rebased on `now`."""
        self._segment, self._current, self._previous = int(d["segment"]), float(d["current"]), float(d["previous"])
        self._reference = None if d["reference_in_s"] is None else now + float(d["reference_in_s"])
        self.largest_chunk_s = float(d["largest_chunk_s"])


class AudioAfterEnd(Exception):
    """Audio or end of speech after end of audio."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_duration_s: float
    idle_timeout_s: float


@dataclasses.dataclass(frozen=True)
class Placement:
    """How step `step` was placed: the client inputs applied by then and whether a segment
    was held back (its jitter buffer not full); `dropped`: an interrupt dropped its chunk.
    The same inputs in the same order and the same hold place a step the same way."""

    step: int
    inputs: int
    held: bool
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class Note:
    """A speech event (the SpeechEvent message, without the protocol)."""

    kind: str
    segment: int
    position: int  # timeline sample
    segment_samples: int = 0
    interrupted: bool = False
    played_samples: int = 0  # INTERRUPTED: samples of the playback timeline played
    resume_step: int = 0  # INTERRUPTED: the next step the stream carries
    dropped: tuple[Placement, ...] = ()  # INTERRUPTED: the steps whose chunks it dropped


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A chunk on its way out: its message, its frame count, and the interrupt epoch it
    belongs to (a chunk of an earlier epoch is one the client drops)."""

    message: object
    frames: int
    epoch: int


@dataclasses.dataclass(frozen=True)
class End:
    """Why the step loop stops: reason is an EndReason name, or "CANCELLED" (someone else
    ends the session)."""

    reason: str
    message: str


@dataclasses.dataclass
class StepPlan:
    """Step s as placed: its audio, the front end's window over the timeline [window_samples]
    float32, the notes that go before / after its chunk, and its placement."""

    step: int
    audio: StepAudio
    window: np.ndarray
    before: list[Note]
    after: list[Note]
    placement: Placement | None = None


@dataclasses.dataclass(frozen=True)
class ChunkPlacement:
    """Where a decoded step's chunk goes: its plan and the playback timeline frame its first
    frame plays at."""

    plan: StepPlan
    first_play_frame: int


class PlaybackPosition:
    """The worker's account of the client's playback position, in frames of the playback
    timeline (the session's timeline less the frames that interrupts dropped: `skipped`).

    With reports it is the client's frames_played; without, the wall clock at fps from the
    first chunk sent. Either way never more than the frames sent: a client that ran out
    waits for the next frame, and so does the estimate. A report may arrive before the
    stream has recorded the chunk it counts as sent (gRPC hands the message over before
    the stream resumes): it is kept whole and read against the frames sent."""

    def __init__(self, fps: int, reports: bool):
        self.fps, self.reports = fps, reports
        self.sent = 0  # playback frames handed to the transport
        self.reported = 0
        self.underruns = 0
        self.skipped = 0  # timeline frames dropped by interrupts
        self._t0: float | None = None  # estimate: when playback frame 0 played

    @property
    def started(self) -> bool:
        """Whether playback has begun (a reported frame; without reports, a chunk sent)."""
        return self.reported > 0 if self.reports else self._t0 is not None

    def on_sent(self, frames: int, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
        else:
            self.played(now)  # a client that ran out resumes from now
        self.sent += frames

    def report(self, frames_played: int, underruns: int) -> int:
        """Returns the number of new underruns."""
        new = max(0, underruns - self.underruns)
        self.underruns = max(self.underruns, underruns)
        self.reported = max(self.reported, frames_played)
        return new

    def played(self, now: float) -> float:
        if self.reports:
            return float(min(self.reported, self.sent))
        if self._t0 is None:
            return 0.0
        est = (now - self._t0) * self.fps
        if est > self.sent:  # the client ran out and waits for the next frame
            self._t0 = now - self.sent / self.fps
            est = float(self.sent)
        return est

    def truncate(self, played: int, now: float) -> None:
        """After an interrupt: the client dropped every frame it held past `played` and
        waits for the next one."""
        self.sent = played
        self.reported = min(self.reported, played)
        self.played(now)

    def timeline_frames(self, now: float) -> float:
        return self.played(now) + self.skipped

    def export(self, now: float) -> dict:
        """Its state, the clock's start relative to `now`."""
        return {"sent": self.sent, "reported": self.reported, "underruns": self.underruns, "skipped": self.skipped,
                "t0_in_s": None if self._t0 is None else self._t0 - now}

    def restore(self, d: dict, now: float, sent: int) -> None:
        """`export`'s state rebased on `now`, with `sent` playback frames handed to the
        client (what it holds when the stream resumes)."""
        self.reported, self.underruns, self.skipped = int(d["reported"]), int(d["underruns"]), int(d["skipped"])
        self._t0 = None if d["t0_in_s"] is None else now + float(d["t0_in_s"])
        self.sent = sent

    def time_until(self, timeline_frames: float, now: float) -> float | None:
        """Seconds until the position reaches `timeline_frames` by the estimate; None when
        only a report or a sent chunk can get it there (they notify)."""
        if self.reports or self._t0 is None:
            return None
        target = timeline_frames - self.skipped
        if target > self.sent:
            return None
        return max(0.0, self._t0 + target / self.fps - now)


class ConversationState:
    def __init__(self, timeline: Timeline, window: Callable, *, lead: int, playout_reports: bool, begin_with_speech: bool,
                 limits: Limits, max_queued_samples: int, history_samples: int, emit: Callable, now: Callable[[], float] = time.monotonic,
                 jitter_buffer_s: float = 0.0):
        """window(read, s) -> step s's front-end window (AudioFrontEnd.window); emit(item)
        puts a Note or a chunk on the stream (called under the lock); jitter_buffer_s: the
        input jitter buffer (-1: adaptive; 0: a segment starts with its first step's audio)."""
        self.cond = threading.Condition()
        self.tl, self.window, self.lead = timeline, window, lead
        self.begin_with_speech, self.limits = begin_with_speech, limits
        self.speech = SpeechTimeline(max_queued_samples, history_samples)
        self.playback = PlaybackPosition(timeline.fps, playout_reports)
        self.jitter_buffer_s = jitter_buffer_s
        self.jitter = ArrivalJitter(timeline.sample_rate)
        self._emit, self.now = emit, now
        self.started_at = now()
        self.deadline = self.started_at + limits.max_duration_s
        self.idle_since = self.started_at
        self.next_step_index = 0  # steps placed so far
        self.plans: dict[int, StepPlan] = {}  # placed, chunk not yet sent
        self.ended: End | None = None  # set by cancel
        self.audio_ended = False
        self.speech_seen = False
        self.skipped_samples = 0
        self.epoch = 0  # interrupts so far
        self._emitted_end = 0  # playback frame after the last chunk put on the stream
        self.step_cost_s = 0.0  # recent diffusion + decode per chunk (EMA)
        self._segments: dict[int, Segment] = {}  # segments without PLAYBACK_FINISHED
        self._emitted: dict[int, set[str]] = {}  # segment -> kinds emitted
        self._pending: list[Note] = []  # notes for before the next chunk
        self._boundary = False  # a snapshot is asked for (request_boundary)
        self.inputs_applied = 0  # the client's inputs applied (audio, end of speech, interrupt, end of audio)
        self._input_gate: int | None = None  # resuming: apply inputs up to this many, then wait (replay_step)

    # -- the client's requests (reader thread) -------------------------------------------
    def push_audio(self, pcm: np.ndarray) -> None:
        """Raises SpeechQueueFull, AudioAfterEnd."""
        with self.cond:
            if self.audio_ended:
                raise AudioAfterEnd("audio after end_of_audio")
            self.inputs_applied += 1
            if len(pcm) == 0:
                self.cond.notify_all()
                return
            seg = self.speech.push(pcm)
            self.jitter.arrived(seg.number, seg.received - len(pcm), len(pcm), self.now())
            self._segments.setdefault(seg.number, seg)
            self.speech_seen = True
            self.idle_since = self.now()
            self.cond.notify_all()

    def end_speech(self) -> None:
        with self.cond:
            if self.audio_ended:
                raise AudioAfterEnd("end_of_speech after end_of_audio")
            self.inputs_applied += 1
            self._end_segment()
            self.idle_since = self.now()
            self.cond.notify_all()

    def end_audio(self, request: bool = True) -> None:
        """request: the client's end_of_audio (an input), else the stream's half-close."""
        with self.cond:
            self.inputs_applied += request
            self.audio_ended = True
            self._end_segment()
            self.cond.notify_all()

    def report_playout(self, frames_played: int, underruns: int) -> int:
        """Returns the number of new underruns."""
        with self.cond:
            new = self.playback.report(frames_played, underruns)
            self._check_playback(self.now())
            self.cond.notify_all()
            return new

    def interrupt(self, frames_played: int | None = None, underruns: int = 0) -> Note:
        """Drops the queued speech and every step placed but not sent; emits INTERRUPTED at
        the playback position (the client's `frames_played` when given), then the cut
        segments' SPEAKING_STOPPED / PLAYBACK_FINISHED. Returns the INTERRUPTED note."""
        with self.cond:
            now = self.now()
            self.inputs_applied += 1
            if frames_played is not None:
                self.playback.report(frames_played, underruns)
            played = math.floor(self.playback.played(now))
            at = played + self.playback.skipped  # timeline frame
            position = self.tl.frame_start(at)
            resume = self.next_step_index
            was_open = self.speech.open_segment
            self.speech.drop_queued()
            dropped = tuple(dataclasses.replace(p.placement, dropped=True) for _, p in sorted(self.plans.items()) if p.placement)
            self.plans.clear()
            self._pending.clear()
            notes, cut = [], None
            for seg in sorted(self._segments.values(), key=lambda x: x.number):
                played_n = seg.samples_before(position)
                if seg is not was_open and seg.dropped == 0 and seg.end is not None and seg.end <= position:  # it had played out
                    notes += self._stop_once(seg, seg.end, seg.placed, False)
                    notes.append(Note(FINISHED, seg.number, seg.end, seg.placed))
                    continue
                lo = seg.start if seg.start is not None else position
                at_seg = min(max(position, lo), seg.end if seg.end is not None else position)
                if seg.start is not None and seg.start < position:
                    cut = (seg, played_n)
                if STARTED in self._emitted.get(seg.number, ()):
                    notes += self._stop_once(seg, at_seg, played_n, True)
                notes.append(Note(FINISHED, seg.number, at_seg, played_n, interrupted=True))
            skip = max(0, resume * self.tl.frames_per_step - at)
            ack = Note(INTERRUPTED, cut[0].number if cut else 0, position, cut[1] if cut else 0,
                       played_samples=position - self.skipped_samples, resume_step=resume, dropped=dropped)
            self.playback.skipped += skip
            self.skipped_samples += self.tl.frame_start(at + skip) - position
            self.playback.truncate(played, now)
            self._emitted_end = played
            self.epoch += 1
            for note in [ack] + notes:
                self._note(note)
            self.idle_since = now
            self.cond.notify_all()
            return ack

    def request_boundary(self) -> None:
        """Wakes the step loop at its next boundary (next_step returns End "BOUNDARY")."""
        with self.cond:
            self._boundary = True
            self.cond.notify_all()

    def cancel(self, end: End) -> bool:
        """Stops the step loop (the first reason wins). Returns False if already ended."""
        with self.cond:
            if self.ended is not None:
                return False
            self.ended = end
            self.cond.notify_all()
            return True

    # -- the step loop -------------------------------------------------------------------
    def next_step(self, s: int) -> StepPlan | End:
        """Blocks until step s may run (returns its plan) or the session ends (End), or
        until a boundary is asked for (End "BOUNDARY": the step loop takes a snapshot
        before step s and asks again)."""
        with self.cond:
            while True:
                if self._boundary:
                    self._boundary = False
                    return End("BOUNDARY", "a snapshot is asked for")
                decision = self.decide(s, self.now())
                if decision is RUN:
                    return self._place(s)
                if isinstance(decision, End):
                    return decision
                self.cond.wait(decision)

    def decide(self, s: int, now: float) -> End | float | None | str:
        """What next_step(s) does at time `now`, without waiting: RUN (step s runs now), an
        End, or a wait of at most that many seconds (None: until notified) before deciding
        again. Call under the lock (next_step does)."""
        if self.ended is not None:
            return self.ended
        if now >= self.deadline:
            return End("MAX_DURATION", f"max_duration of {self.limits.max_duration_s:g} s reached")
        self._check_playback(now)
        if self._speech_pending(now):
            self.idle_since = now
        elif now - self.idle_since >= self.limits.idle_timeout_s:
            return End("IDLE_TIMEOUT", f"idle_timeout: no speech for {self.limits.idle_timeout_s:g} s")
        if self.audio_ended and self.speech.queued == 0:
            return End("END_OF_AUDIO", "end of audio")
        wakes = [self.deadline - now, self.idle_since + self.limits.idle_timeout_s - now, self._next_finish(now)]
        if self.begin_with_speech and not self.speech_seen:
            return _soonest(wakes)
        per = self.tl.frames_per_step
        ahead = s - self.playback.timeline_frames(now) / per
        if ahead >= self.lead:
            return _soonest(wakes + [self.playback.time_until((s - self.lead) * per + 1e-3, now)])
        n = self.tl.step_span(s)[1] - self.tl.step_span(s)[0]
        held = self._held()
        if held is not None and self.speech.queued - held.received < n:  # the step would reach the held segment
            if self.playback.started and ahead < self.margin:
                return RUN  # silence before the segment; it starts once its buffer is in
            return _soonest(wakes + [self.playback.time_until((s - self.margin) * per + 1e-3, now)])
        if self.speech.must_wait(n) and not self.audio_ended:
            margin = self.margin
            if self.playback.started and ahead < margin:
                return RUN  # the speech is late: silence goes in, the video goes on
            return _soonest(wakes + [self.playback.time_until((s - margin) * per + 1e-3, now)])
        return RUN

    @property
    def jitter_buffer_samples(self) -> int:
        """Samples of a segment that must have arrived before it starts."""
        if self.jitter_buffer_s >= 0:
            return int(self.jitter_buffer_s * self.tl.sample_rate)
        extra = self.jitter.largest_chunk_s + max(self.jitter.seconds, ADAPTIVE_MIN_JITTER_S)
        seconds = min(ADAPTIVE_BASE_STEPS * self.tl.step_seconds + extra, ADAPTIVE_MAX_S)
        return int(seconds * self.tl.sample_rate)

    def _held(self):
        """The open segment while it waits for its jitter buffer (nothing of it placed, its
        end not marked, fewer samples in than the buffer), else None."""
        seg = self.speech.open_segment
        if seg is None or seg.spans or self.audio_ended or seg.received >= self.jitter_buffer_samples:
            return None
        return seg

    @property
    def margin(self) -> float:
        """Steps of playback lead below which a late segment gets silence instead of a wait."""
        return min(max(self.lead - 0.5, 0.25), 0.25 + self.step_cost_s / self.tl.step_seconds)

    def _place(self, s: int, held: bool | None = None) -> StepPlan:
        """Places step s (held: hold the open segment back or not, as a replayed placement
        says; None: as its jitter buffer decides)."""
        a, b = self.tl.step_span(s)
        if a != self.speech.position:
            raise RuntimeError(f"step {s} starts at sample {a}, the timeline is at {self.speech.position}")
        hold = self._held() if held is None else (self.speech.open_segment if held else None)
        audio = self.speech.take(b - a, end_of_audio=self.audio_ended, hold=hold)
        plan = StepPlan(s, audio, self.window(self.speech.history, s), self._pending, [], Placement(s, self.inputs_applied, hold is not None))
        self._pending = []
        for seg in audio.started:
            (plan.before if seg.start == a else plan.after).append(Note(STARTED, seg.number, seg.start))
        for seg in audio.completed:
            plan.after.append(Note(STOPPED, seg.number, seg.end, seg.placed))
        self.plans[s] = plan
        self.next_step_index = s + 1
        return plan

    # -- chunks going out (decoder link thread) ------------------------------------------
    def chunk_placement(self, step: int) -> ChunkPlacement | None:
        """Where step's chunk goes: its plan and its first frame on the playback timeline;
        None when an interrupt dropped the step. The caller builds the chunk's message
        outside the lock, then puts it out with `emit_chunk`."""
        with self.cond:
            plan = self.plans.get(step)
            if plan is None:
                return None
            return ChunkPlacement(plan, step * self.tl.frames_per_step - self.playback.skipped)

    def emit_chunk(self, placed: ChunkPlacement, message: object, frames: int) -> bool:
        """Puts the chunk `message` of `placed` (`chunk_placement`) on the stream between
        its notes. Returns False when an interrupt dropped the step meanwhile."""
        with self.cond:
            step = placed.plan.step
            if self.plans.get(step) is not placed.plan:
                return False
            del self.plans[step]
            for note in placed.plan.before:
                self._note(note)
            self._emit(Chunk(message, frames, self.epoch))
            self._emitted_end = placed.first_play_frame + frames
            for note in placed.plan.after:
                self._note(note)
            return True

    def delivered(self, frames: int, epoch: int) -> None:
        """The stream handed a chunk of `epoch` to gRPC: the client can have it now."""
        with self.cond:
            if epoch == self.epoch:
                self.playback.on_sent(frames, self.now())
                self.cond.notify_all()

    def note_step_cost(self, seconds: float) -> None:
        with self.cond:
            self.step_cost_s = seconds if self.step_cost_s == 0 else 0.8 * self.step_cost_s + 0.2 * seconds

    def wait_played_out(self, timeout: float) -> bool:
        """Waits (at most `timeout`, and not past max_duration) until the client has played
        every frame put on the stream. Returns whether it has."""
        with self.cond:
            limit = min(self.now() + timeout, self.deadline)
            while True:
                now = self.now()
                self._check_playback(now)
                done = self.playback.played(now) >= self._emitted_end
                if done or self.ended is not None or now >= limit:
                    return done
                self.cond.wait(_soonest([limit - now, self.playback.time_until(self._emitted_end + self.playback.skipped, now)]))

    def close_segments(self) -> None:
        """At the session's end: every segment without PLAYBACK_FINISHED gets it (interrupted
        unless it had played out), after its SPEAKING_STOPPED."""
        with self.cond:
            now = self.now()
            for note in self._pending:
                self._note(note)
            self._pending = []
            self._check_playback(now)
            position = self.tl.frame_start(math.floor(self.playback.timeline_frames(now)))
            for seg in sorted(self._segments.values(), key=lambda x: x.number):
                played_n = seg.samples_before(position)
                at = min(max(position, seg.start or 0), seg.end if seg.end is not None else position)
                if STARTED in self._emitted.get(seg.number, ()):
                    for note in self._stop_once(seg, at, played_n, True):
                        self._note(note)
                self._note(Note(FINISHED, seg.number, at, played_n, interrupted=True))

    # -- snapshots and resuming ----------------------------------------------------------
    def export(self, next_step: int) -> tuple[dict, dict[str, np.ndarray]]:
        """The conversation at the boundary before step `next_step` (the step loop calls it
        between two steps): JSON-ready fields and arrays (the speech timeline's). Clock
        readings are relative to the export. The notes of steps placed and not yet sent
        count as emitted: their chunks go out before any later snapshot is announced."""
        with self.cond:
            if next_step != self.next_step_index:
                raise RuntimeError(f"export at step {next_step}, the timeline has placed {self.next_step_index} steps")
            now = self.now()
            emitted = {n: set(kinds) for n, kinds in self._emitted.items()}
            for plan in self.plans.values():
                for note in plan.before + plan.after:
                    if note.kind in (STARTED, STOPPED):
                        emitted.setdefault(note.segment, set()).add(note.kind)
            speech, arrays = self.speech.export(self._segments.values())
            meta = {"next_step": next_step, "inputs": self.inputs_applied, "in_flight": len(self.plans), "speech": speech,
                    "playback": self.playback.export(now), "jitter": self.jitter.export(now),
                    "jitter_buffer_s": self.jitter_buffer_s, "begin_with_speech": self.begin_with_speech,
                    "limits": dataclasses.asdict(self.limits), "started_in_s": self.started_at - now,
                    "deadline_in_s": self.deadline - now, "idle_since_in_s": self.idle_since - now,
                    "audio_ended": self.audio_ended, "speech_seen": self.speech_seen, "skipped_samples": self.skipped_samples,
                    "epoch": self.epoch, "step_cost_s": self.step_cost_s, "segments": sorted(self._segments),
                    "emitted": {str(n): sorted(kinds) for n, kinds in emitted.items()},
                    "pending": [dataclasses.asdict(n) for n in self._pending]}
            return meta, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray], age_s: float = 0.0) -> None:
        """Continues from `export`'s fields and arrays, before any step is placed here. The
        client holds every chunk before the exported step; `age_s`: seconds since the
        export (they count against the limits). Raises ValueError when the record does not
        agree with itself."""
        with self.cond:
            base = self.now() - max(age_s, 0.0)
            speech, segments = SpeechTimeline.restored(meta["speech"], arrays)
            self.speech = speech
            self._segments = {int(n): segments[int(n)] for n in meta["segments"]}
            self._emitted = {int(n): set(kinds) for n, kinds in meta["emitted"].items()}
            self._pending = [_note_from_dict(d) for d in meta["pending"]]
            self.next_step_index = int(meta["next_step"])
            self.inputs_applied = int(meta["inputs"])
            self.jitter.restore(meta["jitter"], base)
            held = self.next_step_index * self.tl.frames_per_step - int(meta["playback"]["skipped"])
            self.playback.restore(meta["playback"], base, sent=held)
            self._emitted_end = held
            self.started_at, self.deadline = base + float(meta["started_in_s"]), base + float(meta["deadline_in_s"])
            self.idle_since = base + float(meta["idle_since_in_s"])
            self.audio_ended, self.speech_seen = bool(meta["audio_ended"]), bool(meta["speech_seen"])
            self.skipped_samples, self.epoch = int(meta["skipped_samples"]), int(meta["epoch"])
            self.step_cost_s = float(meta["step_cost_s"])
            self.plans = {}
            self.cond.notify_all()

    def wait_input_turn(self) -> None:
        """The reader, before it applies an input: waits while a resume regenerates the
        steps placed before it (`replay_step`'s gate)."""
        with self.cond:
            self.cond.wait_for(lambda: self._input_gate is None or self.inputs_applied < self._input_gate or self.ended is not None)

    def replay_step(self, s: int, placement: Placement, timeout: float) -> StepPlan | End:
        """Resuming: places step s as it was placed before (`placement`), once exactly the
        inputs applied then are applied again (the reader waits before later ones). A step
        whose chunk the client has (not `dropped`) counts as sent, its notes as emitted;
        its chunk is not sent again. Returns the plan, or an End (the session ends, or the
        inputs do not come within `timeout` seconds: reason "REPLAY")."""
        with self.cond:
            self._input_gate = placement.inputs
            self.cond.notify_all()
            limit = self.now() + timeout
            while self.inputs_applied < placement.inputs and self.ended is None:
                left = limit - self.now()
                if left <= 0:
                    return End("REPLAY", f"step {s} was placed after input {placement.inputs}; the inputs replayed stop at "
                                         f"{self.inputs_applied} after {timeout:g} s")
                self.cond.wait(left)
            if self.ended is not None:
                return self.ended
            if self.inputs_applied != placement.inputs:
                return End("REPLAY", f"step {s} was placed after input {placement.inputs}; "
                                     f"{self.inputs_applied} were applied before it here (the placements are out of order)")
            plan = self._place(s, held=placement.held)
            if not placement.dropped:
                del self.plans[s]
                for note in plan.before + plan.after:
                    self._note(note, send=False)
                first = s * self.tl.frames_per_step - self.playback.skipped
                self._emitted_end = first + self.tl.frames_per_step
                self.playback.on_sent(self.tl.frames_per_step, self.now())
            return plan

    def open_inputs(self) -> None:
        """Resuming is done: the reader applies every input as it comes."""
        with self.cond:
            self._input_gate = None
            self.cond.notify_all()

    # -- helpers (under the lock) --------------------------------------------------------
    def _end_segment(self) -> None:
        seg = self.speech.end_segment()
        if seg is not None and seg.complete and seg.spans:  # its last sample was already placed
            self._pending += self._stop_once(seg, seg.end, seg.placed, False)

    def _stop_once(self, seg: Segment, position: int, samples: int, interrupted: bool) -> list[Note]:
        """SPEAKING_STOPPED for seg unless it is emitted or already planned."""
        planned = any(n.kind == STOPPED and n.segment == seg.number for plan in self.plans.values() for n in plan.after)
        planned = planned or any(n.kind == STOPPED and n.segment == seg.number for n in self._pending)
        if STOPPED in self._emitted.get(seg.number, ()) or planned:
            return []
        return [Note(STOPPED, seg.number, position, samples, interrupted)]

    def _note(self, note: Note, send: bool = True) -> None:
        """Emits a note once (send=False: its bookkeeping only, for a chunk the client has)."""
        if note.kind in (STARTED, STOPPED, FINISHED):
            kinds = self._emitted.setdefault(note.segment, set())
            if note.kind in kinds:
                return
            kinds.add(note.kind)
        if note.kind == FINISHED:
            self._segments.pop(note.segment, None)
            self._emitted.pop(note.segment, None)
        if send:
            self._emit(note)

    def _check_playback(self, now: float) -> None:
        """PLAYBACK_FINISHED for every segment whose end playback has passed."""
        if not self._segments:
            return
        position = self.tl.frame_start(math.floor(self.playback.timeline_frames(now)))
        for seg in sorted(self._segments.values(), key=lambda x: x.number):
            if seg.complete and seg.dropped == 0 and seg.end is not None and seg.end <= position \
                    and STOPPED in self._emitted.get(seg.number, ()):
                self._note(Note(FINISHED, seg.number, seg.end, seg.placed))
                self.idle_since = now

    def _next_finish(self, now: float) -> float | None:
        """Seconds until the next PLAYBACK_FINISHED by the estimated clock (None: none due)."""
        times = [self.playback.time_until(self.tl.frames_for(seg.end), now) for seg in self._segments.values()
                 if seg.complete and seg.end is not None and STOPPED in self._emitted.get(seg.number, ())]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def _speech_pending(self, now: float) -> bool:
        """Speech queued, or placed and not yet played."""
        if self.speech.queued:
            return True
        position = self.tl.frame_start(math.floor(self.playback.timeline_frames(now)))
        return any(seg.end is not None and seg.end > position for seg in self._segments.values())


def _note_from_dict(d: dict) -> Note:
    return Note(**{**d, "dropped": tuple(Placement(**p) for p in d.get("dropped", ()))})


def _soonest(times) -> float | None:
    """The smallest of the given waits (None entries ignored; None if all are), at least 1 ms."""
    times = [t for t in times if t is not None]
    return max(min(times), 1e-3) if times else None
