"""Bearer-token authentication of a worker's RPCs (the [serve] table's auth_tokens FILE).

The token file holds the accepted tokens, one a line; blank lines and everything from a
'#' to the end of its line are ignored; a token is at least 16 characters, with no spaces.
The file is read again when its modification time, size or inode changes (checked on every
RPC, so adding or revoking a token needs no restart; replace the file atomically, or edit it
in place). If it cannot be read or parsed any more, no token is accepted until it can
(the error is logged once per change of the file).

A client sends "authorization: Bearer <token>" metadata (gRPC's access-token call
credentials do). `BearerTokenInterceptor` lets grpc.health.v1.Health through without a
token, so that probes and balancers' health checks need none, and refuses every other RPC
(CharacterService, reflection) without an accepted token: UNAUTHENTICATED. Tokens are
compared as SHA-256 digests in constant time, against every accepted token; no token is
logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading

import grpc

from characters_jax.serving.rpc_handlers import with_behavior
from characters_jax.wire.credential_files import read_tokens

log = logging.getLogger("characters_jax.serving.auth")

UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)  # reachable without a token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenFile:
    """The accepted tokens of a file, re-read when the file changes. Thread-safe."""

    def __init__(self, path: str):
        """Reads the file now. Raises ValueError (unreadable, a bad line, no token)."""
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._digests = [_digest(t) for t in read_tokens(path)]

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _current(self) -> list[bytes]:
        stamp = self._stat()
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._digests = [_digest(t) for t in read_tokens(self.path)]
                    log.info("token file reloaded", extra={"fields": {"path": self.path, "tokens": len(self._digests)}})
                except ValueError as err:
                    self._digests = []
                    log.error("token file unusable: no token is accepted until it is fixed", extra={"fields": {"error": str(err)}})
            return self._digests

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the file's tokens (constant time in which one, or none)."""
        given = _digest(token)
        ok = False
        for expected in self._current():
            ok |= hmac.compare_digest(given, expected)
        return ok


def bearer_token(metadata) -> str | None:
    """The token of an "authorization: Bearer <token>" entry of a call's metadata, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and pool) as `handler` that ends the call UNAUTHENTICATED."""

    def refuse(_request, context, *_send_response_callback):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return with_behavior(handler, refuse)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC but health checks without an accepted bearer token (UNAUTHENTICATED)."""

    def __init__(self, tokens: TokenFile):
        self.tokens = tokens

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            reason = "no bearer token: this worker needs the metadata 'authorization: Bearer <token>' (a client's credentials file: token_file)"
        elif not self.tokens.accepts(token):
            reason = "the bearer token is not accepted by this worker"
        else:
            return handler
        log.info("unauthenticated call refused", extra={"fields": {"method": method, "token": "absent" if token is None else "not accepted"}})
        return _refusal(handler, reason)
