"""What a client keeps so that its conversation outlives a worker (client/stream.py's
conversations use it; no I/O here).

A resumable conversation (start.resumable) numbers its inputs (audio, end_of_speech,
interrupt and end_of_audio requests: 1, 2, ... from the session's start, across workers,
as the worker counts them) and keeps those that no snapshot holds yet: the log is trimmed
when a SnapshotEvent says which inputs its snapshot holds (and, in a session without
periodic snapshots, to the inputs of each chunk's placement, which a drain's snapshot
always holds). It keeps the placement of every step it received, or saw dropped by an
interrupt, since the last snapshot.

When the worker drains (SnapshotEvent MIGRATE, then the SessionEvent MIGRATED, which is
not handed out) or the stream fails UNAVAILABLE (the worker or its decoder crashed) after
a snapshot, the conversation opens `resume_start()` on another worker; after the resumed
session's SessionResumed it replays `replay(...)`: every input after the snapshot's. What
comes back is handed out once: chunks of steps already handed out are skipped (a resumed
worker does not send the steps it regenerated from the client's placements), and a
STARTED / STOPPED / FINISHED speech event once per segment.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import grpc

from characters_jax.protos_gen import characters_pb2 as pb

INPUTS = ("audio", "end_of_speech", "interrupt", "end_of_audio")
# A stream that fails so after its session opened resumes from its last snapshot.
RECOVER_CODES = (grpc.StatusCode.UNAVAILABLE,)
# A resume that a worker refuses so is tried again (another worker, or the old one's claim
# not yet released) until the conversation's open timeout.
RESUME_RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
ONCE_PER_SEGMENT = (pb.SpeechEvent.SPEAKING_STARTED, pb.SpeechEvent.SPEAKING_STOPPED, pb.SpeechEvent.PLAYBACK_FINISHED)
MAX_RESUMES = 32  # resumes of one conversation (a bound on a session bouncing between failing workers)


@dataclasses.dataclass(frozen=True)
class SnapshotRef:
    """The last snapshot the worker announced: what `start.resume` names."""

    session_id: str
    session_token: str
    step: int
    inputs: int
    kind: int


class Resumption:
    def __init__(self, start: pb.ConverseRequest):
        """start: the conversation's first start (its audio format and playout reports are
        kept for every resume)."""
        self._first = start
        self._lock = threading.Lock()
        self._log: collections.deque[tuple[int, pb.ConverseRequest]] = collections.deque()
        self._next_seq = 1
        self._placements: dict[int, pb.StepPlacement] = {}
        self._events: set[tuple[int, int]] = set()
        self._last_step = -1
        self._trimmed = 0  # the last input dropped from the log
        self.session: pb.Session | None = None  # the first Session
        self.token = start.start.session_token if start.start.WhichOneof("session") == "session_id" else ""
        self.snapshot: SnapshotRef | None = None
        self.migrating = False  # a MIGRATE snapshot came: the stream's end is a hand-over
        self.resumes = 0
        self.skipped_chunks = 0  # chunks not handed out again
        self.active = True  # False once the Session says the worker does not snapshot it: nothing is kept

    @property
    def kept_inputs(self) -> int:
        """Inputs in the log (sent, no snapshot holds them yet)."""
        with self._lock:
            return len(self._log)

    # -- sending ---------------------------------------------------------------------------
    def stamp(self, request: pb.ConverseRequest) -> int | None:
        """Numbers an input (and keeps it); None for any other request."""
        if not self.active or request.WhichOneof("event") not in INPUTS:
            return None
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._log.append((seq, request))
            return seq

    def replay(self, inputs: int) -> tuple[int, list[pb.ConverseRequest]]:
        """The inputs after the first `inputs` (what the resumed session lacks), in order,
        and the number of the last one (`inputs` when there is none)."""
        with self._lock:
            out = [(seq, r) for seq, r in self._log if seq > inputs]
        return (out[-1][0] if out else inputs), [r for _, r in out]

    # -- receiving -------------------------------------------------------------------------
    def receive(self, resp: pb.ConverseResponse) -> pb.ConverseResponse | None:
        """Keeps what a resume needs; returns the response to hand out, or None."""
        kind = resp.WhichOneof("event")
        if kind == "session":
            if self.session is None:
                self.session = resp.session
                self.token = resp.session.session_token or self.token
                if not resp.session.resumable:
                    with self._lock:
                        self.active = False
                        self._log.clear()
        elif kind == "chunk":
            c = resp.chunk
            with self._lock:
                if c.HasField("placement"):
                    self._placements[c.step_index] = c.placement
                    if self.session is not None and not self.session.snapshot_interval_s:
                        self._trim_log(c.placement.inputs)
                if c.step_index <= self._last_step:
                    self.skipped_chunks += 1
                    return None
                self._last_step = c.step_index
        elif kind == "speech":
            e = resp.speech
            for p in e.dropped:
                with self._lock:
                    self._placements.setdefault(p.step, p)
            if e.kind in ONCE_PER_SEGMENT:
                key = (e.kind, e.segment)
                if key in self._events:
                    return None
                self._events.add(key)
        elif kind == "snapshot":
            s = resp.snapshot
            with self._lock:
                self.snapshot = SnapshotRef(s.session_id, s.session_token or self.token, s.step, s.inputs, s.kind)
                self._trim_log(s.inputs)
                for step in [k for k in self._placements if k < s.step]:
                    del self._placements[step]
            self.migrating = self.migrating or s.kind == pb.SnapshotEvent.MIGRATE
        elif kind == "session_event" and resp.session_event.end_reason == pb.MIGRATED:
            return None  # the session goes on: not its end
        return resp

    def _trim_log(self, inputs: int) -> None:
        while self._log and self._log[0][0] <= inputs:
            self._trimmed = self._log.popleft()[0]

    # -- resuming --------------------------------------------------------------------------
    def can_resume(self, code: grpc.StatusCode | None) -> bool:
        """Whether a stream that ended (code None: normally) goes on elsewhere: a hand-over
        after MIGRATE, or a failure of RECOVER_CODES after a snapshot whose later inputs the
        log still holds (a session without periodic snapshots trims it by chunk placements)."""
        if not self.active or self.snapshot is None or self.resumes >= MAX_RESUMES:
            return False
        if code is None:
            return self.migrating
        with self._lock:  # a recovery replays every input after the snapshot: the log must still hold them
            complete = self._trimmed <= self.snapshot.inputs
        return complete and code in RECOVER_CODES

    def resume_start(self, latest: bool = False) -> pb.ConverseRequest:
        """The start of the next stream: the last snapshot (latest: the session's newest in
        the store instead) with the placements of the steps held past it."""
        ref, first = self.snapshot, self._first.start
        with self._lock:
            placements = [self._placements[k] for k in sorted(self._placements) if k >= ref.step]
        resume = pb.ConverseRequest.Resume(session_id=ref.session_id, session_token=ref.session_token, placements=placements)
        if not latest:
            resume.step = ref.step
        start = pb.ConverseRequest.Start(audio_format=first.audio_format, playout_reports=first.playout_reports, resumable=True, resume=resume)
        self.migrating = False
        self.resumes += 1
        return pb.ConverseRequest(start=start)

    def interrupts_after(self, inputs: int) -> int:
        """Interrupts in the log after the first `inputs` inputs (each is acknowledged again)."""
        with self._lock:
            return sum(1 for seq, r in self._log if seq > inputs and r.WhichOneof("event") == "interrupt")
