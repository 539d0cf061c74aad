"""The worker's TLS and bearer-token transport (the [serve] table's tls_cert, tls_key,
tls_client_ca and auth_tokens: `serve --set serve.tls_cert=PEM --set serve.tls_key=PEM`).

`server_credentials` checks the files (PEM, the key matches the certificate, the certificate
is within its validity period) and builds gRPC's TLS credentials; with a client CA, clients
must present a certificate it signed (mutual TLS): a connection without one, or with an
expired or foreign one, is refused in the handshake.
"""

from __future__ import annotations

import grpc

from characters_jax.serving.auth import BearerTokenInterceptor, TokenFile
from characters_jax.wire.credential_files import check_ca, check_key_pair, read_file, validity_problem


def server_credentials(cert_path: str, key_path: str, client_ca_path: str | None = None) -> grpc.ServerCredentials:
    """A worker's TLS credentials; with `client_ca_path`, client certificates signed by that
    CA are required. Raises ValueError (unreadable, not PEM, key and certificate apart, the
    certificate expired or not yet valid)."""
    cert, key = read_file(cert_path, "certificate"), read_file(key_path, "key")
    check_key_pair(cert_path, key_path, "certificate")
    problem = validity_problem(cert, f"certificate {cert_path}")
    if problem:
        raise ValueError(problem)
    ca = None
    if client_ca_path:
        ca = read_file(client_ca_path, "client CA")
        check_ca(client_ca_path, "client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def worker_transport(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None = None,
                     auth_tokens: str | None = None) -> tuple[grpc.ServerCredentials | None, tuple[grpc.ServerInterceptor, ...]]:
    """The worker's server credentials (None: plaintext) and interceptors, from the [serve]
    table's tls_cert, tls_key, tls_client_ca and auth_tokens. Raises ValueError naming the
    key: a certificate without its key, a client CA or tokens without TLS (a bearer token
    must not travel in clear), a file that cannot be used."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("serve.tls_cert and serve.tls_key: give both (the certificate and its private key)")
    for key, value in (("serve.tls_client_ca", tls_client_ca), ("serve.auth_tokens", auth_tokens)):
        if value and not tls_cert:
            raise ValueError(f"{key}: needs TLS (serve.tls_cert and serve.tls_key)")
    try:
        credentials = server_credentials(tls_cert, tls_key, tls_client_ca) if tls_cert else None
    except ValueError as err:
        raise ValueError(f"serve.tls_cert/tls_key/tls_client_ca: {err}") from None
    try:
        interceptors = (BearerTokenInterceptor(TokenFile(auth_tokens)),) if auth_tokens else ()
    except ValueError as err:
        raise ValueError(f"serve.auth_tokens: {err}") from None
    return credentials, interceptors
