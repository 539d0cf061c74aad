"""A worker's gRPC server: CharacterService, grpc.health.v1 and reflection on one port.

Built around a `WorkerContext` by `build_worker` (composition.py), so the same wiring
serves the real generator (`serve`, server.py) and, in-process, a fake one (demo/fakes.py)
for tests and client development.
Message size limits follow the config (channel_options.py).

No number of streams can starve health or wedge the server:
  - each service runs on its own thread pool (rpc_pool.py): CharacterService on the
    server's, health (health.py: never sends under a lock, Watch holds no thread) and
    reflection on pools of their own;
  - CharacterService RPCs and reflection streams are admitted up to `RpcLimits`
    (admission.py); more are refused RESOURCE_EXHAUSTED at once;
  - a Converse stream's first request has a deadline, so does an idle reflection stream
    (request_reader.py): DEADLINE_EXCEEDED;
  - RPC errors are counted by method and code (rpc_metrics.py), pools and admission
    counters are gauges (metrics.py).

Besides host:port, the server listens on a Unix socket in a directory of its own that only
this user can enter (`probe_target`): what the liveness check (/healthz, liveness.py)
probes, in plaintext whatever TLS the port uses. Only a process of this user, which can
read the worker's key and token files anyway, reaches it; bearer tokens still apply.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import tempfile
from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.admission import Admission, RpcLimits, admitted
from characters_jax.serving.health import HEALTH_SERVICE, WorkerHealth
from characters_jax.serving.request_reader import RequestReader, with_idle_deadline
from characters_jax.serving.rpc_handlers import behavior_of, generated_handlers, register, with_behavior
from characters_jax.serving.rpc_metrics import RpcMetricsInterceptor
from characters_jax.serving.rpc_pool import RpcPool
from characters_jax.serving.session import SessionTable
from characters_jax.serving.warmup import WarmupReport
from characters_jax.serving.worker import CharacterServicer, WorkerContext, WorkerOptions
from characters_jax.wire.channel_options import worker_server_options

log = logging.getLogger("characters_jax.serving.worker_server")


STOP_SLACK_S = 3.0  # how long `stop` waits for the server beyond its grace


class WorkerServer:
    def __init__(self, ctx: WorkerContext, options: WorkerOptions, host: str = "127.0.0.1", port: int = 0, limits: RpcLimits | None = None,
                 credentials: grpc.ServerCredentials | None = None, interceptors: Sequence[grpc.ServerInterceptor] = (),
                 warmup: WarmupReport | None = None):
        """Binds host:port (0: any free port; `self.port` is the bound one, 0 if binding
        failed), with TLS when `credentials` are given; `interceptors` run on every RPC
        (after the one counting RPC errors). limits: concurrent RPCs and deadlines (default
        RpcLimits()). Serving starts with `start()`. An empty options.worker_id becomes
        "<host name>:<port>". warmup: what the warm-up measured (composition.py's
        build_worker warms up and builds the server)."""
        self.limits = limits or RpcLimits()
        self.warmup = warmup
        lim, m = self.limits, ctx.metrics
        self.pools = {"rpc": RpcPool("rpc", lim.max_character_rpcs + lim.spare_threads), "health": RpcPool("health", lim.health_threads),
                      "reflection": RpcPool("reflection", lim.max_reflection_streams + lim.spare_threads)}
        self.server = grpc.server(self.pools["rpc"], interceptors=(RpcMetricsInterceptor(m.rpc_errors), *interceptors),
                                  options=worker_server_options(ctx.config, options.image_limits.max_bytes, options.max_connection_age_s))
        address = f"{host}:{port}"
        self.port = self.server.add_secure_port(address, credentials) if credentials is not None else self.server.add_insecure_port(address)
        self.address = f"{host}:{self.port}"
        self._probe_dir = tempfile.TemporaryDirectory(prefix="characters-worker-")  # mode 0700
        self.probe_target = f"unix:{self._probe_dir.name}/health.sock"
        self.server.add_insecure_port(self.probe_target)
        self.ctx = ctx
        self.options = options if options.worker_id else dataclasses.replace(options, worker_id=f"{socket.gethostname()}:{self.port}")
        self.table = SessionTable(self._on_change)
        self.health = WorkerHealth(lambda: self.table.live is None, self.pools["health"], m.set_health)
        self.servicer = CharacterServicer(ctx, self.options, self.table, self.health)
        self.admissions = {"character": Admission("CharacterService RPCs", lim.max_character_rpcs, "RpcLimits.max_character_rpcs"),
                           "reflection": Admission("server reflection streams", lim.max_reflection_streams, "RpcLimits.max_reflection_streams")}
        self._add_services()
        for pool in self.pools.values():
            m.watch_pool(pool)
        for admission in self.admissions.values():
            m.watch_admission(admission)

    def _add_services(self) -> None:
        lim = self.limits
        service, handlers = generated_handlers(characters_pb2_grpc.add_CharacterServiceServicer_to_server, self.servicer)
        handlers["Converse"] = with_behavior(handlers["Converse"], lambda requests, context: self.servicer.Converse(
            RequestReader(requests, lim.first_request_timeout_s), context))
        register(self.server, service, {name: admitted(h, self.admissions["character"]) for name, h in handlers.items()})
        register(self.server, HEALTH_SERVICE, self.health.servicer.handlers())
        names = (service, HEALTH_SERVICE, reflection.SERVICE_NAME)
        service, handlers = generated_handlers(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.ReflectionServicer(names))
        info = behavior_of(handlers["ServerReflectionInfo"])
        idle_limited = with_behavior(handlers["ServerReflectionInfo"], lambda requests, context: info(
            with_idle_deadline(requests, context, lim.reflection_idle_timeout_s, "server reflection"), context), self.pools["reflection"])
        register(self.server, service, {"ServerReflectionInfo": admitted(idle_limited, self.admissions["reflection"])})

    def _on_change(self, rec, old, idle) -> None:
        self.ctx.metrics.set_state(old, rec.state, rec.end_reason)
        self.health.refresh()
        log.info("session state", extra={"fields": {"session_id": rec.session_id, "from": old, "to": rec.state, "code": rec.status_code.name,
                                                      "end_reason": rec.end_reason, "message": rec.status_message}})

    def start(self) -> None:
        """Serves, SERVING on both health names."""
        self.server.start()
        self.health.ready()

    def drain(self, timeout_s: float | None = None) -> str:
        """NOT_SERVING at once; the live session may go on up to `timeout_s` (default: the
        options' drain_timeout_s). Returns "idle", "finished" or "cancelled"."""
        return self.servicer.drain(self.options.drain_timeout_s if timeout_s is None else timeout_s)

    def stop(self, grace: float = 3.0) -> bool:
        """Stops serving: RPCs still running after `grace` seconds are cancelled. Returns
        within grace + STOP_SLACK_S seconds whatever a stream does; returns whether the
        server finished stopping by then."""
        stopped = self.server.stop(grace=grace).wait(grace + STOP_SLACK_S)
        if not stopped:
            log.warning("the gRPC server did not finish stopping", extra={"fields": {"grace_s": grace, "waited_s": grace + STOP_SLACK_S}})
        self.health.servicer.close()
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._probe_dir.cleanup()
        return stopped
