"""The worker's grpc.health.v1 statuses.

"characters.v1.CharacterService": SERVING while the worker is up and idle, NOT_SERVING
while a session is live or the worker drains (what a balancer places sessions by).
"" (the server as a whole): SERVING from start-up until the worker drains (what a
Kubernetes readiness probe reads).

`refresh()` reads the slot when it runs, under this object's lock, so concurrent state
changes cannot leave a stale status behind.
"""

from __future__ import annotations

import threading
from typing import Callable

from grpc_health.v1 import health, health_pb2

SERVICE_NAME = "characters.v1.CharacterService"
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerHealth:
    def __init__(self, is_idle: Callable[[], bool]):
        """is_idle() -> whether the worker's session slot is free."""
        self.servicer = health.HealthServicer()
        self._is_idle = is_idle
        self._lock = threading.Lock()
        self._ready = False
        self.draining = False
        self._set(False, False)

    def ready(self) -> None:
        """The worker has started and takes sessions."""
        with self._lock:
            self._ready = True
        self.refresh()

    def refresh(self) -> None:
        with self._lock:
            up = self._ready and not self.draining
            self._set(up, up and self._is_idle())

    def drain(self) -> None:
        """NOT_SERVING for good, under both names."""
        with self._lock:
            self.draining = True
            self._set(False, False)

    def _set(self, up: bool, idle: bool) -> None:
        self.servicer.set("", _SERVING if up else _NOT_SERVING)
        self.servicer.set(SERVICE_NAME, _SERVING if idle else _NOT_SERVING)
