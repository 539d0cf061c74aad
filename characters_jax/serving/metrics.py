"""Prometheus metrics of a worker, in their own registry (served on the [serve] table's metrics_port with
/healthz: metrics_http.py).

The model: step time histogram (diffusion per step), step period and decode histograms,
time to the first frame, fps of the running session (0 while none runs), frames, and the
bounded-resources gauges (compiled programs, live device memory, refreshed after every
session).
Sessions: by state (live gauge, terminal counter), by end reason, refused sessions,
interrupts, playout underruns (reported by clients), speech queued ahead of its step, and
silence inserted inside speech segments whose audio arrived late.
Snapshots: committed by kind, failures, bytes, the time from the boundary to the commit and
the step loop's own share of it, the store's size; migrations and resumes.
The process: decoder restarts and whether the decoder's channel is up, the health statuses,
RPC errors by method and code, and the saturation of each RPC pool (threads, busy, queued)
and admission counter (admitted, limit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import prometheus_client as prom

from characters_jax.device_memory import device_memory
from characters_jax.engine.interface import Generator
from characters_jax.serving.conversation import STARTED, STOPPED

_STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.1667, 0.2, 0.3, 0.5, 1.0, 2.0)
_FIRST_FRAME_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
STATES = ("NOT_READY", "READY", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")


class WhileRunning:
    """A value that reads 0 while no session runs (`set` stores it; `get` reads it)."""

    def __init__(self, running: Callable[[], bool]):
        self._running = running
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def get(self) -> float:
        return self.value if self._running() else 0.0


class WorkerMetrics:
    def __init__(self):
        r = self.registry = prom.CollectorRegistry()
        self.step_seconds = prom.Histogram("characters_step_seconds", "Diffusion compute time per generator step", buckets=_STEP_BUCKETS, registry=r)
        self.step_period_seconds = prom.Histogram("characters_step_period_seconds", "Interval between consecutive video chunks leaving the worker", buckets=_STEP_BUCKETS, registry=r)
        self.decode_seconds = prom.Histogram("characters_decode_seconds", "Decoder compute time per chunk (decoder process)", buckets=_STEP_BUCKETS, registry=r)
        self.first_frame_seconds = prom.Histogram("characters_first_frame_seconds", "From a session's stream starting (RUNNING) to its first video chunk handed to gRPC", buckets=_FIRST_FRAME_BUCKETS, registry=r)
        self._running = 0
        self.fps = WhileRunning(lambda: self._running > 0)
        prom.Gauge("characters_fps", "Sustained frames per second of the running session (0 while none runs)", registry=r).set_function(self.fps.get)
        self.underruns = prom.Counter("characters_playout_underruns", "Playout underruns reported by clients", registry=r)
        self.interrupts = prom.Counter("characters_interrupts", "Interrupts acknowledged", registry=r)
        self.refused = prom.Counter("characters_sessions_refused", "New sessions refused (RESOURCE_EXHAUSTED: busy; UNAVAILABLE: draining)", ["code"], registry=r)
        self.frames = prom.Counter("characters_frames", "Frames sent to clients", registry=r)
        self.sessions = prom.Gauge("characters_sessions", "Sessions on this worker by state (live ones)", ["state"], registry=r)
        self.sessions_ended = prom.Counter("characters_sessions_ended", "Sessions that ended, by final state", ["state"], registry=r)
        self.sessions_ended_by_reason = prom.Counter("characters_sessions_ended_by_reason", "Sessions that ended, by end reason (an EndReason name)", ["reason"], registry=r)
        self._conversation = None  # the live session's ConversationState
        prom.Gauge("characters_queued_speech_seconds", "Speech received and not yet placed on the running session's timeline", registry=r).set_function(self._queued_speech_seconds)
        self.inserted_silence_seconds = prom.Counter("characters_inserted_silence_seconds", "Silence placed inside speech segments because their audio arrived late (the gaps between a segment's first and last sample)", registry=r)
        self._segment_starts: dict[int, int] = {}  # segment -> timeline sample of its first sample (the live session's)
        self.decoder_restarts = prom.Counter("characters_decoder_restarts", "Restarts of the worker's decoder process", registry=r)
        self.decoder_up = prom.Gauge("characters_decoder_up", "1 while the channel to the decoder connects (READY), else 0 (checked every second)", registry=r)
        self.health_serving = prom.Gauge("characters_health_serving", "grpc.health.v1 status by service: 1 SERVING, 0 otherwise", ["service"], registry=r)
        self.rpc_errors = prom.Counter("characters_rpc_errors", "RPCs that ended with a status other than OK, by method and code", ["method", "code"], registry=r)
        self.rpc_pool_threads = prom.Gauge("characters_rpc_pool_threads", "Threads of an RPC pool", ["pool"], registry=r)
        self.rpc_pool_busy = prom.Gauge("characters_rpc_pool_busy", "Threads of an RPC pool running a handler", ["pool"], registry=r)
        self.rpc_pool_queued = prom.Gauge("characters_rpc_pool_queued", "RPCs waiting for a thread of their pool", ["pool"], registry=r)
        self.rpc_admitted = prom.Gauge("characters_rpc_admitted", "RPCs a service is running (admitted)", ["service"], registry=r)
        self.rpc_admission_limit = prom.Gauge("characters_rpc_admission_limit", "The most RPCs a service runs at once; more are refused RESOURCE_EXHAUSTED", ["service"], registry=r)
        self.compiled_programs = prom.Gauge("characters_compiled_programs", "XLA programs compiled in this process so far", registry=r)
        self.generator_programs = prom.Gauge("characters_generator_programs", "Compiled executables held by the generator", registry=r)
        self.live_device_bytes = prom.Gauge("characters_live_device_bytes", "Bytes of live device arrays (after the last session)", registry=r)
        self.device_memory = prom.Gauge("characters_device_memory_bytes", "Device memory of the generator (summed over its devices) and, as decoder_*, of its decoder process, from the allocators", ["kind"], registry=r)
        self.live_device_arrays = prom.Gauge("characters_live_device_arrays", "Number of live device arrays (after the last session)", registry=r)
        self.snapshots = prom.Counter("characters_snapshots", "Session snapshots committed to the store, by kind (PERIODIC, REQUESTED, MIGRATE)", ["kind"], registry=r)
        self.snapshot_failures = prom.Counter("characters_snapshot_failures", "Session snapshots that failed (decoder, host copy or store), by kind", ["kind"], registry=r)
        self.snapshot_bytes = prom.Counter("characters_snapshot_bytes", "Bytes of session snapshots written to the store", registry=r)
        self.snapshot_seconds = prom.Histogram("characters_snapshot_seconds", "From a step boundary to its snapshot committed (the decoder's state, the host copies, the write)", buckets=_FIRST_FRAME_BUCKETS, registry=r)
        self.snapshot_boundary_seconds = prom.Histogram("characters_snapshot_boundary_seconds", "What the step loop spends at a snapshot's boundary (the conversation's export, the state copy dispatched)", buckets=_STEP_BUCKETS, registry=r)
        self.snapshot_store_bytes = prom.Gauge("characters_snapshot_store_bytes", "Bytes in the snapshot store (after this worker's last write)", registry=r)
        self.migrations = prom.Counter("characters_migrations", "Sessions a drain moved off this worker (their MIGRATE snapshot handed to the client)", registry=r)
        self.resumes = prom.Counter("characters_resumes", "Sessions resumed on this worker from a snapshot: migration (nothing to regenerate) or recovery (steps regenerated)", ["kind"], registry=r)
        self.resume_seconds = prom.Histogram("characters_resume_seconds", "From a resume's start to its first new chunk handed to gRPC", buckets=_FIRST_FRAME_BUCKETS, registry=r)
        for s in STATES:
            self.sessions.labels(s).set(0)
        self._compiles = 0
        self._lock = threading.Lock()
        self._decoder_watch = None

    def count_compiles(self) -> None:
        """Counts this process's XLA backend compilations (jax.monitoring event)."""
        from jax import monitoring

        def listener(name, *_args, **_kw):
            if name == "/jax/core/compile/backend_compile_duration":
                with self._lock:
                    self._compiles += 1
                    self.compiled_programs.set(self._compiles)

        monitoring.register_event_duration_secs_listener(listener)

    def set_state(self, old: str | None, new: str, reason: str | None = None) -> None:
        """A session moved old -> new (old None: it was created); reason: its end reason
        when new is terminal."""
        with self._lock:
            self._running += (new == "RUNNING") - (old == "RUNNING")
            if new == "RUNNING":
                self.fps.set(0.0)
        if old:
            self.sessions.labels(old).dec()
        if new in ("COMPLETED", "FAILED", "CANCELLED"):
            self.sessions_ended.labels(new).inc()
            self.sessions_ended_by_reason.labels(reason or "END_REASON_UNSPECIFIED").inc()
        else:
            self.sessions.labels(new).inc()

    # -- hooks of the live session -----------------------------------------------------------
    def follow_conversation(self, conversation) -> None:
        """The live session's ConversationState (conversation.py), read for the queued speech."""
        with self._lock:
            self._conversation = conversation
            self._segment_starts.clear()

    def _queued_speech_seconds(self) -> float:
        conv = self._conversation
        if conv is None or conv.ended is not None:
            return 0.0
        return conv.speech.queued / conv.tl.sample_rate

    def speech_note(self, note, sample_rate: int) -> None:
        """A speech event of the live session (conversation.Note): a segment's SPEAKING_STOPPED
        adds the silence inserted between its first sample and where it stopped."""
        with self._lock:
            if note.kind == STARTED:
                self._segment_starts[note.segment] = note.position
                return
            start = self._segment_starts.pop(note.segment, None) if note.kind == STOPPED else None
        if start is not None and note.position - start > note.segment_samples:
            self.inserted_silence_seconds.inc((note.position - start - note.segment_samples) / sample_rate)

    def snapshot_committed(self, committed, store) -> None:
        """A snapshot is in the store (serving/snapshot.py's Committed; store: its
        SnapshotStore, whose size is read here)."""
        self.snapshots.labels(committed.kind).inc()
        self.snapshot_bytes.inc(committed.bytes)
        self.snapshot_seconds.observe(committed.snapshot_s)
        self.snapshot_store_bytes.set(store.usage())

    # -- the process -------------------------------------------------------------------------
    def decoder_started(self, restarts: int) -> None:
        """The supervisor started the decoder process (`restarts`: how many times before)."""
        if restarts:
            self.decoder_restarts.inc()

    def watch_decoder(self, channel: grpc.Channel, every_s: float = 1.0) -> None:
        """Follows whether the decoder's channel connects (characters_decoder_up), asking it
        to connect every `every_s` seconds on a thread of its own (an idle channel would not
        reconnect to a restarted decoder by itself)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                ready = grpc.channel_ready_future(channel)
                try:
                    ready.result(timeout=every_s)
                    self.decoder_up.set(1)
                    stop.wait(every_s)
                except grpc.FutureTimeoutError:
                    self.decoder_up.set(0)
                finally:
                    ready.cancel()

        thread = threading.Thread(target=run, name="decoder-watch", daemon=True)
        self._decoder_watch = (stop, thread, every_s)
        thread.start()

    def unwatch_decoder(self) -> None:
        """Stops following the decoder (before its channel is closed)."""
        if self._decoder_watch is not None:
            stop, thread, every_s = self._decoder_watch
            stop.set()
            thread.join(every_s + 1.0)
            self._decoder_watch = None

    def set_health(self, service: str, status: int) -> None:
        """A grpc.health.v1 status changed (HealthService's on_change)."""
        self.health_serving.labels(service).set(1 if status == _SERVING else 0)

    def watch_pool(self, pool) -> None:
        """An RpcPool (rpc_pool.py): its threads, busy threads and queued RPCs."""
        self.rpc_pool_threads.labels(pool.name).set(pool.threads)
        self.rpc_pool_busy.labels(pool.name).set_function(lambda: pool.busy)
        self.rpc_pool_queued.labels(pool.name).set_function(lambda: pool.queued)

    def watch_admission(self, admission) -> None:
        """An Admission counter (admission.py): RPCs admitted and its limit."""
        self.rpc_admission_limit.labels(admission.service).set(admission.limit)
        self.rpc_admitted.labels(admission.service).set_function(lambda: admission.admitted)

    def refresh_device_stats(self, generator: Generator | None = None) -> None:
        """Live device arrays and memory, and the generator's compiled programs. Host-side
        bookkeeping only (no device sync)."""
        import jax

        arrays = jax.live_arrays()
        self.live_device_arrays.set(len(arrays))
        self.live_device_bytes.set(sum(a.nbytes for a in arrays))
        if generator is not None:
            self.generator_programs.set(generator.compiled_programs())
        self.set_device_memory(device_memory())

    def set_device_memory(self, memory: dict) -> None:
        """memory: `device_memory()` of this process (or 'decoder_'-prefixed keys of the decoder's)."""
        for key, value in memory.items():
            self.device_memory.labels(key).set(value)

    def serve_http(self, port: int, host: str = "127.0.0.1", liveness=None):
        """Serves /metrics (and /healthz when given `liveness() -> (alive, message)`) on
        host:port; returns the MetricsHttpServer (`.port`: the bound port)."""
        from characters_jax.serving.metrics_http import MetricsHttpServer

        return MetricsHttpServer(self.registry, host, port, liveness)
