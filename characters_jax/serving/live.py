"""One running session: the step loop, the request reader and the decoder stream.

Threads (all ended by `finish`):
  reader   - consumes the client's requests: audio, playout reports, end of audio.
  stepper  - the step loop: waits for step s's audio and for room under the bounded lead
             over the client's playout clock, computes the audio tokens, dispatches
             generator.step and hands the (device) latent to the decoder link.
  link     - (DecoderLink) copies latent n to the host while step n + 1 runs, streams it
             to the decoder process, and turns each decoded chunk into a VideoChunk.
The Converse handler yields what lands on `out` (chunks, then one end marker).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from characters_jax.audio.pcm import AudioFormatError, pcm_to_int16
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.decoder_link import DecoderLink
from characters_jax.serving.signals import SessionSignals

log = logging.getLogger("characters_jax.serving.live")


class LiveSession:
    def __init__(self, rec, table, ctx, signals: SessionSignals, lead_chunks: int):
        """ctx: the worker's WorkerContext (generator, its lock, front end, decoder, metrics)."""
        self.rec, self.table, self.ctx, self.signals = rec, table, ctx, signals
        self.lead = lead_chunks
        self.out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._finished = False
        self._prev_out = None
        self._first_out = None
        self._frames = 0
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

    def finish(self, state: str, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> None:
        """Ends the session once (first caller wins): stops the threads, frees the slot."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            self.signals.cancel(code, message)
            if threading.current_thread() is not self._stepper:
                self._stepper.join(timeout=10)
            if state != "COMPLETED":
                self.link.cancel()
            self.ctx.metrics.refresh_device_stats(self.ctx.generator)
        except Exception:  # bookkeeping must never keep the session from ending
            log.exception("error while ending the session", extra=self.fields(state=state))
        finally:
            self.table.transition(self.rec, state, code, message)
            self.out.put(("end", state, code, message))
        log.info("session ended", extra=self.fields(state=state, code=code.name, reason=message, steps=self.rec.steps, frames=self.rec.frames))

    @property
    def finished(self) -> bool:
        return self._finished

    # -- reader ----------------------------------------------------------------------------
    def _read(self, request_iterator, context) -> None:
        """Consumes the requests; a bad one ends the session FAILED (outside the try, so an
        error while ending is not mistaken for the RPC going away)."""
        m = self.ctx.metrics
        failure = None
        try:
            for req in request_iterator:
                kind = req.WhichOneof("event")
                if kind == "audio":
                    try:
                        pcm_to_int16(req.audio.pcm)
                    except AudioFormatError as err:
                        failure = str(err)
                        break
                    self.signals.add_audio(req.audio.pcm)
                elif kind == "playout":
                    m.underruns.inc(self.signals.report_playout(req.playout.frames_played, req.playout.underruns))
                elif kind == "end_of_audio":
                    self.signals.end_audio()
                else:
                    failure = f"unexpected event {kind!r} after start"
                    break
        except Exception:  # the RPC went away; the done-callback ends the session
            return
        if failure is not None:
            self.finish("FAILED", grpc.StatusCode.INVALID_ARGUMENT, failure)
        elif context.is_active():  # half-close: no more audio
            self.signals.end_audio()

    # -- step loop -------------------------------------------------------------------------
    def _step_loop(self) -> None:
        ctx, sig = self.ctx, self.signals
        tl, fe = ctx.timeline, ctx.frontend
        s = 0
        try:
            while True:
                r = sig.wait_for_step(s, tl.step_span(s)[1], tl.steps_for, self.lead)
                if r == "cancelled":
                    return
                if r == "stalled":
                    msg = f"client idle: no audio (or no playout report) for {sig.audio_timeout_s:g} s and no end_of_audio"
                    threading.Thread(target=self.finish, args=("FAILED", grpc.StatusCode.DEADLINE_EXCEEDED, msg), daemon=True).start()
                    return
                if r == "done":
                    self.link.finish()
                    return
                tokens = fe.tokens(fe.window(sig.pcm, s))
                with ctx.generator_lock:
                    latent = ctx.generator.step(tokens)
                self.link.submit(s, latent)
                s += 1
        except Exception as err:
            log.exception("step loop failed", extra=self.fields(step=s))
            threading.Thread(target=self.finish, args=("FAILED", grpc.StatusCode.INTERNAL, f"step {s} failed: {type(err).__name__}: {err}"), daemon=True).start()

    # -- decoder link callbacks ------------------------------------------------------------
    def _on_chunk(self, step, frames, decode_ms, diffusion_ms) -> None:
        tl, m = self.ctx.timeline, self.ctx.metrics
        start, end = tl.step_span(step)
        audio = self.signals.pcm(start, end)
        now = time.monotonic()
        period_ms = (now - self._prev_out) * 1e3 if self._prev_out is not None else 0.0
        self._prev_out = now
        if self._first_out is None:
            self._first_out = now
        f0 = step * tl.frames_per_step
        h, w, _ = frames[0].shape
        chunk = pb.VideoChunk(
            step_index=step, first_frame_index=f0, width=w, height=h,
            frames=[f.tobytes() for f in frames],
            frame_timestamps_s=[tl.frame_time(f0 + i) for i in range(len(frames))],
            audio_pcm=audio.astype("<i2").tobytes(), audio_first_sample=start,
            diffusion_ms=diffusion_ms, decode_ms=decode_ms, step_period_ms=period_ms,
        )
        self._frames += len(frames)
        self.rec.steps, self.rec.frames = step + 1, self._frames
        m.step_seconds.observe(diffusion_ms / 1e3)
        m.decode_seconds.observe(decode_ms / 1e3)
        if period_ms:
            m.step_period_seconds.observe(period_ms / 1e3)
        m.frames.inc(len(frames))
        if now > self._first_out:
            m.fps.set((self._frames - len(frames)) / (now - self._first_out))
        self.out.put(("chunk", pb.ConverseResponse(chunk=chunk)))
        self.signals.chunk_sent()

    def _on_link_error(self, message: str) -> None:
        log.error("decoder failed mid-session", extra=self.fields(error=message))
        self.finish("FAILED", grpc.StatusCode.UNAVAILABLE, message)

    def _on_link_end(self) -> None:
        if not self.signals.cancelled:
            self.finish("COMPLETED")
