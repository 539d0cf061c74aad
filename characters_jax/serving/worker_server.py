"""A worker's gRPC server: CharacterService, grpc.health.v1 and reflection on one port.

Built around a `WorkerContext`, so the same wiring serves the real generator (`serve`,
server.py) and, in-process, a fake one (fakes.py) for tests and client development.
Message size limits follow the config (channel_options.py).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from characters_jax.protos_gen import characters_pb2, characters_pb2_grpc
from characters_jax.serving.channel_options import worker_server_options
from characters_jax.serving.health import WorkerHealth
from characters_jax.serving.session import SessionTable
from characters_jax.serving.worker import CharacterServicer, WorkerContext, WorkerOptions

log = logging.getLogger("characters_jax.serving.worker_server")


class WorkerServer:
    def __init__(self, ctx: WorkerContext, options: WorkerOptions, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
                 credentials: grpc.ServerCredentials | None = None, interceptors: Sequence[grpc.ServerInterceptor] = ()):
        """Binds host:port (0: any free port; `self.port` is the bound one, 0 if binding
        failed), with TLS when `credentials` are given; `interceptors` run on every RPC.
        Serving starts with `start()`. An empty options.worker_id becomes
        "<host name>:<port>"."""
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"), interceptors=tuple(interceptors),
                                  options=worker_server_options(ctx.config, options.image_limits.max_bytes, options.max_connection_age_s))
        address = f"{host}:{port}"
        self.port = self.server.add_secure_port(address, credentials) if credentials is not None else self.server.add_insecure_port(address)
        self.address = f"{host}:{self.port}"
        self.ctx = ctx
        self.options = options if options.worker_id else dataclasses.replace(options, worker_id=f"{socket.gethostname()}:{self.port}")
        self.table = SessionTable(self._on_change)
        self.health = WorkerHealth(lambda: self.table.live is None)
        self.servicer = CharacterServicer(ctx, self.options, self.table, self.health)
        characters_pb2_grpc.add_CharacterServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        names = (characters_pb2.DESCRIPTOR.services_by_name["CharacterService"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)

    def _on_change(self, rec, old, idle) -> None:
        self.ctx.metrics.set_state(old, rec.state)
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

    def stop(self, grace: float = 3.0) -> None:
        self.server.stop(grace=grace).wait()
