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
import logging
import queue
import threading
import time

import grpc

from characters_jax.audio.pcm import AudioFormatError, pcm_to_int16
from characters_jax.audio.speech import SpeechQueueFull
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.conversation import AudioAfterEnd, Chunk, ConversationState, End, Note
from characters_jax.serving.decoder_link import DecoderLink

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


def speech_event(note: Note) -> pb.ConverseResponse:
    return pb.ConverseResponse(speech=pb.SpeechEvent(
        kind=pb.SpeechEvent.Kind.Value(note.kind), segment=note.segment, position_samples=note.position,
        segment_samples=note.segment_samples, interrupted=note.interrupted, played_samples=note.played_samples,
        resume_step=note.resume_step))


class LiveSession:
    def __init__(self, rec, table, ctx, stream: StreamOptions, options):
        """ctx: the worker's WorkerContext; options: its WorkerOptions."""
        self.rec, self.table, self.ctx, self.options = rec, table, ctx, options
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
        self.link = DecoderLink(ctx.decoder, rec.session_id, self._on_chunk, self._on_link_error, self._on_link_end)
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
            conv.end_audio()

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
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error before the session's end", extra=self.fields())
        finally:
            self._finish(own)

    def _step_loop(self) -> End | None:
        """Runs steps until the session ends. Returns the loop's own end (end of audio, max
        duration, idle timeout), or None when an end was posted (a failed step posts one)."""
        ctx = self.ctx
        s = 0
        try:
            while True:
                plan = self.conv.next_step(s)
                if isinstance(plan, End):
                    return None if plan.reason == "CANCELLED" else plan
                tokens = ctx.frontend.tokens(plan.window)
                with ctx.generator_lock:
                    latent = ctx.generator.step(tokens)
                self.link.submit(s, latent)
                s += 1
        except Exception as err:
            log.exception("step loop failed", extra=self.fields(step=s))
            self.request_end(SessionEnd("FAILED", grpc.StatusCode.INTERNAL, f"step {s} failed: {type(err).__name__}: {err}", "ERROR"))
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
                self._end = (SessionEnd("COMPLETED", grpc.StatusCode.OK, own.message, own.reason) if own is not None else
                             SessionEnd("FAILED", grpc.StatusCode.INTERNAL, "the step loop stopped without a reason", "ERROR"))
            end = self._end
        try:
            self.conv.cancel(End("CANCELLED", end.message))
            if end.state != "COMPLETED":
                self.link.cancel()
            self.conv.close_segments()
            self.ctx.metrics.refresh_device_stats(self.ctx.generator)
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error while ending the session", extra=self.fields(state=end.state))
        finally:
            self.table.transition(self.rec, end.state, end.code, end.message, end.reason)
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
            speech=[pb.SpeechSpan(segment=sp.segment, position_samples=sp.position, segment_offset_samples=sp.offset, samples=sp.samples) for sp in a.spans]))
        if not self.conv.emit_chunk(placed, message, len(frames)):
            return  # an interrupt dropped it meanwhile
        self._prev_out = now
        if self._first_out is None:
            self._first_out = now
            self.ctx.metrics.first_frame_seconds.observe(now - self.conv.started_at)
        self._frames += len(frames)
        self._steps += 1
        self.rec.steps, self.rec.frames = self._steps, self._frames
        m = self.ctx.metrics
        m.step_seconds.observe(diffusion_ms / 1e3)
        m.decode_seconds.observe(decode_ms / 1e3)
        if period_ms:
            m.step_period_seconds.observe(period_ms / 1e3)
        m.frames.inc(len(frames))
        if now > self._first_out:
            m.fps.set((self._frames - len(frames)) / (now - self._first_out))

    def _on_link_error(self, message: str) -> None:
        log.error("decoder failed mid-session", extra=self.fields(error=message))
        self.request_end(SessionEnd("FAILED", grpc.StatusCode.UNAVAILABLE, message, "ERROR"))

    def _on_link_end(self) -> None:
        with self._end_cond:
            self._link_done = True
            self._end_cond.notify_all()
