"""The worker's grpc.health.v1 service and the statuses it reports.

`HealthService` serves grpc.health.v1.Health and never sends while it holds a lock:
  - statuses live in a dict under one short lock (no call is made while it is held);
  - Check answers from that dict;
  - Watch is non-blocking (grpc's experimental_non_blocking): its handler registers the
    watcher and returns at once, so no thread is held per watch;
  - one notifier thread delivers the updates, coalesced to the latest status per watcher,
    with no lock held while it sends (a send waits for gRPC's event thread);
  - a watch's close callback (run on gRPC's event thread) only removes the watcher under
    the short lock.
Check and Watch run on a small pool of their own (`pool`), so no other RPC can starve them.

`WorkerHealth` decides the statuses:
"characters.v1.CharacterService": SERVING while the worker is up and idle, NOT_SERVING
while a session is live or the worker drains (what a balancer places sessions by).
"" (the server as a whole): SERVING from start-up until the worker drains (what a
Kubernetes readiness probe reads).
`refresh()` reads the slot when it runs, under WorkerHealth's lock, so concurrent state
changes cannot leave a stale status behind; setting a status only updates the dict and
wakes the notifier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

from characters_jax.serving.rpc_handlers import Behavior
from characters_jax.wire.service import SERVICE_NAME

log = logging.getLogger("characters_jax.serving.health")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_R = health_pb2.HealthCheckResponse
_SERVING, _NOT_SERVING, _UNKNOWN = _R.SERVING, _R.NOT_SERVING, _R.SERVICE_UNKNOWN


class _Watcher:
    """One Watch stream: its service, its send callback and the statuses pending / sent."""

    __slots__ = ("open", "pending", "send", "sent", "service")

    def __init__(self, service: str, send: Callable, status: int):
        self.service, self.send = service, send
        self.pending, self.sent, self.open = status, None, True


class HealthService:
    def __init__(self, pool: futures.ThreadPoolExecutor | None = None, on_change: Callable[[str, int], None] | None = None):
        """pool: where Check and Watch run (None: the server's pool). on_change(service,
        status) is called, under the short lock, when a service's status changes (a
        metric: it must not block)."""
        self.pool = pool
        self._on_change = on_change
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[_Watcher]] = {}
        self._due: dict[_Watcher, None] = {}  # watchers with a status to send, in order
        self._closed = False
        self._notifier: threading.Thread | None = None

    # -- statuses ---------------------------------------------------------------------------
    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._status.get(service) == status:
                return
            self._status[service] = status
            for w in self._watchers.get(service, ()):
                w.pending = status
                self._due[w] = None
            if self._on_change is not None:
                self._on_change(service, status)
            self._wake.notify()

    def status(self, service: str) -> int | None:
        with self._lock:
            return self._status.get(service)

    @property
    def watchers(self) -> int:
        with self._lock:
            return sum(len(ws) for ws in self._watchers.values())

    # -- the RPCs ---------------------------------------------------------------------------
    def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"health: no service named {request.service[:200]!r} on this worker "
                                                     f"(known: '' and {SERVICE_NAME!r})")
        return _R(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context, send_response_callback: Callable) -> None:
        """Non-blocking: registers the watcher (its first message is the current status,
        SERVICE_UNKNOWN for an unknown service) and returns."""
        with self._lock:
            closed = self._closed
            if not closed:
                w = _Watcher(request.service, send_response_callback, self._status.get(request.service, _UNKNOWN))
                self._watchers.setdefault(w.service, set()).add(w)
                self._due[w] = None
                self._start_notifier()
                self._wake.notify()
        if closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "health: the worker is shutting down")
        if not context.add_callback(lambda: self._forget(w)):  # the RPC ended already
            self._forget(w)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Check and Watch, on this service's pool (Watch non-blocking)."""
        req, resp = health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
        return {"Check": grpc.unary_unary_rpc_method_handler(Behavior(self.Check, self.pool), request_deserializer=req, response_serializer=resp),
                "Watch": grpc.unary_stream_rpc_method_handler(Behavior(self.Watch, self.pool, non_blocking=True),
                                                              request_deserializer=req, response_serializer=resp)}

    def close(self, timeout_s: float = 1.0) -> None:
        """Stops the notifier (watch streams end with the server)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            notifier = self._notifier
        if notifier is not None and notifier is not threading.current_thread():
            notifier.join(timeout_s)

    # -- delivery ---------------------------------------------------------------------------
    def _forget(self, w: _Watcher) -> None:
        """The watch ended (gRPC's event thread): drop it, under the short lock only."""
        with self._lock:
            w.open = False
            ws = self._watchers.get(w.service)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._watchers[w.service]
            self._due.pop(w, None)

    def _start_notifier(self) -> None:
        if self._notifier is None:
            self._notifier = threading.Thread(target=self._deliver, name="health-notifier", daemon=True)
            self._notifier.start()

    def _deliver(self) -> None:
        while True:
            with self._lock:
                while not self._due and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch = []
                for w in self._due:
                    if w.open and w.pending != w.sent:
                        batch.append((w, w.pending))
                        w.sent = w.pending
                self._due.clear()
            for w, status in batch:  # no lock held: a send waits for gRPC's event thread
                try:
                    w.send(_R(status=status))
                except Exception:  # a stream that ended under the send; its close callback forgets it
                    log.debug("health update not sent", exc_info=True)


class WorkerHealth:
    def __init__(self, is_idle: Callable[[], bool], pool: futures.ThreadPoolExecutor | None = None,
                 on_change: Callable[[str, int], None] | None = None):
        """is_idle() -> whether the worker's session slot is free; pool and on_change: the
        HealthService's."""
        self.servicer = HealthService(pool, on_change)
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
