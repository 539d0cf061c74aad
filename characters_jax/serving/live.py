"""One running session: the request reader, the step loop and the decoder stream.

Threads:
  reader   - consumes the client's requests into the ConversationState: audio, end of
             speech, interrupts, playout reports, end of audio.
  stepper  - the step loop: ConversationState.next_step(s) (the pacing and the step's audio),
             the audio tokens, generator.step, and the (device) latent to the decoder link.
             It owns the session's end (below).
  link     - (DecoderLink) copies latent n to the host while step n + 1 runs, streams it to
             the decoder process and turns each decoded chunk into a VideoChunk, sent
             through ConversationState.emit_chunk (which drops the steps an interrupt cut).
The Converse handler yields what lands on `out`, typed: `SpeechOut` (a SpeechEvent) and
`Chunk` (a VideoChunk; it reports each to ConversationState.delivered once gRPC has taken
it), then one `SessionEnd`.

The end: the stepper alone makes the terminal transition, once. Other threads post a
`SessionEnd` with `request_end` (the client went away, CloseSession, the drain timeout, a bad
request, a decoder failure); the first one posted is the end, later ones change nothing, and
a poster may wait for the end with a deadline. The step loop's own ends (end of audio, max
duration, idle timeout) become the end once the session's last chunk has gone out (and, at
the end of audio, has played), unless a request came first; a failed step ends it FAILED.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time

import grpc

from characters_jax.audio.pcm import AudioFormatError, pcm_to_int16
from characters_jax.audio.speech import SpeechQueueFull
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.conversation import AudioAfterEnd, Chunk, ConversationState, End, Note, Placement
from characters_jax.serving.decoder_link import DecoderLink
from characters_jax.serving.snapshot import MIGRATE, PERIODIC, REQUESTED, Committed, SessionSnapshots
from characters_jax.serving.snapshot_store import Snapshot, token_digest

log = logging.getLogger("characters_jax.serving.live")


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """What a stream's `start` asks for."""

    playout_reports: bool
    begin_with_speech: bool
    jitter_buffer_s: float | None = None  # the session's input jitter buffer (None: the worker's)


@dataclasses.dataclass(frozen=True)
class SessionEnd:
    """How a session ends: its terminal state, the RPC status, the message and the end reason
    (an EndReason name). Posted to end a session, and the last item on `out`."""

    state: str
    code: grpc.StatusCode
    message: str
    reason: str


@dataclasses.dataclass(frozen=True)
class SpeechOut:
    """A speech event on its way out."""

    message: pb.ConverseResponse


@dataclasses.dataclass(frozen=True)
class SnapshotOut:
    """A SnapshotEvent on its way out."""

    message: pb.ConverseResponse


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resumed session starts from: the snapshot (its arrays loaded), the client's
    placements of the steps it holds past it (in step order, from the snapshot's step), and
    the snapshot's age in seconds."""

    snapshot: Snapshot
    placements: tuple[Placement, ...]
    age_s: float


REPLAY_TIMEOUT_S = 10.0  # a resume waits this long for the client's replayed inputs of each regenerated step
MIGRATION_WAIT_S = 60.0  # a draining session's step loop has stopped: its snapshot must commit within this


def placement_proto(p: Placement) -> pb.StepPlacement:
    return pb.StepPlacement(step=p.step, inputs=p.inputs, segment_held=p.held, dropped=p.dropped)


def speech_event(note: Note) -> pb.ConverseResponse:
    return pb.ConverseResponse(speech=pb.SpeechEvent(
        kind=pb.SpeechEvent.Kind.Value(note.kind), segment=note.segment, position_samples=note.position,
        segment_samples=note.segment_samples, interrupted=note.interrupted, played_samples=note.played_samples,
        resume_step=note.resume_step, dropped=[placement_proto(p) for p in note.dropped]))


class LiveSession:
    def __init__(self, rec, table, ctx, stream: StreamOptions, options, snapshots: SessionSnapshots | None = None,
                 resume: ResumePlan | None = None):
        """ctx: the worker's WorkerContext; options: its WorkerOptions; snapshots: the
        session's snapshots (None: it is not resumable); resume: the snapshot it continues
        from (the generator's state is restored by the caller)."""
        self.rec, self.table, self.ctx, self.options = rec, table, ctx, options
        self.stream, self.snapshots, self.resume = stream, snapshots, resume
        self.opened_at = time.monotonic()
        tl, fe = ctx.timeline, ctx.frontend
        self.out: queue.Queue[SpeechOut | Chunk | SessionEnd] = queue.Queue()
        self.conv = ConversationState(
            tl, fe.window, lead=options.lead_chunks, playout_reports=stream.playout_reports, begin_with_speech=stream.begin_with_speech,
            limits=rec.limits, max_queued_samples=int(options.max_queued_audio_s * tl.sample_rate),
            history_samples=fe.spec.window_samples + tl.max_step_samples, emit=self._emit,
            jitter_buffer_s=options.jitter_buffer_s if stream.jitter_buffer_s is None else stream.jitter_buffer_s)
        ctx.metrics.follow_conversation(self.conv)
        self._end_cond = threading.Condition()
        self._end: SessionEnd | None = None  # the first end posted (or the step loop's own, at the end)
        self._link_done = False  # the decoder stream has ended
        self._ended = threading.Event()  # the terminal transition is made
        self._prev_out = None
        self._first_out = None
        self._frames = 0
        self._steps = 0
        self._frames_here = 0  # frames this worker sent (its fps)
        self.first_step = 0
        self.replayed: tuple[Placement, ...] = ()
        self._migrate = False  # the worker drains: snapshot at the next boundary, then end MIGRATED
        self._requested = False  # the client asked for a snapshot
        self._migration: Committed | None = None
        initial = None
        if resume is not None:
            snap = resume.snapshot
            self.conv.restore(snap.manifest["conversation"], snap.group("conversation"), resume.age_s)
            self.first_step, self.replayed = snap.step, resume.placements
            initial = [a for _, a in sorted(snap.group("decoder").items())]
            held = sum(not p.dropped for p in resume.placements)
            self._steps = int(snap.manifest["session"]["steps"]) + held
            self._frames = int(snap.manifest["session"]["frames"]) + held * tl.frames_per_step
            rec.steps, rec.frames = self._steps, self._frames
        self.link = DecoderLink(ctx.decoder, rec.session_id, self._on_chunk, self._on_link_error, self._on_link_end, initial_state=initial)
        if snapshots is not None:
            snapshots.on_commit = self.on_snapshot_committed
        self._stepper = threading.Thread(target=self._run, name=f"stepper-{rec.session_id[:8]}", daemon=True)
        self._reader = None

    def fields(self, **kw):
        return {"fields": {"session_id": self.rec.session_id, **kw}}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, request_iterator, context) -> None:
        self._reader = threading.Thread(target=self._read, args=(request_iterator, context), name=f"reader-{self.rec.session_id[:8]}", daemon=True)
        self.link.start()
        self._reader.start()
        self._stepper.start()

    def request_end(self, end: SessionEnd, wait_s: float | None = None) -> bool:
        """Asks the step loop to end the session with `end`; the first end posted wins, later
        ones change nothing. wait_s: wait up to that many seconds for the end (None: do not
        wait). Returns whether the session has ended."""
        with self._end_cond:
            first = self._end is None
            if first:
                self._end = end
            self._end_cond.notify_all()
        if first:
            self.conv.cancel(End("CANCELLED", end.message))  # wakes the step loop wherever it waits
        return self._ended.wait(wait_s) if wait_s is not None else self._ended.is_set()

    @property
    def ended(self) -> bool:
        """Whether the terminal transition is made."""
        return self._ended.is_set()

    @property
    def requested_end(self) -> SessionEnd | None:
        """The end posted first (None while none is)."""
        with self._end_cond:
            return self._end

    def request_migration(self) -> bool:
        """The worker drains: at the next step boundary the session is snapshotted, its
        step loop stops, and once the chunks before the boundary and the snapshot are out
        it ends MIGRATED. Returns False (nothing asked) when the session is not resumable."""
        if self.snapshots is None:
            return False
        self._migrate = True
        self.conv.request_boundary()
        return True

    def _snapshot_event(self, c: Committed) -> pb.ConverseResponse:
        return pb.ConverseResponse(snapshot=pb.SnapshotEvent(
            kind=pb.SnapshotEvent.Kind.Value(c.kind), session_id=self.rec.session_id, session_token=self.rec.token, step=c.step,
            inputs=c.inputs, bytes=c.bytes, snapshot_ms=c.snapshot_s * 1e3))

    def on_snapshot_committed(self, c: Committed) -> None:
        """A periodic or requested snapshot is in the store (the writer's thread)."""
        if not self._ended.is_set():
            self.out.put(SnapshotOut(self._snapshot_event(c)))

    def _emit(self, item: Chunk | Note) -> None:
        if isinstance(item, Chunk):
            self.out.put(item)
        else:
            self.ctx.metrics.speech_note(item, self.ctx.timeline.sample_rate)
            self.out.put(SpeechOut(speech_event(item)))

    # -- reader ----------------------------------------------------------------------------
    def _read(self, request_iterator, context) -> None:
        """Consumes the requests; a bad one ends the session FAILED (outside the try, so an
        error while ending is not mistaken for the RPC going away)."""
        m, conv = self.ctx.metrics, self.conv
        failure = None
        try:
            for req in request_iterator:
                kind = req.WhichOneof("event")
                if kind in ("audio", "end_of_speech", "interrupt", "end_of_audio"):
                    conv.wait_input_turn()  # a resume regenerates the steps placed before this input first
                try:
                    if kind == "audio":
                        conv.push_audio(pcm_to_int16(req.audio.pcm))
                    elif kind == "playout":
                        m.underruns.inc(conv.report_playout(req.playout.frames_played, req.playout.underruns))
                    elif kind == "end_of_speech":
                        conv.end_speech()
                    elif kind == "interrupt":
                        p = req.interrupt.playout if req.interrupt.HasField("playout") else None
                        ack = conv.interrupt(p.frames_played if p else None, p.underruns if p else 0)
                        m.interrupts.inc()
                        log.info("interrupted", extra=self.fields(position=ack.position, segment=ack.segment, segment_samples=ack.segment_samples, resume_step=ack.resume_step))
                    elif kind == "end_of_audio":
                        conv.end_audio()
                    elif kind == "snapshot":
                        if self.snapshots is None:
                            failure = (grpc.StatusCode.FAILED_PRECONDITION, "a snapshot request in a session that is not resumable "
                                       "(it needs start.resumable and a worker with a snapshot store: serve.snapshot_dir)")
                        else:
                            self._requested = True
                            conv.request_boundary()
                    elif kind == "start":
                        failure = (grpc.StatusCode.FAILED_PRECONDITION, f"a second start: this stream already holds session {self.rec.session_id}; one session per Converse")
                    else:
                        failure = (grpc.StatusCode.INVALID_ARGUMENT, "a request with no event set")
                except (AudioFormatError, AudioAfterEnd) as err:
                    failure = (grpc.StatusCode.INVALID_ARGUMENT, str(err))
                except SpeechQueueFull as err:
                    failure = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
                if failure is not None:
                    break
        except Exception:  # the RPC went away; the done-callback ends the session
            return
        if failure is not None:
            self.request_end(SessionEnd("FAILED", failure[0], failure[1], "ERROR"))
        elif context.is_active():  # half-close: no more audio
            conv.end_audio(request=False)

    # -- step loop: the owner of the end ----------------------------------------------------
    def _run(self) -> None:
        """The step loop, then the session's end (on this thread, once)."""
        own = None
        try:
            own = self._step_loop()
            if own is not None:  # the loop's own end: its last chunks go out first
                self.link.finish()
                if self._wait_for_link() and own.reason == "END_OF_AUDIO":  # the speech events of what the client still plays
                    self.conv.wait_played_out((self.options.lead_chunks + 2) * self.ctx.timeline.step_seconds + 2.0)
                elif own.reason == "MIGRATED":
                    own = self._await_migration(own)
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error before the session's end", extra=self.fields())
        finally:
            self._finish(own)

    def _step_loop(self) -> End | None:
        """Runs steps until the session ends. Returns the loop's own end (end of audio, max
        duration, idle timeout), or None when an end was posted (a failed step posts one)."""
        s = self.first_step
        try:
            for placement in self.replayed:  # a resume: the steps the client holds, regenerated as they were placed
                plan = self.conv.replay_step(s, placement, REPLAY_TIMEOUT_S)
                if isinstance(plan, End):
                    return self._loop_end(plan)
                self._run_step(s, plan)
                s += 1
            self.conv.open_inputs()
            while True:
                kind = self._boundary_kind()
                if kind is not None:
                    self._snapshot(s, kind)
                    if kind == MIGRATE:
                        return End("MIGRATED", "the worker is shutting down: the session moves to another worker (SnapshotEvent MIGRATE)")
                plan = self.conv.next_step(s)
                if isinstance(plan, End):
                    if plan.reason == "BOUNDARY":
                        continue
                    return self._loop_end(plan)
                self._run_step(s, plan)
                s += 1
        except Exception as err:
            log.exception("step loop failed", extra=self.fields(step=s))
            self.request_end(SessionEnd("FAILED", grpc.StatusCode.INTERNAL, f"step {s} failed: {type(err).__name__}: {err}", "ERROR"))
            return None

    def _loop_end(self, end: End) -> End | None:
        """The step loop's own end, or None when the end was posted (a replay that cannot
        go on posts FAILED_PRECONDITION)."""
        if end.reason == "REPLAY":
            self.request_end(SessionEnd("FAILED", grpc.StatusCode.FAILED_PRECONDITION, f"resume: {end.message}", "ERROR"))
            return None
        return None if end.reason == "CANCELLED" else end

    def _run_step(self, s: int, plan) -> None:
        ctx = self.ctx
        tokens = ctx.frontend.tokens(plan.window)
        with ctx.generator_lock:
            latent = ctx.generator.step(tokens)
        self.link.submit(s, latent)

    def _boundary_kind(self) -> str | None:
        """The snapshot to take at this boundary, if any."""
        if self._migrate:
            return MIGRATE
        if self._requested:
            self._requested = False
            return REQUESTED
        if self.snapshots is not None and self.snapshots.due():
            return PERIODIC
        return None

    def _snapshot(self, s: int, kind: str) -> None:
        """Begins a snapshot at the boundary before step s: the conversation exported, the
        generator's state copied on the device (both returning at once), the decoder's state
        asked for after the steps before s; the session's writer completes it."""
        t0 = time.perf_counter()
        meta, arrays = self.conv.export(s)
        with self.ctx.generator_lock:
            capture = self.ctx.generator.capture_state()
        rec, per = self.rec, self.ctx.timeline.frames_per_step
        session = {"session_id": rec.session_id, "token_sha256": token_digest(rec.token), "seed": rec.seed,
                   "prompt_tokens": rec.prompt_tokens, "created_unix_ms": rec.created_unix_ms, "limits": dataclasses.asdict(rec.limits),
                   "steps": rec.steps + meta["in_flight"], "frames": rec.frames + meta["in_flight"] * per}
        manifest = {"kind": kind, "step": s, "inputs": meta["inputs"], "taken_unix": time.time(), "worker_id": self.options.worker_id,
                    "identity": self.ctx.generator.state_identity(), "session": session, "conversation": meta}
        boundary = self.snapshots.begin(kind, s, t0, manifest, {f"conversation/{k}": v for k, v in arrays.items()}, capture)
        self.link.request_state(s, functools.partial(self.snapshots.decoder_state, boundary))
        self.ctx.metrics.snapshot_boundary_seconds.observe(time.perf_counter() - t0)

    def _await_migration(self, own: End) -> End | None:
        """The MIGRATE snapshot's commit: the loop's end, or None with FAILED posted."""
        outcome = self.snapshots.wait_migration(MIGRATION_WAIT_S)
        if isinstance(outcome, Committed):
            self._migration = outcome
            return own
        self.request_end(SessionEnd("FAILED", grpc.StatusCode.UNAVAILABLE,
                                    f"the worker is shutting down and could not snapshot the session to move it: {outcome}", "ERROR"))
        return None

    def _wait_for_link(self) -> bool:
        """Waits until the decoder stream has ended or an end is posted. Returns whether the
        stream ended with no end posted."""
        with self._end_cond:
            self._end_cond.wait_for(lambda: self._link_done or self._end is not None)
            return self._end is None

    def _finish(self, own: End | None) -> None:
        """The terminal transition: the first end posted, else the loop's own (COMPLETED).
        Stops the decoder stream unless the session completed, closes the speech segments'
        events, frees the slot and ends the stream."""
        with self._end_cond:
            if self._end is None:
                if own is not None and own.reason == "MIGRATED":
                    self._end = SessionEnd("CANCELLED", grpc.StatusCode.OK, own.message, "MIGRATED")
                else:
                    self._end = (SessionEnd("COMPLETED", grpc.StatusCode.OK, own.message, own.reason) if own is not None else
                                 SessionEnd("FAILED", grpc.StatusCode.INTERNAL, "the step loop stopped without a reason", "ERROR"))
            end = self._end
        migrated = end.reason == "MIGRATED"
        try:
            self.conv.cancel(End("CANCELLED", end.message))
            if end.state != "COMPLETED" and not migrated:
                self.link.cancel()
            if not migrated:  # a migrated session's segments go on elsewhere
                self.conv.close_segments()
            self.ctx.metrics.refresh_device_stats(self.ctx.generator)
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error while ending the session", extra=self.fields(state=end.state))
        finally:
            if self.snapshots is not None:  # the claim is released before the client can hear of a migration
                self.snapshots.close(remove=end.state == "COMPLETED" or end.reason == "CLOSED")
            self.table.transition(self.rec, end.state, end.code, end.message, end.reason)
            if migrated:
                self.ctx.metrics.migrations.inc()
                self.out.put(SnapshotOut(self._snapshot_event(self._migration)))
            self.out.put(end)
            self._ended.set()
        log.info("session ended", extra=self.fields(state=end.state, code=end.code.name, reason=end.reason, message=end.message, steps=self.rec.steps, frames=self.rec.frames))

    # -- decoder link callbacks ------------------------------------------------------------
    def _on_chunk(self, step, frames, decode_ms, diffusion_ms) -> None:
        tl = self.ctx.timeline
        self.conv.note_step_cost((diffusion_ms + decode_ms) / 1e3)
        placed = self.conv.chunk_placement(step)
        if placed is None:
            return  # an interrupt dropped it
        h, w, _ = frames[0].shape
        now = time.monotonic()
        period_ms = (now - self._prev_out) * 1e3 if self._prev_out is not None else 0.0
        a = placed.plan.audio
        message = pb.ConverseResponse(chunk=pb.VideoChunk(  # built outside the conversation's lock
            step_index=step, first_frame_index=step * tl.frames_per_step, width=w, height=h,
            frames=[f.tobytes() for f in frames],
            frame_timestamps_s=[tl.frame_time(placed.first_play_frame + i) for i in range(len(frames))],
            audio_pcm=a.audio.astype("<i2").tobytes(), audio_first_sample=a.start,
            diffusion_ms=diffusion_ms, decode_ms=decode_ms, step_period_ms=period_ms,
            speech=[pb.SpeechSpan(segment=sp.segment, position_samples=sp.position, segment_offset_samples=sp.offset, samples=sp.samples) for sp in a.spans],
            placement=placement_proto(placed.plan.placement)))
        if not self.conv.emit_chunk(placed, message, len(frames)):
            return  # an interrupt dropped it meanwhile
        self._prev_out = now
        if self._first_out is None:
            self._first_out = now
            if self.resume is not None:
                self.ctx.metrics.resume_seconds.observe(now - self.opened_at)
            else:
                self.ctx.metrics.first_frame_seconds.observe(now - self.conv.started_at)
        self._frames += len(frames)
        self._frames_here += len(frames)
        self._steps += 1
        self.rec.steps, self.rec.frames = self._steps, self._frames
        m = self.ctx.metrics
        m.step_seconds.observe(diffusion_ms / 1e3)
        m.decode_seconds.observe(decode_ms / 1e3)
        if period_ms:
            m.step_period_seconds.observe(period_ms / 1e3)
        m.frames.inc(len(frames))
        if now > self._first_out:
            m.fps.set((self._frames_here - len(frames)) / (now - self._first_out))

    def _on_link_error(self, message: str) -> None:
        log.error("decoder failed mid-session", extra=self.fields(error=message))
        self.request_end(SessionEnd("FAILED", grpc.StatusCode.UNAVAILABLE, message, "ERROR"))

    def _on_link_end(self) -> None:
        with self._end_cond:
            self._link_done = True
            self._end_cond.notify_all()
