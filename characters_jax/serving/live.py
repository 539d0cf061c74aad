"""One running session: the request reader, the step loop and the decoder stream.

Threads (all ended by `finish`):
  reader   - consumes the client's requests into the ConversationState: audio, end of speech,
             interrupts, playout reports, end of audio.
  stepper  - the step loop: ConversationState.next_step(s) (the pacing and the step's audio),
             the audio tokens, generator.step, and the (device) latent to the decoder link.
  link     - (DecoderLink) copies latent n to the host while step n + 1 runs, streams it to
             the decoder process and turns each decoded chunk into a VideoChunk, sent
             through ConversationState.emit_chunk (which drops the steps an interrupt cut).
The Converse handler yields what lands on `out`: ("msg", ConverseResponse) and ("chunk",
ConverseResponse, frames, epoch) items (it reports each chunk to ConversationState.delivered once
gRPC has taken it), then one ("end", state, code, message, reason).
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
from characters_jax.serving.conversation import (
    AudioAfterEnd,
    Chunk,
    ConversationState,
    End,
    Note,
)
from characters_jax.serving.decoder_link import DecoderLink

log = logging.getLogger("characters_jax.serving.live")


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """What a stream's `start` asks for."""

    playout_reports: bool
    begin_with_speech: bool


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
        self.out: queue.Queue = queue.Queue()
        self.conv = ConversationState(
            tl, fe.window, lead=options.lead_chunks, playout_reports=stream.playout_reports, begin_with_speech=stream.begin_with_speech,
            limits=rec.limits, max_queued_samples=int(options.max_queued_audio_s * tl.sample_rate),
            history_samples=fe.spec.window_samples + tl.max_step_samples, emit=self._emit)
        ctx.metrics.follow_conversation(self.conv)
        self._lock = threading.Lock()
        self._finished = False
        self._ending: End | None = None
        self._prev_out = None
        self._first_out = None
        self._frames = 0
        self._steps = 0
        self.link = DecoderLink(ctx.decoder, rec.session_id, self._on_chunk, self._on_link_error, self._on_link_end)
        self._stepper = threading.Thread(target=self._step_loop, name=f"stepper-{rec.session_id[:8]}", daemon=True)
        self._reader = None

    def fields(self, **kw):
        return {"fields": {"session_id": self.rec.session_id, **kw}}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, request_iterator, context) -> None:
        self._reader = threading.Thread(target=self._read, args=(request_iterator, context), name=f"reader-{self.rec.session_id[:8]}", daemon=True)
        self.link.start()
        self._reader.start()
        self._stepper.start()

    def finish(self, state: str, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "", reason: str = "ERROR") -> None:
        """Ends the session once (first caller wins): stops the threads, closes the speech
        segments' events, frees the slot, ends the stream."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            self.conv.cancel(End("CANCELLED", message))
            if self._stepper.ident is not None and threading.current_thread() is not self._stepper:
                self._stepper.join(timeout=10)
            if state != "COMPLETED":
                self.link.cancel()
            self.conv.close_segments()
            self.ctx.metrics.refresh_device_stats(self.ctx.generator)
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error while ending the session", extra=self.fields(state=state))
        finally:
            self.table.transition(self.rec, state, code, message, reason)
            self.out.put(("end", state, code, message, reason))
        log.info("session ended", extra=self.fields(state=state, code=code.name, reason=reason, message=message, steps=self.rec.steps, frames=self.rec.frames))

    @property
    def finished(self) -> bool:
        return self._finished

    def _emit(self, item) -> None:
        if isinstance(item, Chunk):
            self.out.put(("chunk", item.message, item.frames, item.epoch))
        else:
            self.ctx.metrics.speech_note(item, self.ctx.timeline.sample_rate)
            self.out.put(("msg", speech_event(item)))

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
            self.finish("FAILED", failure[0], failure[1], "ERROR")
        elif context.is_active():  # half-close: no more audio
            conv.end_audio()

    # -- step loop -------------------------------------------------------------------------
    def _step_loop(self) -> None:
        ctx = self.ctx
        s = 0
        try:
            while True:
                plan = self.conv.next_step(s)
                if isinstance(plan, End):
                    if plan.reason != "CANCELLED":
                        self._ending = plan
                        self.link.finish()
                    return
                tokens = ctx.frontend.tokens(plan.window)
                with ctx.generator_lock:
                    latent = ctx.generator.step(tokens)
                self.link.submit(s, latent)
                s += 1
        except Exception as err:
            log.exception("step loop failed", extra=self.fields(step=s))
            threading.Thread(target=self.finish, args=("FAILED", grpc.StatusCode.INTERNAL, f"step {s} failed: {type(err).__name__}: {err}", "ERROR"), daemon=True).start()

    # -- decoder link callbacks ------------------------------------------------------------
    def _on_chunk(self, step, frames, decode_ms, diffusion_ms) -> None:
        tl = self.ctx.timeline
        self.conv.note_step_cost((diffusion_ms + decode_ms) / 1e3)
        h, w, _ = frames[0].shape
        sent_at = []

        def build(plan, first_play_frame):
            now = time.monotonic()
            period_ms = (now - self._prev_out) * 1e3 if self._prev_out is not None else 0.0
            self._prev_out = now
            sent_at.append((now, period_ms))
            a = plan.audio
            return pb.ConverseResponse(chunk=pb.VideoChunk(
                step_index=step, first_frame_index=step * tl.frames_per_step, width=w, height=h,
                frames=[f.tobytes() for f in frames],
                frame_timestamps_s=[tl.frame_time(first_play_frame + i) for i in range(len(frames))],
                audio_pcm=a.audio.astype("<i2").tobytes(), audio_first_sample=a.start,
                diffusion_ms=diffusion_ms, decode_ms=decode_ms, step_period_ms=period_ms,
                speech=[pb.SpeechSpan(segment=sp.segment, position_samples=sp.position, segment_offset_samples=sp.offset, samples=sp.samples) for sp in a.spans]))

        if not self.conv.emit_chunk(step, len(frames), build):
            return  # an interrupt dropped it
        now, period_ms = sent_at[0]
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
        self.finish("FAILED", grpc.StatusCode.UNAVAILABLE, message, "ERROR")

    def _on_link_end(self) -> None:
        end = self._ending
        if end is None or self._finished:
            return
        if end.reason == "END_OF_AUDIO":  # the speech events of what the client still plays
            self.conv.wait_played_out((self.options.lead_chunks + 2) * self.ctx.timeline.step_seconds + 2.0)
        self.finish("COMPLETED", grpc.StatusCode.OK, end.message, end.reason)
