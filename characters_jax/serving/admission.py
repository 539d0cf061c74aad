"""Bounds on a worker's concurrent RPCs, so that no number of idle streams can take every
thread: an admission counter per service, checked when an RPC's handler starts.

An RPC over its service's limit is refused RESOURCE_EXHAUSTED with a message naming the
limit. Each limited service runs on its own pool, sized to its limit plus `spare_threads`,
so refusals always find a thread; health runs on a pool of its own (health.py) and is
never admitted or refused here.
"""

from __future__ import annotations

import threading

import grpc

from characters_jax.config import RpcLimits  # the [serve] table's RPC limits
from characters_jax.serving.rpc_handlers import WatchedResponses, behavior_of, with_behavior

__all__ = ["Admission", "RpcLimits", "admitted"]


class Admission:
    """A counter of the RPCs a service is running, with a limit."""

    def __init__(self, service: str, limit: int, knob: str):
        """service: its name in messages and metrics; knob: the setting that sets the limit."""
        self.service, self.limit, self.knob = service, limit, knob
        self._lock = threading.Lock()
        self.admitted = 0

    def enter(self) -> bool:
        with self._lock:
            if self.admitted >= self.limit:
                return False
            self.admitted += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.admitted -= 1

    @property
    def refusal(self) -> str:
        return (f"{self.service}: this worker runs at most {self.limit} at once ({self.knob}) and all are taken; "
                "retry later or on another worker")


def admitted(handler: grpc.RpcMethodHandler, admission: Admission) -> grpc.RpcMethodHandler:
    """The handler counted against `admission` from its start to its end (a response stream:
    until it is exhausted or dropped); over the limit, RESOURCE_EXHAUSTED."""
    behavior = behavior_of(handler)

    def run(request, context):
        if not admission.enter():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.refusal)
        try:
            result = behavior(request, context)
        except BaseException:
            admission.leave()
            raise
        if handler.response_streaming:
            return WatchedResponses(result, lambda _outcome: admission.leave())
        admission.leave()
        return result

    return with_behavior(handler, run)
