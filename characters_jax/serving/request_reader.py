"""Reading a client stream's requests with a deadline, in sync gRPC.

gRPC's request iterator blocks with no deadline. `RequestReader` reads it on a thread of
its own, one request per call and only when asked (never ahead), so the RPC's thread can
wait with a timeout. One reader thread per admitted stream: the admission limits
(admission.py) bound them.

  - `first_request` reads a Converse stream's first request within the stream's
    `first_timeout_s` (DEADLINE_EXCEEDED after it); the session then reads the rest
    directly, without a thread hop.
  - `with_idle_deadline` ends a stream whose client sends nothing for `timeout_s`
    (DEADLINE_EXCEEDED), e.g. an idle reflection stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from characters_jax.serving.admission import RpcLimits

_ITEM, _END, _ERROR = "item", "end", "error"


class RequestReader:
    """Iterates a request iterator; `next_within(timeout)` waits at most `timeout` seconds.
    Plain iteration (`next(reader)`) reads directly on the caller's thread."""

    def __init__(self, requests: Iterator, first_timeout_s: float | None = None):
        """first_timeout_s: the deadline `first_request` gives the first request (None: the
        defaults of admission.RpcLimits)."""
        self._requests = requests
        self.first_timeout_s = first_timeout_s
        self._cond = threading.Condition()
        self._wanted = False  # a read is asked for or under way
        self._result: tuple | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def next_within(self, timeout_s: float | None):
        """The next request. Raises StopIteration at the end of the stream, TimeoutError
        when none came within timeout_s (the read stays under way: a later call gets its
        result), or what the iterator raised (grpc.RpcError when the RPC went away)."""
        with self._cond:
            if self._result is None and not self._wanted:
                self._wanted, self._stopped = True, False
                if self._thread is None:
                    self._thread = threading.Thread(target=self._read, name="request-reader", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._result is not None, timeout_s):
                raise TimeoutError(f"no request within {timeout_s:g} s")
            kind, value = self._result
            if kind == _ITEM:
                self._result = None
        if kind == _ITEM:
            return value
        if kind == _END:
            raise StopIteration
        raise value

    def stop(self) -> None:
        """The reader thread ends once it is not reading (at once if idle); a later
        `next_within` starts another."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self):
        with self._cond:
            threaded = self._wanted or self._result is not None
        return self.next_within(None) if threaded else next(self._requests)

    def _read(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._stopped)
                if not self._wanted:
                    self._thread = None
                    return
            try:
                result = (_ITEM, next(self._requests))
            except StopIteration:
                result = (_END, None)
            except Exception as err:  # grpc.RpcError: the RPC went away; the waiting call raises it
                result = (_ERROR, err)
            with self._cond:
                self._result, self._wanted = result, False
                self._cond.notify_all()
                if result[0] != _ITEM:
                    self._thread = None
                    return


def first_request(requests: Iterator, context):
    """A Converse stream's first request, read within the stream's first-request deadline
    (`RequestReader.first_timeout_s`; a plain iterator gets RpcLimits' default). Aborts
    with INVALID_ARGUMENT on an empty stream and DEADLINE_EXCEEDED when none comes in time."""
    reader = requests if isinstance(requests, RequestReader) else RequestReader(requests)
    timeout_s = reader.first_timeout_s if reader.first_timeout_s is not None else RpcLimits().first_request_timeout_s
    try:
        return reader.next_within(timeout_s)
    except StopIteration:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Converse: the stream was empty; the first request must be `start`")
    except TimeoutError:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Converse: no first request within {timeout_s:g} s of the stream opening; "
                                                         "the first request must be `start`, sent at once")
    finally:
        reader.stop()


def with_idle_deadline(requests: Iterator, context, timeout_s: float, what: str) -> Iterator:
    """The requests, the stream ended DEADLINE_EXCEEDED when the client sends none for
    timeout_s seconds. what: the stream's name in the message."""
    reader = RequestReader(requests)
    try:
        while True:
            try:
                item = reader.next_within(timeout_s)
            except StopIteration:
                return
            except TimeoutError:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: no request for {timeout_s:g} s; idle streams are closed")
            yield item
    finally:
        reader.stop()
