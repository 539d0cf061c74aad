"""The client library's own errors."""

from __future__ import annotations

import grpc


class ConversationError(grpc.RpcError):
    """A conversation that failed on the client's side (e.g. no worker took it in time)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
