"""The `[serve]` table: what a worker (`characters-jax serve`) is told besides its config,
tp, weights and address. Its defaults live here only: `serve` reads them from the table,
and `WorkerOptions()` / `RpcLimits()` are the table's defaults.

In the table, the keys of `WorkerOptions` and `RpcLimits` sit beside the process's own, and
the image limits' as `image_max_bytes`, `image_max_pixels`:
`characters-jax serve --set serve.drain_timeout_s=30 --set serve.max_character_rpcs=32`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """A reference image's size in bytes (checked before parsing) and in pixels (from its
    header, before its pixels are decoded)."""

    max_bytes: int = 4 << 20  # 4 MiB
    max_pixels: int = 4096 * 4096

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"image_{name}: must be >= 1, got {getattr(self, name)}")


MAX_JITTER_BUFFER_S = 2.0  # the largest input jitter buffer a worker or a session may set


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """A worker's sessions: how they open, pace, end and drain."""

    lead_chunks: int = 3  # bound on how far the step loop runs ahead of the client's playout clock
    ready_timeout_s: float = 60.0  # a READY session with no Converse is cancelled after this
    encode_timeout_s: float = 120.0  # waiting for a (re)starting decoder to encode the image
    max_duration_s: float = 3600.0  # a session's longest run (a client may ask for less)
    idle_timeout_s: float = 120.0  # a session with no speech this long ends (a client may ask for less)
    max_queued_audio_s: float = 60.0  # speech received ahead of its step, at most
    jitter_buffer_s: float = -1.0  # a speech segment starts once this much of it has arrived or its end is marked (-1: adaptive)
    drain_timeout_s: float = 300.0  # how long a draining worker lets its live session go on
    worker_id: str = ""  # reported in Session.worker_id ("": host name:port)
    max_connection_age_s: float = 0.0  # close client connections gracefully after this (0: never), so DNS clients re-resolve
    image_limits: ImageLimits = dataclasses.field(default=ImageLimits(), metadata={"prefix": "image_"})
    snapshot_dir: str = ""  # the snapshot store every worker mounts ("": none: sessions neither migrate nor resume here)
    snapshot_interval_s: float = 0.0  # periodic snapshots of resumable sessions (0: none; a drain still migrates them)
    snapshot_max_gib: float = 0.0  # the store's size limit; unclaimed sessions are removed oldest first (0: none)
    snapshot_keep_s: float = 3600.0  # remove a session's snapshots once its newest is this old and no worker runs it (0: never)

    def __post_init__(self):
        for name in ("max_duration_s", "idle_timeout_s", "max_queued_audio_s", "ready_timeout_s", "encode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.lead_chunks < 1:
            raise ValueError(f"lead_chunks: must be >= 1, got {self.lead_chunks}")
        if not (self.jitter_buffer_s == -1 or 0 <= self.jitter_buffer_s <= MAX_JITTER_BUFFER_S):
            raise ValueError(f"jitter_buffer_s: must be -1 (adaptive) or within [0, {MAX_JITTER_BUFFER_S:g}] seconds, got {self.jitter_buffer_s}")
        for name in ("drain_timeout_s", "max_connection_age_s", "snapshot_interval_s", "snapshot_max_gib", "snapshot_keep_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class RpcLimits:
    """Bounds on a worker's concurrent RPCs and their deadlines (serving/admission.py)."""

    max_character_rpcs: int = 16  # concurrent CharacterService RPCs (Converse streams included)
    max_reflection_streams: int = 4  # concurrent server-reflection streams
    first_request_timeout_s: float = 10.0  # a Converse stream's first request (`start`) must come within this
    reflection_idle_timeout_s: float = 30.0  # a reflection stream with no request this long is ended
    spare_threads: int = 4  # threads of a limited pool beyond its limit (refusals run there)
    health_threads: int = 4  # the health service's own pool
    liveness_timeout_s: float = 1.0  # deadline of /healthz's health Check over loopback

    def __post_init__(self):
        for name in ("max_character_rpcs", "max_reflection_streams", "spare_threads", "health_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("first_request_timeout_s", "reflection_idle_timeout_s", "liveness_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The [serve] table: the sessions' options, the RPC limits, and the process's own
    settings (an empty string or 0 means "not given": the behaviour each comment names)."""

    session: WorkerOptions = WorkerOptions()
    rpc: RpcLimits = RpcLimits()
    metrics_port: int = 9464  # Prometheus /metrics and liveness /healthz (0: any free port, -1: off)
    metrics_host: str = ""  # the address the metrics port binds ("": serve's --host)
    compile_cache: str = "auto"  # XLA's persistent compilation cache: a directory, "off", or "auto"
    decoder: str = ""  # a running decoder (host:port or unix:PATH, loopback only; "": start and supervise one)
    decoder_device: str = ""  # the started decoder's GPU: an index, a UUID or "cpu" ("": placed by the plan)
    decoder_memory_gib: float = 0.0  # the decoder's device memory budget (0: estimated from the config)
    memory_fraction: float = 0.0  # of each generator GPU's memory (0: what the decoder and reserves leave)
    tls_cert: str = ""  # serve over TLS with this certificate chain (PEM); needs tls_key
    tls_key: str = ""  # the private key of tls_cert (PEM)
    tls_client_ca: str = ""  # mutual TLS: clients must present a certificate signed by this CA (PEM)
    auth_tokens: str = ""  # bearer tokens, one a line; every RPC but health needs one (needs TLS)
    startup_timeout_s: float = 600.0  # how long demo and view wait for the worker they start

    def __post_init__(self):
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ValueError(f"metrics_port: must be a port, 0 (any) or -1 (off), got {self.metrics_port}")
        if self.decoder_memory_gib < 0:
            raise ValueError(f"decoder_memory_gib: must be >= 0 (0: estimated), got {self.decoder_memory_gib}")
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction: must be within [0, 1] (0: what is left), got {self.memory_fraction}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s: must be > 0, got {self.startup_timeout_s}")
