"""Building gRPC method handlers whose behaviours carry grpc's per-method attributes.

grpc's sync server reads two attributes off a handler's behaviour (grpc/_server.py):
`experimental_thread_pool` (a ThreadPoolExecutor: the RPC's handler runs there instead of
the server's pool) and `experimental_non_blocking` (a response-streaming behaviour gets a
third argument, `send_response_callback(response | None)`, returns at once and holds no
thread). `Behavior` is a small callable carrying them, so they are set per handler, never
on a class's functions. `with_behavior` rebuilds a handler around a new function and keeps
the old behaviour's attributes, so a wrapper (an interceptor, an admission counter) does
not move an RPC to another pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

_KINDS = {  # (request_streaming, response_streaming) -> (handler attribute, constructor)
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class Behavior:
    """`fn(request_or_iterator, context[, send_response_callback])` with grpc's attributes."""

    def __init__(self, fn: Callable, pool: futures.ThreadPoolExecutor | None = None, non_blocking: bool = False):
        self._fn = fn
        self.experimental_thread_pool = pool
        self.experimental_non_blocking = non_blocking

    def __call__(self, *args):
        return self._fn(*args)


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable:
    return getattr(handler, _KINDS[(handler.request_streaming, handler.response_streaming)][0])


def with_behavior(handler: grpc.RpcMethodHandler, fn: Callable, pool: futures.ThreadPoolExecutor | None = None) -> grpc.RpcMethodHandler:
    """The same kind of handler (serializers included) around `fn`, run on `pool` (default:
    the pool of the handler's behaviour), non-blocking when the behaviour was."""
    old = behavior_of(handler)
    behavior = Behavior(fn, pool or getattr(old, "experimental_thread_pool", None), bool(getattr(old, "experimental_non_blocking", False)))
    make = _KINDS[(handler.request_streaming, handler.response_streaming)][1]
    return make(behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class WatchedResponses:
    """A handler's response iterator that reports how it ended, once: `on_end(None)` when
    it is exhausted, `on_end(error)` when it raises, `on_end(DROPPED)` when it is dropped
    unfinished (gRPC stops iterating a stream whose client went away)."""

    DROPPED = "dropped"

    def __init__(self, responses: Iterator, on_end: Callable[[object], None]):
        self._responses, self._on_end = responses, on_end
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._responses)
        except StopIteration:
            self._end(None)
            raise
        except BaseException as err:
            self._end(err)
            raise

    def _end(self, outcome) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(outcome)

    def __del__(self):
        self._end(self.DROPPED)


class _HandlerCollector:
    """Stands in for a server in a generated `add_XServicer_to_server`, keeping its handlers."""

    def __init__(self):
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, _handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services[service] = dict(handlers)


def generated_handlers(add_to_server: Callable, servicer) -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
    """(service name, {method: handler}) that a generated `add_XServicer_to_server` would
    register for `servicer`."""
    collector = _HandlerCollector()
    add_to_server(servicer, collector)
    ((service, handlers),) = collector.services.items()
    return service, handlers


def register(server: grpc.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Adds a service's handlers to a server (generic and registered, as generated code does)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
