"""TLS material of the service: the worker's server credentials and what a client presents.

The worker (`serve --tls-cert PEM --tls-key PEM [--tls-client-ca PEM]`): `server_credentials`
checks the files (PEM, the key matches the certificate, the certificate is within its
validity period) and builds gRPC's TLS credentials; with a client CA, clients must present
a certificate it signed (mutual TLS): a connection without one, or with an expired or
foreign one, is refused in the handshake.

A client (`talk` / `view --credentials FILE`, or `CharacterClient(credentials=...)`): a
small TOML file, paths relative to it, every key optional:

    ca = "ca.pem"                     # the CA of the workers' certificates (default: the system's roots)
    cert = "client.pem"               # a client certificate and its key, for workers that require one
    key = "client.key"
    token_file = "token"              # a bearer token (one line, '#' comments), for workers run with --auth-tokens
    server_name = "workers.example"   # the name to verify in the workers' certificates, if not the target's

A credentials file means TLS. `ClientCredentials` is what the library takes; a client
certificate outside its validity period is refused before any connection
(`certificate_problem`), since the worker can only drop the handshake.
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import re
import ssl
import tomllib

import grpc

from characters_jax.serving.auth import read_tokens

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def _der_item(der: bytes, i: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of contents) of the DER item at offset i."""
    tag, n = der[i], der[i + 1]
    i += 2
    if n & 0x80:
        k = n & 0x7F
        n = int.from_bytes(der[i : i + k], "big")
        i += k
    return tag, i, i + n


def certificate_validity(pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    """(not before, not after), UTC, of the first certificate of a PEM chain. Raises
    ValueError if there is none."""
    m = _PEM_CERT.search(pem)
    if m is None:
        raise ValueError("no PEM certificate")
    der = ssl.PEM_cert_to_DER_cert(m.group(0).decode("ascii"))
    _, cert, _ = _der_item(der, 0)
    _, i, _ = _der_item(der, cert)  # tbsCertificate's fields
    tag, _, end = _der_item(der, i)
    if tag == 0xA0:  # [0] version
        tag, _, end = _der_item(der, end)
    for _ in range(2):  # past serialNumber: signature, issuer
        _, _, end = _der_item(der, end)
    _, i, _ = _der_item(der, end)  # validity
    times = []
    for _ in range(2):
        tag, start, i = _der_item(der, i)
        text = der[start:i].decode("ascii")
        fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"  # UTCTime, GeneralizedTime
        times.append(datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.timezone.utc))
    return times[0], times[1]


def validity_problem(pem: bytes, what: str, now: datetime.datetime | None = None) -> str | None:
    """Why the first certificate of `pem` is not valid now (expired, not yet valid), or None."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = certificate_validity(pem)
    if now > not_after:
        return f"{what} expired at {not_after:%Y-%m-%d %H:%M:%S} UTC; renew it"
    if now < not_before:
        return f"{what} is not valid before {not_before:%Y-%m-%d %H:%M:%S} UTC"
    return None


def _read(path: str | pathlib.Path, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror})") from None


def _check_pair(cert_path, key_path, what: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert_path), str(key_path))
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"{what} {cert_path} with key {key_path}: not a PEM certificate and its private key ({err})") from None


def _check_ca(ca_path, what: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(ca_path))
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"{what} {ca_path}: not PEM certificates ({err})") from None


def server_credentials(cert_path: str, key_path: str, client_ca_path: str | None = None) -> grpc.ServerCredentials:
    """A worker's TLS credentials; with `client_ca_path`, client certificates signed by that
    CA are required. Raises ValueError (unreadable, not PEM, key and certificate apart, the
    certificate expired or not yet valid)."""
    cert, key = _read(cert_path, "certificate"), _read(key_path, "key")
    _check_pair(cert_path, key_path, "certificate")
    problem = validity_problem(cert, f"certificate {cert_path}")
    if problem:
        raise ValueError(problem)
    ca = None
    if client_ca_path:
        ca = _read(client_ca_path, "client CA")
        _check_ca(client_ca_path, "client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


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
        doc = tomllib.loads(_read(path, "credentials file").decode("utf-8"))
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
        _check_ca(where["ca"], "ca")
    if "cert" in where:
        _check_pair(where["cert"], where["key"], "cert")
    token = None
    if "token_file" in where:
        tokens = read_tokens(str(where["token_file"]))
        if len(tokens) != 1:
            raise ValueError(f"credentials file {path}: token_file {where['token_file']} must hold one token, it holds {len(tokens)}")
        token = tokens[0]
    return ClientCredentials(root_certificates=_read(where["ca"], "ca") if "ca" in where else None,
                             certificate_chain=_read(where["cert"], "cert") if "cert" in where else None,
                             private_key=_read(where["key"], "key") if "key" in where else None,
                             token=token, server_name=doc.get("server_name", ""))


def worker_transport(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None = None,
                     auth_tokens: str | None = None) -> tuple[grpc.ServerCredentials | None, tuple[grpc.ServerInterceptor, ...]]:
    """The worker's server credentials (None: plaintext) and interceptors, from `serve`'s
    --tls-cert, --tls-key, --tls-client-ca and --auth-tokens. Raises ValueError naming the
    flag: a certificate without its key, a client CA or tokens without TLS (a bearer token
    must not travel in clear), a file that cannot be used."""
    from characters_jax.serving.auth import BearerTokenInterceptor, TokenFile

    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key: give both (the certificate and its private key)")
    for flag, value in (("--tls-client-ca", tls_client_ca), ("--auth-tokens", auth_tokens)):
        if value and not tls_cert:
            raise ValueError(f"{flag}: needs TLS (--tls-cert and --tls-key)")
    try:
        credentials = server_credentials(tls_cert, tls_key, tls_client_ca) if tls_cert else None
    except ValueError as err:
        raise ValueError(f"--tls-cert/--tls-key/--tls-client-ca: {err}") from None
    try:
        interceptors = (BearerTokenInterceptor(TokenFile(auth_tokens)),) if auth_tokens else ()
    except ValueError as err:
        raise ValueError(f"--auth-tokens: {err}") from None
    return credentials, interceptors
