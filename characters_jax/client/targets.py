"""Targets of the client library: one worker ("host:port", a direct connection), a comma
list of workers ("h1:p1,h2:p2,..."), or a DNS name ("dns:///workers.example:50051",
re-resolved by gRPC).

A list or a DNS name is balanced by gRPC itself: round_robin over the workers with
client-side health checks on "characters.v1.CharacterService" (an idle worker is SERVING,
a busy or draining one NOT_SERVING), waitForReady (a new session waits until some worker is
idle), and retries of RESOURCE_EXHAUSTED / UNAVAILABLE before the session opens (gRPC's: at
most 5 attempts, backoff 0.25 s doubling to 2 s).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket

import grpc

from characters_jax.client.credentials import ClientCredentials
from characters_jax.client.errors import ConversationError
from characters_jax.wire.channel_options import client_channel_options
from characters_jax.wire.service import SERVICE_NAME

RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.25s", "maxBackoff": "2s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}
BALANCED_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": SERVICE_NAME},
    "methodConfig": [{"name": [{"service": SERVICE_NAME, "method": "Converse"}], "waitForReady": True, "retryPolicy": RETRY_POLICY}],
}
RETRY_BUFFER_BYTES = 16 << 20  # a start with a reference image must fit for it to be retried


@dataclasses.dataclass(frozen=True)
class ChannelTarget:
    """A gRPC target and whether it is balanced over several workers."""

    uri: str
    balanced: bool
    tls_name: str = ""  # a comma list: its first host as written, the name TLS verifies by default

    @property
    def options(self) -> list[tuple[str, object]]:
        opts = client_channel_options()
        if self.balanced:
            opts += [("grpc.service_config", json.dumps(BALANCED_SERVICE_CONFIG)),
                     ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES), ("grpc.retry_buffer_size", 4 * RETRY_BUFFER_BYTES)]
        return opts

    def tls_options(self, credentials: ClientCredentials) -> list[tuple[str, object]]:
        """The name to verify in the workers' certificates, where the target does not give it."""
        name = credentials.server_name or self.tls_name
        return [("grpc.ssl_target_name_override", name)] if name else []


def _host_port(entry: str) -> tuple[str, int]:
    if entry.startswith("["):
        host, _, port = entry[1:].partition("]:")
    else:
        host, _, port = entry.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target {entry!r}: expected host:port")
    return host, int(port)


def parse_target(target: str, balanced: bool | None = None) -> ChannelTarget:
    """'host:port' -> direct; 'h1:p1,h2:p2' -> balanced over those (names resolved now);
    'dns:///name:port' (or any URI with a scheme) -> balanced, resolved by gRPC.
    `balanced` overrides the choice."""
    t = target.strip()
    if not t:
        raise ValueError("target: empty; give host:port, a comma list of them, or dns:///name:port")
    if "," in t:
        addrs = []
        for entry in (e.strip() for e in t.split(",")):
            if not entry:
                continue
            host, port = _host_port(entry)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                try:
                    ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
                except socket.gaierror as err:
                    raise ValueError(f"target {entry!r}: cannot resolve {host!r} ({err.strerror})") from None
            addrs.append((ip.version, f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"))
        families = {v for v, _ in addrs}
        if len(families) != 1:
            raise ValueError(f"target {target!r}: mixes IPv4 and IPv6 workers; use one family or a DNS name")
        scheme = "ipv4" if families == {4} else "ipv6"
        first_host = _host_port(next(e.strip() for e in t.split(",") if e.strip()))[0]
        return ChannelTarget(f"{scheme}:" + ",".join(a for _, a in addrs), True if balanced is None else balanced, first_host)
    if "://" in t or t.startswith(("dns:", "ipv4:", "ipv6:")):
        return ChannelTarget(t, True if balanced is None else balanced)
    _host_port(t)
    return ChannelTarget(t, bool(balanced))


def open_channel(target: ChannelTarget, credentials: ClientCredentials | None = None, *, aio: bool = False):
    """A channel (grpc, or grpc.aio) to `target`: plaintext without credentials, else TLS
    with the credentials' certificate and token. A client certificate outside its validity
    period raises ConversationError (UNAUTHENTICATED) before any connection."""
    g = grpc.aio if aio else grpc
    if credentials is None:
        return g.insecure_channel(target.uri, options=target.options)
    problem = credentials.certificate_problem()
    if problem:
        raise ConversationError(grpc.StatusCode.UNAUTHENTICATED, problem)
    return g.secure_channel(target.uri, credentials.channel_credentials(), options=target.options + target.tls_options(credentials))


def aio_channel(target: str, balanced: bool | None = None, credentials: ClientCredentials | None = None) -> tuple[grpc.aio.Channel, ChannelTarget]:
    """A grpc.aio channel to `target` with the same balancing, limits and credentials as
    CharacterClient."""
    t = parse_target(target, balanced)
    return open_channel(t, credentials, aio=True), t
