"""The worker's composition root: a WorkerServer over any `Generator` (engine/interface.py)
and a decoder client, warmed up before it binds.

`serve` (server.py) builds it over DiTGenerator and its decoder process; the fakes
(demo/fakes.py) over FakeGenerator and an in-process decoder. Both get the same wiring:
the audio front end, the timeline, the generator's lock, the metrics, the RPC limits.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.audio.timeline import Timeline
from characters_jax.engine.interface import Generator
from characters_jax.serving.admission import RpcLimits
from characters_jax.serving.decoder_link import DecoderClient
from characters_jax.serving.metrics import WorkerMetrics
from characters_jax.serving.snapshot_store import SnapshotStore
from characters_jax.serving.warmup import warm_up
from characters_jax.serving.worker import WorkerContext, WorkerOptions
from characters_jax.serving.worker_server import WorkerServer


def build_worker(generator: Generator, decoder: DecoderClient, options: WorkerOptions | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, limits: RpcLimits | None = None, credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = (), metrics: WorkerMetrics | None = None,
                 timed_steps: int = 0) -> WorkerServer:
    """A worker serving `generator` (its config is the worker's) with `decoder`: warmed up
    (`timed_steps` steps timed), then bound to host:port (0: any free port), with TLS when
    `credentials` are given and `interceptors` on every RPC. Not serving until `start()`;
    `port` is 0 if binding failed; `warmup` holds the WarmupReport. options: the session
    options (default WorkerOptions()); with options.snapshot_dir the worker opens that
    snapshot store (sessions migrate and resume) and compiles the state's copy at warm-up;
    limits: concurrent RPCs and deadlines (default RpcLimits()); metrics: the worker's
    (default: new ones)."""
    config = generator.config
    options = options or WorkerOptions()
    frontend = AudioFrontEnd(config)
    metrics = metrics or WorkerMetrics()
    warmup = warm_up(generator, frontend, timed_steps)
    store = None
    if options.snapshot_dir:  # sessions migrate and resume: the state's copy compiles now, not in a session
        store = SnapshotStore(options.snapshot_dir, max_bytes=int(options.snapshot_max_gib * (1 << 30)), keep_s=options.snapshot_keep_s)
        generator.capture_state().arrays()
        store.prune()
    metrics.refresh_device_stats(generator)
    ctx = WorkerContext(config, generator, threading.Lock(), frontend, Timeline.from_config(config), decoder, metrics, store)
    return WorkerServer(ctx, options, host, port, limits, credentials=credentials, interceptors=interceptors, warmup=warmup)
