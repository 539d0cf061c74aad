"""What a client presents to the workers: TLS trust roots, a client certificate, a bearer token.

A client (`talk` / `view --credentials FILE`, or `CharacterClient(credentials=...)`): a
small TOML file, paths relative to it, every key optional:

    ca = "ca.pem"                     # the CA of the workers' certificates (default: the system's roots)
    cert = "client.pem"               # a client certificate and its key, for workers that require one
    key = "client.key"
    token_file = "token"              # a bearer token (one line, '#' comments), for workers run with serve.auth_tokens
    server_name = "workers.example"   # the name to verify in the workers' certificates, if not the target's

A credentials file means TLS. `ClientCredentials` is what the library takes; a client
certificate outside its validity period is refused before any connection
(`certificate_problem`), since the worker can only drop the handshake.
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import tomllib

import grpc

from characters_jax.wire.credential_files import check_ca, check_key_pair, read_file, read_tokens, validity_problem


@dataclasses.dataclass(frozen=True)
class ClientCredentials:
    """What a client presents: TLS trust roots, an optional client certificate, an optional
    bearer token, and an optional name to verify in the workers' certificates."""

    root_certificates: bytes | None = None  # PEM; None: the system's roots
    certificate_chain: bytes | None = None  # PEM, with private_key (mutual TLS)
    private_key: bytes | None = dataclasses.field(default=None, repr=False)
    token: str | None = dataclasses.field(default=None, repr=False)
    server_name: str = ""  # overrides the name verified (default: the target's host)

    def __post_init__(self):
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and a key its certificate")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: TLS, and the token on every call when there is one."""
        tls = grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)
        if not self.token:
            return tls
        return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(self.token))

    def certificate_problem(self, now: datetime.datetime | None = None) -> str | None:
        """Why the client certificate cannot be used now (expired, not yet valid), or None."""
        if self.certificate_chain is None:
            return None
        return validity_problem(self.certificate_chain, "the client certificate", now)


_CLIENT_KEYS = ("ca", "cert", "key", "token_file", "server_name")


def load_client_credentials(path: str | pathlib.Path) -> ClientCredentials:
    """A client credentials TOML file (see the module docstring). Raises ValueError."""
    path = pathlib.Path(path)
    try:
        doc = tomllib.loads(read_file(path, "credentials file").decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"credentials file {path}: not TOML ({err})") from None
    unknown = sorted(set(doc) - set(_CLIENT_KEYS))
    if unknown:
        raise ValueError(f"credentials file {path}: unknown keys {unknown}; known: {list(_CLIENT_KEYS)}")
    bad = [k for k, v in doc.items() if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"credentials file {path}: {bad} must be non-empty strings")
    where = {k: path.parent / doc[k] for k in ("ca", "cert", "key", "token_file") if k in doc}
    if ("cert" in where) != ("key" in where):
        raise ValueError(f"credentials file {path}: 'cert' and 'key' go together")
    if "ca" in where:
        check_ca(where["ca"], "ca")
    if "cert" in where:
        check_key_pair(where["cert"], where["key"], "cert")
    token = None
    if "token_file" in where:
        tokens = read_tokens(str(where["token_file"]))
        if len(tokens) != 1:
            raise ValueError(f"credentials file {path}: token_file {where['token_file']} must hold one token, it holds {len(tokens)}")
        token = tokens[0]
    return ClientCredentials(root_certificates=read_file(where["ca"], "ca") if "ca" in where else None,
                             certificate_chain=read_file(where["cert"], "cert") if "cert" in where else None,
                             private_key=read_file(where["key"], "key") if "key" in where else None,
                             token=token, server_name=doc.get("server_name", ""))
