"""The files both ends read for TLS and bearer tokens: PEM certificates and keys (checked
before gRPC sees them, with the certificate's validity period), and token files.

A token file holds tokens one a line; blank lines and everything from a '#' to the end of
its line are ignored; a token is at least 16 characters, with no spaces. The worker accepts
the tokens of its file (the worker's [serve] auth_tokens); a client sends the one token of its
credentials' token_file.
"""

from __future__ import annotations

import datetime
import pathlib
import re
import ssl

MIN_TOKEN_CHARS = 16
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


def read_file(path: str | pathlib.Path, what: str) -> bytes:
    """The bytes of `path`. Raises ValueError naming `what` and the path."""
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror})") from None


def check_key_pair(cert_path, key_path, what: str) -> None:
    """Raises ValueError unless the files are a PEM certificate (chain) and its private key."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert_path), str(key_path))
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"{what} {cert_path} with key {key_path}: not a PEM certificate and its private key ({err})") from None


def check_ca(ca_path, what: str) -> None:
    """Raises ValueError unless the file holds PEM certificates."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(ca_path))
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"{what} {ca_path}: not PEM certificates ({err})") from None


def parse_tokens(text: str, source: str) -> list[str]:
    """The tokens of a token file's text. Raises ValueError naming the line of a bad one
    (never its content)."""
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        token = line.split("#", 1)[0].strip()
        if not token:
            continue
        if len(token.split()) != 1 or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{source}, line {n}: a token is one word of at least {MIN_TOKEN_CHARS} characters")
        tokens.append(token)
    return tokens


def read_tokens(path: str) -> list[str]:
    """The tokens of the file at `path` (at least one). Raises ValueError."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"token file {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    tokens = parse_tokens(text, f"token file {path}")
    if not tokens:
        raise ValueError(f"token file {path}: holds no token")
    return tokens
