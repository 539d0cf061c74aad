"""One session's Converse stream on the client's side: `ConversationStream` (threads) and
`AsyncConversationStream` (grpc.aio), the same requests and the same handling of what comes back.

After `interrupt()` the stream drops every chunk until the INTERRUPTED event (they carry
speech past the position), and flushes its PlayoutClock. A stream that a worker refuses
(RESOURCE_EXHAUSTED, UNAVAILABLE) before its Session may open a new call, with jittered
backoff, until its open_timeout.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time

import grpc

from characters_jax.client.errors import ConversationError
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.client.requests import END_OF_AUDIO, END_OF_SPEECH, audio_request, interrupt_request, playout_request
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc

REOPEN_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class _Receiver:
    """What both conversations do with a response: the Session opens, chunks are dropped
    while an interrupt is unacknowledged. Returns the message to hand out, or None."""

    def __init__(self):
        self.session: pb.Session | None = None
        self.final: pb.SessionEvent | None = None
        self._unacked = 0
        self._lock = threading.Lock()

    def interrupted(self) -> None:
        with self._lock:
            self._unacked += 1

    def receive(self, resp: pb.ConverseResponse):
        kind = resp.WhichOneof("event")
        msg = getattr(resp, kind) if kind else None
        if kind == "session":
            self.session = msg
        elif kind == "chunk":
            with self._lock:
                if self._unacked:
                    return None
        elif kind == "speech" and msg.kind == pb.SpeechEvent.INTERRUPTED:
            with self._lock:
                self._unacked = max(0, self._unacked - 1)
        elif kind == "session_event":
            self.final = msg
        return msg


class _Senders:
    """The requests a conversation sends after its start; `send` puts one on the stream."""

    def send(self, request: pb.ConverseRequest) -> None:
        raise NotImplementedError

    def send_audio(self, pcm) -> None:
        """Speech: int16 samples, or s16le bytes."""
        self.send(audio_request(pcm))

    def end_speech(self) -> None:
        self.send(END_OF_SPEECH)

    def end_audio(self) -> None:
        self.send(END_OF_AUDIO)

    def report_playout(self, frames_played: int, underruns: int = 0) -> None:
        self.send(playout_request(frames_played, underruns))


class ConversationStream(_Senders):
    """One session's Converse stream (threads; see the module docstring). Iterate from one
    thread; the senders may be called from any thread."""

    def __init__(self, stub, start: pb.ConverseRequest, *, wait_for_ready: bool, open_timeout: float | None,
                 playout: PlayoutClock | None = None, reopen: bool | None = None, on_session=None):
        """playout: a clock that this conversation feeds with the frames it yields and whose
        reports it sends (its on_report is set here). reopen: when a worker refuses the
        session (RESOURCE_EXHAUSTED, UNAVAILABLE), open a new call until open_timeout
        (default: on a balanced channel, i.e. with wait_for_ready). on_session(session): called
        with the Session when it arrives."""
        self._on_session = on_session
        self._outbox: queue.Queue = queue.Queue()
        self._rx = _Receiver()
        self._opened = threading.Event()
        self._done = threading.Event()
        self._open_timed_out = False
        self._stub, self._start, self._wait_for_ready = stub, start, wait_for_ready
        self._reopen = wait_for_ready if reopen is None else reopen
        self._open_by = None if open_timeout is None else time.monotonic() + open_timeout
        self.attempts = 0
        self.playout = playout
        if playout is not None:
            playout.on_report = self.report_playout
        self._call = self._new_call()
        self._messages = self._receive()
        self._timer = None
        if open_timeout is not None:
            self._timer = threading.Timer(open_timeout, self._open_expired, args=(open_timeout,))
            self._timer.daemon = True
            self._timer.start()

    def _new_call(self):
        self.attempts += 1
        return self._stub.Converse(self._requests(self._start, self.attempts), wait_for_ready=self._wait_for_ready)

    @property
    def session(self) -> pb.Session | None:
        return self._rx.session

    @property
    def final(self) -> pb.SessionEvent | None:
        return self._rx.final

    def _open_expired(self, timeout: float) -> None:
        if not self._opened.is_set():
            self._open_timed_out = True
            self._call.cancel()

    def _requests(self, start, attempt: int):
        yield start
        self._opened.wait()  # only the start is ever buffered for a retry
        if attempt != self.attempts:
            return  # a refused attempt's iterator: the messages belong to the call that opened
        while not self._done.is_set():
            item = self._outbox.get()
            if item is None:
                return
            yield item

    # -- sending ---------------------------------------------------------------------------
    def send(self, request: pb.ConverseRequest) -> None:
        if not self._done.is_set():
            self._outbox.put(request)

    def interrupt(self, frames_played: int | None = None) -> None:
        """Barge-in. With a PlayoutClock, it is flushed and its position sent; otherwise
        `frames_played` (if given) is the position. Chunks are dropped until the INTERRUPTED
        event arrives."""
        underruns = 0
        if self.playout is not None:
            frames_played, underruns = self.playout.flush(), self.playout.underruns
        self._rx.interrupted()
        self.send(interrupt_request(frames_played, underruns))

    def cancel(self) -> None:
        """Ends the stream now (the worker ends the session CANCELLED, CLIENT_GONE)."""
        self._done.set()
        self._opened.set()
        self._outbox.put(None)
        self._call.cancel()

    # -- receiving -------------------------------------------------------------------------
    def wait_open(self) -> pb.Session:
        """Blocks until the Session arrives (the first response; the open_timeout bounds the
        wait) and returns it. Iterating afterwards goes on from the response after it."""
        for item in self._messages:
            if isinstance(item, pb.Session):
                return item
        raise ConversationError(grpc.StatusCode.INTERNAL, "the stream ended without a Session")

    def __iter__(self):
        return self._messages

    def _receive(self):
        backoff = 0.25
        while True:
            try:
                for resp in self._call:
                    msg = self._rx.receive(resp)
                    if msg is None:
                        continue
                    if isinstance(msg, pb.Session):
                        self._opened.set()
                        if self._on_session is not None:
                            self._on_session(msg)
                    elif isinstance(msg, pb.VideoChunk) and self.playout is not None:
                        self.playout.add_frames(len(msg.frames))
                    yield msg
                break
            except grpc.RpcError as err:
                delay = backoff * random.uniform(0.5, 1.5)
                if (self._reopen and not self._opened.is_set() and not self._done.is_set() and err.code() in REOPEN_CODES
                        and (self._open_by is None or time.monotonic() + delay < self._open_by)):
                    if not self._done.wait(delay) and not self._open_timed_out:
                        backoff = min(2 * backoff, 2.0)
                        self._call = self._new_call()
                        if self._open_timed_out:  # the open timer fired meanwhile
                            self._call.cancel()
                        continue
                self._finish()
                if self._open_timed_out and err.code() == grpc.StatusCode.CANCELLED:
                    raise ConversationError(grpc.StatusCode.DEADLINE_EXCEEDED, "no worker opened the session in time (all busy or unreachable)") from None
                raise
        self._finish()

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._done.set()
        self._opened.set()
        self._outbox.put(None)
        if self.playout is not None:
            self.playout.end()

    def close(self) -> None:
        if not self._done.is_set():
            self.cancel()
        self._finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncConversationStream(_Senders):
    """`ConversationStream` over grpc.aio: the same requests and the same dropping after an
    interrupt; `async for item in conv` yields the same messages. Build it with
    `AsyncConversationStream.open(channel, start_request(...), balanced=...)`."""

    def __init__(self, call, outbox: asyncio.Queue, rx: _Receiver, opened: asyncio.Event):
        self._call, self._outbox, self._rx, self._opened = call, outbox, rx, opened

    @classmethod
    def open(cls, channel: grpc.aio.Channel, start: pb.ConverseRequest, *, balanced: bool) -> "AsyncConversationStream":
        outbox: asyncio.Queue = asyncio.Queue()
        opened = asyncio.Event()

        async def requests():
            yield start
            await opened.wait()
            while True:
                item = await outbox.get()
                if item is None:
                    return
                yield item

        stub = characters_pb2_grpc.CharacterServiceStub(channel)
        return cls(stub.Converse(requests(), wait_for_ready=balanced), outbox, _Receiver(), opened)

    @property
    def session(self) -> pb.Session | None:
        return self._rx.session

    def send(self, request: pb.ConverseRequest) -> None:
        self._outbox.put_nowait(request)

    def interrupt(self, frames_played: int | None = None, underruns: int = 0) -> None:
        """frames_played: the client's playback position when it cut playback (it discards
        the frames it holds past it)."""
        self._rx.interrupted()
        self.send(interrupt_request(frames_played, underruns))

    def cancel(self) -> None:
        self._opened.set()
        self._outbox.put_nowait(None)
        self._call.cancel()

    async def __aiter__(self):
        try:
            async for resp in self._call:
                msg = self._rx.receive(resp)
                if msg is None:
                    continue
                if isinstance(msg, pb.Session):
                    self._opened.set()
                yield msg
        finally:
            self._opened.set()
            self._outbox.put_nowait(None)
