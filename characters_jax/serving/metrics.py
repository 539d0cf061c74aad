"""Prometheus metrics of a worker, in their own registry (served on --metrics-port).

step time histogram (diffusion per step), step period and decode histograms, fps of the
live session, playout underruns (reported by clients), interrupts, refused sessions, sessions by state (live gauge and
terminal counter), and the bounded-resources gauges: compiled programs and live device
memory, refreshed after every session.
"""

from __future__ import annotations

import threading

import prometheus_client as prom

_STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.1667, 0.2, 0.3, 0.5, 1.0, 2.0)
STATES = ("NOT_READY", "READY", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")


class WorkerMetrics:
    def __init__(self):
        r = self.registry = prom.CollectorRegistry()
        self.step_seconds = prom.Histogram("characters_step_seconds", "Diffusion compute time per generator step", buckets=_STEP_BUCKETS, registry=r)
        self.step_period_seconds = prom.Histogram("characters_step_period_seconds", "Interval between consecutive video chunks leaving the worker", buckets=_STEP_BUCKETS, registry=r)
        self.decode_seconds = prom.Histogram("characters_decode_seconds", "Decoder compute time per chunk (decoder process)", buckets=_STEP_BUCKETS, registry=r)
        self.fps = prom.Gauge("characters_fps", "Sustained frames per second of the live (or last) session", registry=r)
        self.underruns = prom.Counter("characters_playout_underruns", "Playout underruns reported by clients", registry=r)
        self.interrupts = prom.Counter("characters_interrupts", "Interrupts acknowledged", registry=r)
        self.refused = prom.Counter("characters_sessions_refused", "New sessions refused (RESOURCE_EXHAUSTED: busy; UNAVAILABLE: draining)", ["code"], registry=r)
        self.frames = prom.Counter("characters_frames", "Frames sent to clients", registry=r)
        self.sessions = prom.Gauge("characters_sessions", "Sessions on this worker by state (live ones)", ["state"], registry=r)
        self.sessions_ended = prom.Counter("characters_sessions_ended", "Sessions that ended, by final state", ["state"], registry=r)
        self.compiled_programs = prom.Gauge("characters_compiled_programs", "XLA programs compiled in this process so far", registry=r)
        self.generator_programs = prom.Gauge("characters_generator_programs", "Compiled executables held by the generator", registry=r)
        self.live_device_bytes = prom.Gauge("characters_live_device_bytes", "Bytes of live device arrays (after the last session)", registry=r)
        self.device_memory = prom.Gauge("characters_device_memory_bytes", "Device memory of the generator (summed over its devices) and, as decoder_*, of its decoder process, from the allocators", ["kind"], registry=r)
        self.live_device_arrays = prom.Gauge("characters_live_device_arrays", "Number of live device arrays (after the last session)", registry=r)
        for s in STATES:
            self.sessions.labels(s).set(0)
        self._compiles = 0
        self._lock = threading.Lock()

    def count_compiles(self) -> None:
        """Counts this process's XLA backend compilations (jax.monitoring event)."""
        from jax import monitoring

        def listener(name, *_args, **_kw):
            if name == "/jax/core/compile/backend_compile_duration":
                with self._lock:
                    self._compiles += 1
                    self.compiled_programs.set(self._compiles)

        monitoring.register_event_duration_secs_listener(listener)

    def set_state(self, old: str | None, new: str) -> None:
        if old:
            self.sessions.labels(old).dec()
        if new in ("COMPLETED", "FAILED", "CANCELLED"):
            self.sessions_ended.labels(new).inc()
        else:
            self.sessions.labels(new).inc()

    def refresh_device_stats(self, generator=None) -> None:
        """Host-side bookkeeping only (no device sync)."""
        import jax

        arrays = jax.live_arrays()
        self.live_device_arrays.set(len(arrays))
        self.live_device_bytes.set(sum(a.nbytes for a in arrays))
        if generator is not None and hasattr(generator, "compiled_programs"):
            self.generator_programs.set(generator.compiled_programs())
        self.set_device_memory(device_memory())

    def set_device_memory(self, memory: dict) -> None:
        """memory: `device_memory()` of this process (or 'decoder_'-prefixed keys of the decoder's)."""
        for key, value in memory.items():
            self.device_memory.labels(key).set(value)

    def serve_http(self, port: int) -> int:
        """Serves /metrics on 127.0.0.1-and-all interfaces; returns the bound port."""
        server, _ = prom.start_http_server(port, registry=self.registry)
        return server.server_port


def device_memory() -> dict:
    """This process's device memory from the allocator, summed over its local devices:
    bytes_in_use, peak_bytes_in_use, bytes_limit (absent on backends that do not report
    them, such as the CPU). Host-side only: no device sync."""
    import jax

    out: dict = {}
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if key in stats:
                out[key] = out.get(key, 0) + int(stats[key])
    return out
