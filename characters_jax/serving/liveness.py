"""The worker's liveness check (served as /healthz on the metrics port): a grpc.health.v1
Check of "" over a channel to the worker's own gRPC server (its private Unix socket,
worker_server.py), with a short deadline.

Any answer is alive, NOT_SERVING included (a draining worker turns NOT_SERVING on purpose
and must not be restarted for it); no answer within the deadline (a wedged or stopped
server) is not. The channel is kept between checks.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class GrpcLiveness:
    def __init__(self, target: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None, options=()):
        """target: the worker's gRPC server as seen from here (WorkerServer.probe_target);
        credentials: the channel's, for a target that uses TLS."""
        self.target, self.timeout_s = target, timeout_s
        self._channel = grpc.secure_channel(target, credentials, options) if credentials is not None else grpc.insecure_channel(target, options)
        self._check = health_pb2_grpc.HealthStub(self._channel).Check

    def __call__(self) -> tuple[bool, str]:
        """(alive, what was seen)."""
        try:
            reply = self._check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
        except grpc.RpcError as err:
            return False, f"the worker's gRPC server gave no health answer within {self.timeout_s:g} s ({err.code().name})"
        return True, f"the worker's gRPC server answers (health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)})"

    def close(self) -> None:
        self._channel.close()
