"""One session's Converse stream on the client's side: `ConversationStream` (threads) and
`AsyncConversationStream` (grpc.aio), the same requests and the same handling of what comes back.

After `interrupt()` the stream drops every chunk until the INTERRUPTED event (they carry
speech past the position), and flushes its PlayoutClock. A stream that a worker refuses
(RESOURCE_EXHAUSTED, UNAVAILABLE) before its Session may open a new call, with jittered
backoff, until its open_timeout. A resumable session goes on across workers (client/resume.py):
the stream resumes it when its worker hands it over or fails after a snapshot.
"""

from __future__ import annotations

import asyncio
import math
import queue
import random
import threading
import time

import grpc

from characters_jax.client.errors import ConversationError
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.client.requests import END_OF_AUDIO, END_OF_SPEECH, SNAPSHOT, audio_request, interrupt_request, playout_request
from characters_jax.client.resume import RESUME_RETRY_CODES, Resumption
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

    def reset_interrupts(self, unacked: int) -> None:
        """A resumed stream acknowledges every interrupt it replays: `unacked` of them."""
        with self._lock:
            self._unacked = unacked

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


class _Backoff:
    """Jittered exponential backoff between a refused call and the next: 0.25 s doubling to 2 s,
    each wait drawn from [0.5, 1.5) of it."""

    def __init__(self):
        self.base = 0.25

    def delay(self) -> float:
        return self.base * random.uniform(0.5, 1.5)

    def grow(self) -> None:
        self.base = min(2 * self.base, 2.0)

    def reset(self) -> None:
        self.base = 0.25


class _ResumingStream(_Senders):
    """What both streams keep apart from their transport: the handling of responses
    (`_Receiver`), the `Resumption` of a resumable session (None otherwise), the inputs a
    resumed call's snapshot holds and the record of its handovers."""

    def __init__(self, start: pb.ConverseRequest):
        self._rx = _Receiver()
        self._resume = Resumption(start) if start.start.resumable else None
        self._replay_from: int | None = None  # a resumed call: the inputs its snapshot holds
        self.handovers: list[dict] = []

    @property
    def session(self) -> pb.Session | None:
        return self._rx.session

    @property
    def resumption(self) -> Resumption | None:
        """What a resume needs (None: the session is not resumable)."""
        return self._resume

    def _stamp(self, request: pb.ConverseRequest) -> tuple[int | None, pb.ConverseRequest]:
        """An outbox item: (the input's number in a resumable session, else None; request)."""
        return (self._resume.stamp(request) if self._resume is not None else None), request

    def _accept(self, resp: pb.ConverseResponse) -> tuple[object | None, bool]:
        """One response of the current call: (the message to hand out, or None; whether it is
        the SessionResumed after which a resumed call may send)."""
        if self._resume is not None:
            resp = self._resume.receive(resp)
            if resp is None:
                return None, False
        resumed = resp.WhichOneof("event") == "resumed"
        if resumed:
            self._replay_from = resp.resumed.inputs
            self._rx.reset_interrupts(self._resume.interrupts_after(resp.resumed.inputs))
            self.handovers[-1]["resumed"] = time.monotonic()
        return self._rx.receive(resp), resumed

    def _replay(self) -> tuple[int, list[pb.ConverseRequest]]:
        """A call's first requests after its start: a resumed call's inputs that its snapshot
        lacks, with the number of the last one ((0, []) for a call that resumes nothing)."""
        if self._replay_from is None:
            return 0, []
        last, replay = self._resume.replay(self._replay_from)
        self.handovers[-1]["replayed"] = len(replay)
        return last, replay

    def _handed_over(self, closed: bool) -> bool:
        """The call ended OK and the worker handed the session over: resume it elsewhere."""
        return self._resume is not None and not closed and self._resume.can_resume(None)

    def _may_recover(self, resume_by: float | None, opened: bool, code: grpc.StatusCode) -> bool:
        """An opened call failed with `code` after a snapshot (no resume under way)."""
        return resume_by is None and opened and self._resume is not None and self._resume.can_resume(code)

    @staticmethod
    def _may_retry_resume(resume_by: float | None, now: float, delay: float, code: grpc.StatusCode) -> bool:
        """A resume call refused with `code` is tried again after `delay` before its deadline."""
        return resume_by is not None and now + delay < resume_by and code in RESUME_RETRY_CODES + (grpc.StatusCode.NOT_FOUND,)

    def _resume_start(self, kind: str, code: grpc.StatusCode | None) -> pb.ConverseRequest:
        """Records a handover (migration: the call ended OK; recovery: it failed with `code`) and
        returns the start of the call that resumes its last snapshot."""
        self.handovers.append({"kind": kind, "code": code.name if code is not None else "OK", "ended": time.monotonic(),
                               "step": self._resume.snapshot.step})
        self._replay_from = None
        return self._resume.resume_start()

    def _retry_resume_start(self, code: grpc.StatusCode) -> pb.ConverseRequest:
        """The start of another try of a refused resume (NOT_FOUND: its snapshot is gone, the
        session's newest is resumed); the refused try is not counted."""
        self._resume.resumes -= 1
        return self._resume.resume_start(latest=code == grpc.StatusCode.NOT_FOUND)


class ConversationStream(_ResumingStream):
    """One session's Converse stream (threads; see the module docstring). Iterate from one
    thread; the senders may be called from any thread.

    A resumable session (start.resumable) outlives its worker (client/resume.py): when the
    worker hands it over (a drain) or the stream fails UNAVAILABLE after a snapshot, the
    stream resumes the session through the same channel (a balanced target picks an idle
    worker) and replays the inputs the snapshot lacks; the iteration goes on with the
    resumed stream's Session and SessionResumed, then its chunks. `handovers` records each
    resume: its kind (migration, recovery), the status that ended the old stream, the
    snapshot's step, its monotonic times (ended, resumed, first_chunk), the first step sent
    after it and the inputs replayed."""

    def __init__(self, stub, start: pb.ConverseRequest, *, wait_for_ready: bool, open_timeout: float | None,
                 playout: PlayoutClock | None = None, reopen: bool | None = None, on_session=None):
        """playout: a clock that this conversation feeds with the frames it yields and whose
        reports it sends (its on_report is set here). reopen: when a worker refuses the
        session (RESOURCE_EXHAUSTED, UNAVAILABLE), open a new call until open_timeout
        (default: on a balanced channel, i.e. with wait_for_ready). on_session(session): called
        with the Session when it arrives. A resume waits up to open_timeout for a worker."""
        super().__init__(start)
        self._on_session = on_session
        self._opened = threading.Event()  # the first Session came
        self._done = threading.Event()
        self._open_timed_out = False
        self._stub, self._start, self._wait_for_ready = stub, start, wait_for_ready
        self._reopen = wait_for_ready if reopen is None else reopen
        self._open_timeout = open_timeout
        self._open_by = None if open_timeout is None else time.monotonic() + open_timeout
        self._send_lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()  # the current call's: (input number or None, request), None ends it
        self._call_ready = threading.Event()  # the current call may send: its Session (or SessionResumed) came
        self.attempts = 0
        self.playout = playout
        if playout is not None:
            playout.on_report = self.report_playout
        self._call = self._new_call(start, fresh_outbox=False)
        self._messages = self._receive()
        self._timer = None
        if open_timeout is not None:
            self._timer = threading.Timer(open_timeout, self._open_expired, args=(open_timeout,))
            self._timer.daemon = True
            self._timer.start()

    def _new_call(self, start: pb.ConverseRequest, fresh_outbox: bool):
        """A new Converse call with `start`. fresh_outbox: a resume (the requests not yet sent
        on the old call are inputs the replay holds, or playout reports)."""
        with self._send_lock:
            old_ready, old_outbox = self._call_ready, self._outbox
            self.attempts += 1
            self._call_ready = threading.Event()
            if fresh_outbox:
                self._outbox = queue.Queue()
            ready, outbox, attempt = self._call_ready, self._outbox, self.attempts
        old_ready.set()  # a refused call's request iterator returns
        if fresh_outbox:
            old_outbox.put(None)
        return self._stub.Converse(self._requests(start, attempt, ready, outbox), wait_for_ready=self._wait_for_ready)

    @property
    def final(self) -> pb.SessionEvent | None:
        return self._rx.final

    def _open_expired(self, timeout: float) -> None:
        if not self._opened.is_set():
            self._open_timed_out = True
            self._call.cancel()

    def _requests(self, start, attempt: int, ready: threading.Event, outbox: queue.Queue):
        yield start
        ready.wait()  # only the start is ever buffered for a retry
        if attempt != self.attempts or self._done.is_set():
            return  # a refused attempt's iterator: the messages belong to the call that opened
        last, replay = self._replay()  # a resumed session: the inputs its snapshot lacks first
        yield from replay
        while not self._done.is_set():
            item = outbox.get()
            if item is None:
                return
            seq, request = item
            if seq is not None and seq <= last:
                continue  # replayed already
            yield request

    # -- sending ---------------------------------------------------------------------------
    def send(self, request: pb.ConverseRequest) -> None:
        if self._done.is_set():
            return
        with self._send_lock:
            self._outbox.put(self._stamp(request))

    def interrupt(self, frames_played: int | None = None) -> None:
        """Barge-in. With a PlayoutClock, it is flushed and its position sent; otherwise
        `frames_played` (if given) is the position. Chunks are dropped until the INTERRUPTED
        event arrives."""
        underruns = 0
        if self.playout is not None:
            frames_played, underruns = self.playout.flush(), self.playout.underruns
        self._rx.interrupted()
        self.send(interrupt_request(frames_played, underruns))

    def request_snapshot(self) -> None:
        """Asks the worker for a snapshot at its next step boundary (a resumable session)."""
        self.send(SNAPSHOT)

    def cancel(self) -> None:
        """Ends the stream now (the worker ends the session CANCELLED, CLIENT_GONE)."""
        self._done.set()
        self._opened.set()
        self._call_ready.set()
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
        backoff = _Backoff()
        resume_by = None  # while a resume is opening: its deadline
        while True:
            try:
                for resp in self._call:
                    msg, resumed = self._accept(resp)
                    if resumed:
                        resume_by = None
                        self._call_ready.set()
                    if msg is None:
                        continue
                    if isinstance(msg, pb.Session) and not self._opened.is_set():
                        self._opened.set()
                        self._call_ready.set()
                        if self._on_session is not None:
                            self._on_session(msg)
                    elif isinstance(msg, pb.VideoChunk):
                        if self.handovers and "first_chunk" not in self.handovers[-1]:
                            self.handovers[-1].update(first_chunk=time.monotonic(), first_step=msg.step_index)
                        if self.playout is not None:
                            self.playout.add_frames(len(msg.frames))
                    yield msg
                if self._handed_over(self._done.is_set()):
                    resume_by = self._begin_resume("migration", None)
                    continue
                break
            except grpc.RpcError as err:
                code, now = err.code(), time.monotonic()
                delay = backoff.delay()
                if not self._done.is_set():
                    if (self._reopen and not self._opened.is_set() and code in REOPEN_CODES
                            and (self._open_by is None or now + delay < self._open_by)):
                        if not self._done.wait(delay) and not self._open_timed_out:
                            backoff.grow()
                            self._call = self._new_call(self._start, fresh_outbox=False)
                            if self._open_timed_out:  # the open timer fired meanwhile
                                self._call.cancel()
                            continue
                    elif self._may_retry_resume(resume_by, now, delay, code):
                        if not self._done.wait(delay):
                            backoff.grow()
                            self._call = self._new_call(self._retry_resume_start(code), fresh_outbox=False)
                            continue
                    elif self._may_recover(resume_by, self._opened.is_set(), code):
                        resume_by = self._begin_resume("recovery", code)
                        backoff.reset()
                        continue
                self._finish()
                if self._open_timed_out and err.code() == grpc.StatusCode.CANCELLED:
                    raise ConversationError(grpc.StatusCode.DEADLINE_EXCEEDED, "no worker opened the session in time (all busy or unreachable)") from None
                raise
        self._finish()

    def _begin_resume(self, kind: str, code) -> float:
        """Opens the resume of the last snapshot; returns its deadline (inf: none)."""
        self._call = self._new_call(self._resume_start(kind, code), fresh_outbox=True)
        return math.inf if self._open_timeout is None else time.monotonic() + self._open_timeout

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._done.set()
        self._opened.set()
        self._call_ready.set()
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


class AsyncConversationStream(_ResumingStream):
    """`ConversationStream` over grpc.aio: the same requests, the same dropping after an
    interrupt, and the same resumes of a resumable session (a drain's hand-over, or a
    failure after a snapshot); `async for item in conv` yields the same messages. Build it
    with `AsyncConversationStream.open(channel, start_request(...), balanced=...)`."""

    def __init__(self, stub, start: pb.ConverseRequest, balanced: bool, resume_timeout: float):
        super().__init__(start)
        self._stub, self._balanced, self._resume_timeout = stub, balanced, resume_timeout
        self._closed = False
        self._attempt = 0
        self._outbox: asyncio.Queue = asyncio.Queue()  # the current call's: (input number or None, request), None ends it
        self._ready = asyncio.Event()  # the current call may send: its Session (or SessionResumed) came
        self._call = self._new_call(start, fresh_outbox=False)

    @classmethod
    def open(cls, channel: grpc.aio.Channel, start: pb.ConverseRequest, *, balanced: bool,
             resume_timeout: float = 300.0) -> "AsyncConversationStream":
        """resume_timeout: how long a resume waits for a worker to take the session."""
        return cls(characters_pb2_grpc.CharacterServiceStub(channel), start, balanced, resume_timeout)

    def _new_call(self, start: pb.ConverseRequest, fresh_outbox: bool):
        self._attempt += 1
        old_ready, old_outbox = self._ready, self._outbox
        self._ready = asyncio.Event()
        if fresh_outbox:
            self._outbox = asyncio.Queue()
            old_outbox.put_nowait(None)
        old_ready.set()
        ready, outbox, attempt = self._ready, self._outbox, self._attempt

        async def requests():
            yield start
            await ready.wait()
            if attempt != self._attempt or self._closed:
                return
            last, replay = self._replay()
            for request in replay:
                yield request
            while True:
                item = await outbox.get()
                if item is None:
                    return
                seq, request = item
                if seq is None or seq > last:
                    yield request

        return self._stub.Converse(requests(), wait_for_ready=self._balanced)

    def send(self, request: pb.ConverseRequest) -> None:
        self._outbox.put_nowait(self._stamp(request))

    def interrupt(self, frames_played: int | None = None, underruns: int = 0) -> None:
        """frames_played: the client's playback position when it cut playback (it discards
        the frames it holds past it)."""
        self._rx.interrupted()
        self.send(interrupt_request(frames_played, underruns))

    def cancel(self) -> None:
        self._closed = True
        self._ready.set()
        self._outbox.put_nowait(None)
        self._call.cancel()

    async def __aiter__(self):
        opened, resume_by, backoff = False, None, _Backoff()
        try:
            while True:
                try:
                    async for resp in self._call:
                        msg, resumed = self._accept(resp)
                        if resumed:
                            resume_by = None
                            self._ready.set()
                        if msg is None:
                            continue
                        if isinstance(msg, pb.Session) and not opened:
                            opened = True
                            self._ready.set()
                        yield msg
                    if self._handed_over(self._closed):
                        resume_by = self._begin_resume("migration", None)
                        continue
                    return
                except grpc.RpcError as err:
                    code, now = err.code(), time.monotonic()
                    delay = backoff.delay()
                    if self._closed:
                        raise
                    if self._may_retry_resume(resume_by, now, delay, code):
                        await asyncio.sleep(delay)
                        backoff.grow()
                        self._call = self._new_call(self._retry_resume_start(code), fresh_outbox=False)
                        continue
                    if self._may_recover(resume_by, opened, code):
                        resume_by = self._begin_resume("recovery", code)
                        backoff.reset()
                        continue
                    raise
        finally:
            self._ready.set()
            self._outbox.put_nowait(None)

    def _begin_resume(self, kind: str, code) -> float:
        """Opens the resume of the last snapshot; returns its deadline."""
        self._call = self._new_call(self._resume_start(kind, code), fresh_outbox=True)
        return time.monotonic() + self._resume_timeout
