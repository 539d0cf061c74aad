"""`CharacterService`: the RPC handlers of a generator worker (one session at a time).

The orchestration lives here, in `live.py` and `conversation.py`; the model lives behind
the `Generator` protocol (engine/interface.py) and the VAE in the decoder process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import secrets
import threading
import time

import grpc

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.audio.pcm import AudioFormatError, PcmFormat, check_format
from characters_jax.audio.timeline import Timeline
from characters_jax.config import Config, WorkerOptions
from characters_jax.config.serve import MAX_JITTER_BUFFER_S
from characters_jax.engine.interface import Generator
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.conversation import Chunk, Limits, Placement
from characters_jax.serving.decoder_link import DecoderClient, DecoderUnavailable
from characters_jax.serving.health import WorkerHealth
from characters_jax.serving.live import LiveSession, ResumePlan, SessionEnd, SnapshotOut, SpeechOut, StreamOptions
from characters_jax.serving.metrics import WorkerMetrics
from characters_jax.serving.session import SessionRecord, SessionTable, SlotBusy
from characters_jax.serving.snapshot import SessionSnapshots
from characters_jax.serving.snapshot_store import SnapshotError, SnapshotStore
from characters_jax.wire.images import ImageError, load_reference_image
from characters_jax.wire.service import AUDIO_ENCODINGS

log = logging.getLogger("characters_jax.serving.worker")

END_WAIT_S = 10.0  # how long CloseSession and the drain wait for a running session's step loop to end it
DECODER_WAIT_S = 5.0  # a resume waits this long for the decoder process (else UNAVAILABLE: the client tries another worker)

__all__ = ["CharacterServicer", "WorkerContext", "WorkerOptions", "resolve_limits", "session_proto"]


@dataclasses.dataclass
class WorkerContext:
    """What sessions share: the config, the generator (used under its lock, through the
    `Generator` protocol only), the audio front end, the decoder channel, the metrics and
    the snapshot store (None: sessions neither migrate nor resume on this worker)."""

    config: Config
    generator: Generator
    generator_lock: threading.Lock
    frontend: AudioFrontEnd
    timeline: Timeline
    decoder: DecoderClient
    metrics: WorkerMetrics
    snapshot_store: SnapshotStore | None = None


def resolve_limits(requested: pb.SessionLimits, options: WorkerOptions) -> Limits:
    """A client's limits within the worker's: 0 means the worker's, more means the worker's.
    Raises ValueError on a negative or non-finite value."""
    out = {}
    for name, default in (("max_duration_s", options.max_duration_s), ("idle_timeout_s", options.idle_timeout_s)):
        v = getattr(requested, name)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"limits.{name}: must be a finite number of seconds >= 0 (0: the worker's {default:g}), got {v}")
        out[name] = min(v, default) if v > 0 else default
    return Limits(**out)


def session_proto(rec: SessionRecord, cfg: Config, worker_id: str) -> pb.Session:
    v = cfg.video
    return pb.Session(
        session_id=rec.session_id, state=pb.SessionState.Value(rec.state), status_code=rec.status_code.value[0],
        status_message=rec.status_message, steps=rec.steps, frames=rec.frames, created_unix_ms=rec.created_unix_ms,
        width=v.width, height=v.height, fps=v.fps, frames_per_step=v.frames_per_step, prompt_tokens=rec.prompt_tokens, seed=rec.seed,
        limits=pb.SessionLimits(max_duration_s=rec.limits.max_duration_s, idle_timeout_s=rec.limits.idle_timeout_s),
        end_reason=pb.EndReason.Value(rec.end_reason), worker_id=worker_id, resumable=rec.resumable,
        snapshot_interval_s=rec.snapshot_interval_s,
    )


class CharacterServicer(characters_pb2_grpc.CharacterServiceServicer):
    def __init__(self, ctx: WorkerContext, options: WorkerOptions, table: SessionTable, health: WorkerHealth):
        self.ctx, self.options, self.table, self.health = ctx, options, table, health
        self._live: LiveSession | None = None
        self._live_lock = threading.Lock()
        self.draining = threading.Event()

    @property
    def live(self) -> LiveSession | None:
        """The session that runs or ran last on a Converse stream (None before the first)."""
        with self._live_lock:
            return self._live

    def _proto(self, rec: SessionRecord) -> pb.Session:
        return session_proto(rec, self.ctx.config, self.options.worker_id)

    # -- opening a session (CreateSession, or Converse with `create`) -----------------------
    def _open(self, request: pb.CreateSessionRequest, context) -> SessionRecord:
        """Validates, takes the slot, encodes the image and prefills: the session is READY.
        Aborts the RPC with a clear status otherwise."""
        cfg = self.ctx.config
        if self.draining.is_set():
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, "this worker is draining (shutting down); open the session on another worker")
        busy = self.table.live
        if busy is not None:
            self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"this worker is serving another session ({busy.state}); one session per worker")
        try:
            rgb = load_reference_image(request.image, cfg.video.width, cfg.video.height, self.options.image_limits)
            limits = resolve_limits(request.limits, self.options)
        except (ImageError, ValueError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        prompt = request.prompt.encode("utf-8")
        if len(prompt) > cfg.cache.max_prompt_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {len(prompt)} UTF-8 bytes is over the limit of {cfg.cache.max_prompt_tokens}")
        seed = int(request.seed) or secrets.randbits(31)
        try:
            rec = self.table.reserve(seed, len(prompt), limits)
        except SlotBusy as err:
            self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        fields = {"fields": {"session_id": rec.session_id, "prompt_tokens": len(prompt), "seed": seed, "max_duration_s": limits.max_duration_s, "idle_timeout_s": limits.idle_timeout_s}}
        log.info("session created", extra=fields)
        try:
            latent = self.ctx.decoder.encode(rgb, (cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels), timeout=self.options.encode_timeout_s)
            with self.ctx.generator_lock:
                self.ctx.generator.start_session(latent, list(prompt), seed)
        except DecoderUnavailable as err:
            self.table.transition(rec, "FAILED", grpc.StatusCode.UNAVAILABLE, str(err), "ERROR")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:
            log.exception("prefill failed", extra=fields)
            self.table.transition(rec, "FAILED", grpc.StatusCode.INTERNAL, f"prefill failed: {err}", "ERROR")
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(err).__name__}: {err}")
        self.table.transition(rec, "READY")
        log.info("session ready", extra=fields)
        return rec

    def _resume(self, request: pb.ConverseRequest.Resume, context) -> tuple[SessionRecord, ResumePlan, object]:
        """Finds the snapshot, claims the session, checks and loads the snapshot and the
        client's placements, restores the generator: the session is READY again, with its
        id and owner. Returns (record, plan, claim). Aborts with a clear status otherwise
        (the protocol's resume errors)."""
        store = self.ctx.snapshot_store
        if store is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "resume: this worker has no snapshot store (serve.snapshot_dir); "
                          "it cannot resume sessions")
        if self.draining.is_set():
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, "this worker is draining (shutting down); resume the session on another worker")
        busy = self.table.live
        if busy is not None:
            self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"this worker is serving another session ({busy.state}); one session per worker")
        step = request.step if request.HasField("step") else None
        claim = None
        try:
            snap = store.read(request.session_id, request.session_token, step, self.ctx.generator.state_identity())
            claim = store.claim(request.session_id, self.options.worker_id)
            snap.load()
            placements = replay_placements(request.placements, snap.step, int(snap.manifest["inputs"]))
            if not self.ctx.decoder.wait_ready(DECODER_WAIT_S):
                raise DecoderUnavailable(f"the decoder process at {self.ctx.decoder.address} is not reachable")
            info = snap.manifest["session"]
            resumed = SessionRecord(request.session_id, int(info["seed"]), int(info["prompt_tokens"]), int(info["created_unix_ms"]),
                                    Limits(**info["limits"]), token=request.session_token)
            rec = self.table.reserve(resumed.seed, resumed.prompt_tokens, resumed.limits, resumed=resumed)
        except (SnapshotError, ValueError, DecoderUnavailable, SlotBusy) as err:
            if claim is not None:
                claim.release()
            code = {ValueError: "FAILED_PRECONDITION", DecoderUnavailable: "UNAVAILABLE", SlotBusy: "RESOURCE_EXHAUSTED"}.get(type(err))
            context.abort(getattr(grpc.StatusCode, code or err.code), f"resume: {err}")
        fields = {"fields": {"session_id": rec.session_id, "step": snap.step, "regenerate": len(placements), "from_worker": snap.manifest["worker_id"]}}
        try:
            with self.ctx.generator_lock:
                self.ctx.generator.restore_state(snap.group("generator"), snap.step)
        except ValueError as err:
            claim.release()
            self.table.transition(rec, "FAILED", grpc.StatusCode.FAILED_PRECONDITION, str(err), "ERROR")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"resume: {err}")
        self.table.transition(rec, "READY")
        log.info("session resumed from a snapshot", extra=fields)
        return rec, ResumePlan(snap, placements, max(0.0, time.time() - float(snap.manifest["taken_unix"]))), claim

    def _session_snapshots(self, rec: SessionRecord, resumable: bool, claim=None) -> SessionSnapshots | None:
        """The session's snapshots when it is resumable here (its claim taken unless given),
        else None."""
        store = self.ctx.snapshot_store
        if store is None or not resumable:
            return None
        if claim is None:
            try:
                claim = store.claim(rec.session_id, self.options.worker_id)
            except (SnapshotError, OSError) as err:
                log.warning("the session cannot be snapshotted", extra={"fields": {"session_id": rec.session_id, "error": str(err)}})
                return None
        rec.resumable, rec.snapshot_interval_s = True, self.options.snapshot_interval_s
        return SessionSnapshots(store, claim, self.options.snapshot_interval_s, self.ctx.metrics)

    def _refuse(self, context, code: grpc.StatusCode, message: str) -> None:
        self.ctx.metrics.refused.labels(code.name).inc()
        context.abort(code, message)

    # -- unary RPCs ------------------------------------------------------------------------
    def CreateSession(self, request, context):
        rec = self._open(request, context)
        timer = threading.Timer(self.options.ready_timeout_s, self._expire_ready, args=(rec,))
        timer.daemon = True
        timer.start()
        return self._owner_proto(rec)

    def _owner_proto(self, rec: SessionRecord) -> pb.Session:
        """The Session for its creator: the only reply that carries the session token."""
        reply = self._proto(rec)
        reply.session_token = rec.token
        return reply

    def _expire_ready(self, rec: SessionRecord) -> None:
        # Only a session still READY expires: a RUNNING one belongs to its LiveSession.
        msg = f"no Converse within {self.options.ready_timeout_s:g} s of READY"
        if self.table.transition(rec, "CANCELLED", grpc.StatusCode.DEADLINE_EXCEEDED, msg, "READY_TIMEOUT", only_from="READY"):
            log.info("ready session expired", extra={"fields": {"session_id": rec.session_id}})

    def _lookup(self, session_id: str, token: str, context) -> SessionRecord:
        """The session, for the holder of its token; NOT_FOUND alike for an unknown id and a
        missing or wrong token."""
        rec = self.table.find(session_id, token)
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id!r} not found on this worker, or its session_token is missing or wrong")
        return rec

    def GetSession(self, request, context):
        return self._proto(self._lookup(request.session_id, request.session_token, context))

    def CloseSession(self, request, context):
        rec = self._lookup(request.session_id, request.session_token, context)
        self.end_session(rec, "closed by the client", "CLOSED")
        return self._proto(rec)

    def end_session(self, rec: SessionRecord, message: str, reason: str) -> None:
        """READY or RUNNING -> CANCELLED; a finished session is left as it is. A running
        session is ended by its step loop: this waits up to END_WAIT_S for it."""
        with self._live_lock:
            live = self._live if self._live is not None and self._live.rec is rec else None
        if live is None:
            self.table.transition(rec, "CANCELLED", grpc.StatusCode.CANCELLED, message, reason)
        elif not live.request_end(SessionEnd("CANCELLED", grpc.StatusCode.CANCELLED, message, reason), wait_s=END_WAIT_S):
            log.warning("the session has not ended yet", extra=live.fields(reason=reason, waited_s=END_WAIT_S))

    def drain(self, timeout_s: float) -> str:
        """SIGTERM: NOT_SERVING at once, no new sessions (UNAVAILABLE); a resumable live
        session migrates (snapshot at its next step boundary, then it ends MIGRATED), any
        other goes on for up to `timeout_s`, then ends CANCELLED (DRAIN_TIMEOUT). Returns
        what happened: "idle", "migrated", "finished" (the session ended within the
        deadline) or "cancelled"."""
        self.draining.set()
        self.health.drain()
        rec = self.table.live
        if rec is None:
            return "idle"
        live = self.live
        migrating = live is not None and live.rec is rec and live.request_migration()
        log.info("draining", extra={"fields": {"session_id": rec.session_id, "state": rec.state, "drain_timeout_s": timeout_s,
                                               "migrating": migrating}})
        if self.table.wait_idle(timeout_s):
            return "migrated" if rec.end_reason == "MIGRATED" else "finished"
        rec = self.table.live
        if rec is not None:
            self.end_session(rec, f"the worker is shutting down: the session outlived the drain timeout of {timeout_s:g} s", "DRAIN_TIMEOUT")
        self.table.wait_idle(10.0)
        return "cancelled"

    # -- the stream ------------------------------------------------------------------------
    def Converse(self, request_iterator, context):
        from characters_jax.serving.request_reader import first_request

        first = first_request(request_iterator, context)  # within the stream's first-request deadline
        kind = first.WhichOneof("event")
        if kind != "start":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"Converse: {kind or 'a request with no event'} outside a session: "
                          "the first request must be `start` (with a session_id, or `create` with an image)")
        start = first.start
        f = start.audio_format
        try:
            check_format(PcmFormat(f.sample_rate_hz, f.channels, AUDIO_ENCODINGS.get(f.encoding, "unspecified")), self.ctx.config.audio.sample_rate)
        except AudioFormatError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        jitter_buffer_s = start.jitter_buffer_s if start.HasField("jitter_buffer_s") else None
        if jitter_buffer_s is not None and not (jitter_buffer_s == -1 or 0 <= jitter_buffer_s <= MAX_JITTER_BUFFER_S):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"start.jitter_buffer_s: must be -1 (adaptive) or within [0, {MAX_JITTER_BUFFER_S:g}] seconds, "
                          f"got {jitter_buffer_s}")
        which = start.WhichOneof("session")
        resume, claim = None, None
        stream = StreamOptions(start.playout_reports, start.begin_with_speech, jitter_buffer_s)
        if which == "create":
            rec = self._open(start.create, context)
        elif which == "session_id" and start.session_id:
            rec = self._lookup(start.session_id, start.session_token, context)
        elif which == "resume":
            rec, resume, claim = self._resume(start.resume, context)
            conv = resume.snapshot.manifest["conversation"]  # the session's own stream options
            stream = StreamOptions(start.playout_reports, bool(conv["begin_with_speech"]), float(conv["jitter_buffer_s"]))
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start: needs a session_id (from CreateSession on this worker), `create` "
                          "with an image, or `resume` with a snapshot")
        snapshots = self._session_snapshots(rec, start.resumable or resume is not None, claim)
        live = LiveSession(rec, self.table, self.ctx, stream, self.options, snapshots, resume)
        with self._live_lock:
            if not self.table.transition(rec, "RUNNING"):
                if snapshots is not None:
                    snapshots.close(remove=False)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {rec.session_id} is {rec.state}, not READY; create a new session")
            self._live = live
        gone = functools.partial(live.request_end, SessionEnd("CANCELLED", grpc.StatusCode.CANCELLED, "the client went away (the RPC ended)", "CLIENT_GONE"))
        live.start(request_iterator, context)
        if not context.add_callback(gone):  # it ended while the session was opening
            gone()
            return
        log.info("session running", extra=live.fields(playout_reports=start.playout_reports, begin_with_speech=start.begin_with_speech,
                                                      lead_chunks=self.options.lead_chunks, resumable=rec.resumable))
        yield pb.ConverseResponse(session=self._owner_proto(rec) if which == "create" else self._proto(rec))
        if resume is not None:
            self.ctx.metrics.resumes.labels("recovery" if resume.placements else "migration").inc()
            m = resume.snapshot.manifest
            yield pb.ConverseResponse(resumed=pb.SessionResumed(
                step=resume.snapshot.step, inputs=int(m["inputs"]), regenerated_steps=len(resume.placements),
                next_step=resume.snapshot.step + len(resume.placements), from_worker_id=str(m["worker_id"]), snapshot_age_s=resume.age_s))
        while True:
            match live.out.get():
                case SpeechOut(message=message) | SnapshotOut(message=message):
                    yield message
                case Chunk(message=message, frames=frames, epoch=epoch):
                    yield message
                    live.conv.delivered(frames, epoch)
                case SessionEnd(state=state, code=code, message=message, reason=reason):
                    yield pb.ConverseResponse(session_event=pb.SessionEvent(
                        state=pb.SessionState.Value(state), message=message, steps=rec.steps, end_reason=pb.EndReason.Value(reason),
                        frames=rec.frames))
                    if code != grpc.StatusCode.OK:
                        context.abort(code, message)
                    return


def replay_placements(placements, step: int, inputs: int) -> tuple[Placement, ...]:
    """The client's placements (StepPlacement protos) of the steps from a snapshot's `step`
    on: they must follow it step by step, their inputs never below the snapshot's `inputs`
    nor decreasing. Earlier steps are ignored. Raises ValueError saying what is wrong."""
    out = []
    for p in sorted((p for p in placements if p.step >= step), key=lambda p: p.step):
        expected = step + len(out)
        if p.step != expected:
            raise ValueError(f"placements: step {p.step} where step {expected} follows the snapshot of step {step} "
                             "(send every step received or dropped from the snapshot's step on)")
        floor = out[-1].inputs if out else inputs
        if p.inputs < floor:
            raise ValueError(f"placements: step {p.step} placed after input {p.inputs}, before input {floor} of the step "
                             "or snapshot before it")
        out.append(Placement(int(p.step), int(p.inputs), bool(p.segment_held), bool(p.dropped)))
    return tuple(out)
