"""`CharacterService`: the RPC handlers of a generator worker (one session at a time).

The orchestration lives here and in `live.py`; the model lives behind the `Generator`
protocol (engine/interface.py) and the VAE in the decoder process.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading

import grpc
import numpy as np

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.audio.pcm import AudioFormatError, PcmFormat, check_format
from characters_jax.audio.timeline import Timeline
from characters_jax.config import Config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.decoder_link import DecoderClient, DecoderUnavailable
from characters_jax.serving.images import ImageError, ImageLimits, load_reference_image
from characters_jax.serving.live import LiveSession
from characters_jax.serving.metrics import WorkerMetrics
from characters_jax.serving.session import SessionRecord, SessionTable, SlotBusy
from characters_jax.serving.signals import SessionSignals

log = logging.getLogger("characters_jax.serving.worker")

_ENCODINGS = {pb.AudioFormat.PCM_S16LE: "s16le", pb.AudioFormat.PCM_F32LE: "f32le"}


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    lead_chunks: int = 3  # bound on how far the step loop runs ahead of the client's playout clock
    ready_timeout_s: float = 60.0  # a READY session with no Converse is cancelled after this
    audio_timeout_s: float = 30.0  # a running session that gets no audio (and no end) for this long fails
    encode_timeout_s: float = 120.0  # waiting for a (re)starting decoder to encode the image
    image_limits: ImageLimits = ImageLimits()


@dataclasses.dataclass
class WorkerContext:
    """What sessions share: the config, the generator (used under its lock), the audio front
    end, the decoder channel and the metrics."""

    config: Config
    generator: object
    generator_lock: threading.Lock
    frontend: AudioFrontEnd
    timeline: Timeline
    decoder: DecoderClient
    metrics: WorkerMetrics


def session_proto(rec: SessionRecord, cfg: Config) -> pb.Session:
    v = cfg.video
    return pb.Session(
        session_id=rec.session_id, state=pb.SessionState.Value(rec.state), status_code=rec.status_code.value[0],
        status_message=rec.status_message, steps=rec.steps, frames=rec.frames, created_unix_ms=rec.created_unix_ms,
        width=v.width, height=v.height, fps=v.fps, frames_per_step=v.frames_per_step, prompt_tokens=rec.prompt_tokens, seed=rec.seed,
    )


class CharacterServicer(characters_pb2_grpc.CharacterServiceServicer):
    def __init__(self, ctx: WorkerContext, options: WorkerOptions, table: SessionTable):
        self.ctx, self.options, self.table = ctx, options, table
        self._live: LiveSession | None = None
        self._live_lock = threading.Lock()
        self.shutting_down = threading.Event()

    # -- unary RPCs ------------------------------------------------------------------------
    def CreateSession(self, request, context):
        cfg = self.ctx.config
        if self.shutting_down.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        busy = self.table.live
        if busy is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this worker is serving session {busy.session_id} ({busy.state}); one session per worker")
        try:
            rgb = load_reference_image(request.image, cfg.video.width, cfg.video.height, self.options.image_limits)
        except ImageError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        prompt = request.prompt.encode("utf-8")
        if len(prompt) > cfg.cache.max_prompt_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {len(prompt)} UTF-8 bytes is over the limit of {cfg.cache.max_prompt_tokens}")
        seed = int(request.seed) or secrets.randbits(31)
        try:
            rec = self.table.reserve(seed, len(prompt))
        except SlotBusy as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        fields = {"fields": {"session_id": rec.session_id, "prompt_tokens": len(prompt), "seed": seed}}
        log.info("session created", extra=fields)
        try:
            g = self.ctx.generator
            latent = self.ctx.decoder.encode(rgb, (cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels), timeout=self.options.encode_timeout_s)
            with self.ctx.generator_lock:
                g.start_session(latent, list(prompt), seed)
        except DecoderUnavailable as err:
            self.table.transition(rec, "FAILED", grpc.StatusCode.UNAVAILABLE, str(err))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:
            log.exception("prefill failed", extra=fields)
            self.table.transition(rec, "FAILED", grpc.StatusCode.INTERNAL, f"prefill failed: {err}")
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(err).__name__}: {err}")
        self.table.transition(rec, "READY")
        timer = threading.Timer(self.options.ready_timeout_s, self._expire_ready, args=(rec,))
        timer.daemon = True
        timer.start()
        log.info("session ready", extra=fields)
        return session_proto(rec, cfg)

    def _expire_ready(self, rec: SessionRecord) -> None:
        # Only a session still READY expires: a RUNNING one belongs to its LiveSession.
        msg = f"no Converse within {self.options.ready_timeout_s:g} s of READY"
        if self.table.transition(rec, "CANCELLED", grpc.StatusCode.DEADLINE_EXCEEDED, msg, only_from="READY"):
            log.info("ready session expired", extra={"fields": {"session_id": rec.session_id}})

    def _lookup(self, session_id: str, context) -> SessionRecord:
        rec = self.table.get(session_id) if session_id else None
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id!r} not found on this worker")
        return rec

    def GetSession(self, request, context):
        return session_proto(self._lookup(request.session_id, context), self.ctx.config)

    def CloseSession(self, request, context):
        rec = self._lookup(request.session_id, context)
        self.end_session(rec, "closed by the client")
        return session_proto(rec, self.ctx.config)

    def end_session(self, rec: SessionRecord, reason: str) -> None:
        """READY or RUNNING -> CANCELLED; a finished session is left as it is."""
        with self._live_lock:
            live = self._live if self._live is not None and self._live.rec is rec else None
        if live is not None:
            live.finish("CANCELLED", grpc.StatusCode.CANCELLED, reason)
        else:
            self.table.transition(rec, "CANCELLED", grpc.StatusCode.CANCELLED, reason)

    def shutdown(self) -> None:
        """SIGTERM: refuse new sessions and end the live one as CANCELLED."""
        self.shutting_down.set()
        rec = self.table.live
        if rec is not None:
            self.end_session(rec, "worker shutting down")

    # -- the stream ------------------------------------------------------------------------
    def Converse(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Converse: the first request must be `start`; the stream was empty")
        if first.WhichOneof("event") != "start":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Converse: the first request must be `start`, got {first.WhichOneof('event')!r}")
        start = first.start
        rec = self._lookup(start.session_id, context)
        f = start.audio_format
        try:
            check_format(PcmFormat(f.sample_rate_hz, f.channels, _ENCODINGS.get(f.encoding, "unspecified")), self.ctx.config.audio.sample_rate)
        except AudioFormatError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        v = self.ctx.config.video
        signals = SessionSignals(v.fps, v.frames_per_step, start.playout_reports, self.options.audio_timeout_s)
        live = LiveSession(rec, self.table, self.ctx, signals, self.options.lead_chunks)
        with self._live_lock:
            if not self.table.transition(rec, "RUNNING"):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {rec.session_id} is {rec.state}, not READY; create a new session")
            self._live = live
        context.add_callback(lambda: live.finish("CANCELLED", grpc.StatusCode.CANCELLED, "client disconnected"))
        log.info("session running", extra=live.fields(playout_reports=start.playout_reports, lead_chunks=self.options.lead_chunks))
        live.start(request_iterator, context)
        while True:
            item = live.out.get()
            if item[0] == "chunk":
                yield item[1]
                continue
            _, state, code, message = item
            yield pb.ConverseResponse(session_event=pb.SessionEvent(state=pb.SessionState.Value(state), message=message, steps=rec.steps))
            if code != grpc.StatusCode.OK:
                context.abort(code, message)
            return
