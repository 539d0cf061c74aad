"""A server interceptor that counts the RPCs that end in an error, by method and status
code (`characters_rpc_errors_total`): what the client saw, INVALID_ARGUMENT and UNKNOWN
(an exception the handler did not turn into a status) included.

The code is the one the handler aborted with or set; an exception without one is UNKNOWN
(what grpc sends), or CANCELLED when the client had gone. Wrapped behaviours keep their
pool (rpc_handlers.with_behavior); non-blocking ones (health Watch) pass through uncounted.
Interceptors run on gRPC's event thread: this one only builds a handler there.
"""

from __future__ import annotations

import grpc

from characters_jax.serving.rpc_handlers import WatchedResponses, behavior_of, with_behavior

UNKNOWN_METHOD = "unknown"  # the label of methods the worker does not serve (a client's string: never a label)


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    def __init__(self, errors):
        """errors: a prometheus Counter labelled (method, code)."""
        self._errors = errors

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            self._count(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED)
            return None
        behavior = behavior_of(handler)
        if getattr(behavior, "experimental_non_blocking", False):
            return handler
        method = handler_call_details.method

        def run(request, context):
            try:
                result = behavior(request, context)
            except BaseException:
                self._count(method, _failed_code(context))
                raise
            if handler.response_streaming:
                return WatchedResponses(result, lambda outcome: self._ended(method, context, outcome))
            self._count(method, context.code())
            return result

        return with_behavior(handler, run)

    def _ended(self, method: str, context, outcome) -> None:
        if outcome is None:
            self._count(method, context.code())
        elif outcome is WatchedResponses.DROPPED:
            self._count(method, grpc.StatusCode.CANCELLED)
        else:
            self._count(method, _failed_code(context))

    def _count(self, method: str, code: grpc.StatusCode | None) -> None:
        if code is not None and code != grpc.StatusCode.OK:
            self._errors.labels(method, code.name).inc()


def _failed_code(context) -> grpc.StatusCode:
    """The status of an RPC whose handler raised."""
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        return code
    return grpc.StatusCode.UNKNOWN if context.is_active() else grpc.StatusCode.CANCELLED
