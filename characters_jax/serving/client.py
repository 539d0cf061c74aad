"""Client library: conversations with a worker, or with any of a set of workers.

A target is one worker ("host:port": a direct connection), a comma list of workers
("h1:p1,h2:p2,..."), or a DNS name ("dns:///workers.example:50051", re-resolved by gRPC).
A list or a DNS name is balanced by gRPC itself: round_robin over the workers with
client-side health checks on "characters.v1.CharacterService" (an idle worker is SERVING,
a busy or draining one NOT_SERVING), waitForReady (a new session waits until some worker is
idle), and retries of RESOURCE_EXHAUSTED / UNAVAILABLE before the session opens (gRPC's: at
most 5 attempts, backoff 0.25 s doubling to 2 s; then the conversation opens a new call, with
jittered backoff, until its open_timeout), so new sessions go to idle workers only.

The streaming API (what a voice agent or the browser bridge uses):

    client = CharacterClient("dns:///workers:50051")
    with client.conversation(image=png_bytes, prompt="hello") as conv:
        session = conv.wait_open()               # pb.Session (RUNNING): id, video size, limits, worker
        conv.send_audio(pcm_int16)               # speech, as it arrives (any pace)
        conv.end_speech()                        # the end of this segment: the character listens again
        conv.interrupt()                         # barge-in; INTERRUPTED comes back with the position
        conv.report_playout(frames_played, underruns)   # unless a PlayoutClock reports for it
        for item in conv:                        # pb.Session, pb.VideoChunk, pb.SpeechEvent, ...
            ...                                  # ... and last a pb.SessionEvent
        conv.end_audio()                         # or: the session completes after its queued speech

After `interrupt()` the conversation drops every chunk until the INTERRUPTED event (they
carry speech past the position), and flushes its PlayoutClock. `AsyncConversation` is the
same over grpc.aio. `converse()` runs a whole clip (CreateSession's session, or its own) and
returns a ConverseResult. RPC errors surface as grpc.RpcError with the worker's status.

Session tokens: only a session's creator may read, close or stream it. The client keeps the
session_token of every Session it receives from its creating call (create_session, or a
conversation that opened its own session) and sends it with get_session, close_session and
conversation(session_id); a session it did not create needs `session_token=` passed in.

Credentials (credentials.py): `CharacterClient(target, credentials=ClientCredentials(...))`
connects over TLS (a client certificate for workers that require one) and sends the bearer
token on every call. A comma list of workers is verified against credentials.server_name,
else its first host as written (give the workers certificates that carry that name).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import queue
import random
import socket
import threading
import time

import grpc
import numpy as np

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.channel_options import client_channel_options
from characters_jax.serving.credentials import ClientCredentials
from characters_jax.serving.health import SERVICE_NAME
from characters_jax.serving.playout import PlayoutClock

PCM_FORMAT = pb.AudioFormat(sample_rate_hz=16000, channels=1, encoding=pb.AudioFormat.PCM_S16LE)
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.25s", "maxBackoff": "2s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}
BALANCED_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": SERVICE_NAME},
    "methodConfig": [{"name": [{"service": SERVICE_NAME, "method": "Converse"}], "waitForReady": True, "retryPolicy": RETRY_POLICY}],
}
RETRY_BUFFER_BYTES = 16 << 20  # a start with a reference image must fit for it to be retried
REOPEN_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
KEPT_SESSION_TOKENS = 256  # the tokens a client keeps, of the sessions it created last


class ConversationError(grpc.RpcError):
    """A conversation that failed on the client's side (e.g. no worker took it in time)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclasses.dataclass(frozen=True)
class ChannelTarget:
    """A gRPC target and whether it is balanced over several workers."""

    uri: str
    balanced: bool
    tls_name: str = ""  # a comma list: its first host as written, the name TLS verifies by default

    @property
    def options(self) -> list[tuple[str, object]]:
        opts = client_channel_options()
        if self.balanced:
            opts += [("grpc.service_config", json.dumps(BALANCED_SERVICE_CONFIG)),
                     ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES), ("grpc.retry_buffer_size", 4 * RETRY_BUFFER_BYTES)]
        return opts

    def tls_options(self, credentials: ClientCredentials) -> list[tuple[str, object]]:
        """The name to verify in the workers' certificates, where the target does not give it."""
        name = credentials.server_name or self.tls_name
        return [("grpc.ssl_target_name_override", name)] if name else []


def _host_port(entry: str) -> tuple[str, int]:
    if entry.startswith("["):
        host, _, port = entry[1:].partition("]:")
    else:
        host, _, port = entry.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target {entry!r}: expected host:port")
    return host, int(port)


def parse_target(target: str, balanced: bool | None = None) -> ChannelTarget:
    """'host:port' -> direct; 'h1:p1,h2:p2' -> balanced over those (names resolved now);
    'dns:///name:port' (or any URI with a scheme) -> balanced, resolved by gRPC.
    `balanced` overrides the choice."""
    t = target.strip()
    if not t:
        raise ValueError("target: empty; give host:port, a comma list of them, or dns:///name:port")
    if "," in t:
        addrs = []
        for entry in (e.strip() for e in t.split(",")):
            if not entry:
                continue
            host, port = _host_port(entry)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                try:
                    ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
                except socket.gaierror as err:
                    raise ValueError(f"target {entry!r}: cannot resolve {host!r} ({err.strerror})") from None
            addrs.append((ip.version, f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"))
        families = {v for v, _ in addrs}
        if len(families) != 1:
            raise ValueError(f"target {target!r}: mixes IPv4 and IPv6 workers; use one family or a DNS name")
        scheme = "ipv4" if families == {4} else "ipv6"
        first_host = _host_port(next(e.strip() for e in t.split(",") if e.strip()))[0]
        return ChannelTarget(f"{scheme}:" + ",".join(a for _, a in addrs), True if balanced is None else balanced, first_host)
    if "://" in t or t.startswith(("dns:", "ipv4:", "ipv6:")):
        return ChannelTarget(t, True if balanced is None else balanced)
    _host_port(t)
    return ChannelTarget(t, bool(balanced))


def open_channel(target: ChannelTarget, credentials: ClientCredentials | None = None, *, aio: bool = False):
    """A channel (grpc, or grpc.aio) to `target`: plaintext without credentials, else TLS
    with the credentials' certificate and token. A client certificate outside its validity
    period raises ConversationError (UNAUTHENTICATED) before any connection."""
    g = grpc.aio if aio else grpc
    if credentials is None:
        return g.insecure_channel(target.uri, options=target.options)
    problem = credentials.certificate_problem()
    if problem:
        raise ConversationError(grpc.StatusCode.UNAUTHENTICATED, problem)
    return g.secure_channel(target.uri, credentials.channel_credentials(), options=target.options + target.tls_options(credentials))


def start_request(*, session_id: str = "", session_token: str = "", image: bytes | None = None, prompt: str = "", seed: int = 0,
                  limits: pb.SessionLimits | None = None, playout_reports: bool = True, begin_with_speech: bool = False,
                  audio_format: pb.AudioFormat = PCM_FORMAT) -> pb.ConverseRequest:
    """The `start` of a Converse stream: of a session made by CreateSession (session_id and
    its session_token), or opening one (image, prompt, seed, limits)."""
    start = pb.ConverseRequest.Start(audio_format=audio_format, playout_reports=playout_reports, begin_with_speech=begin_with_speech)
    if session_id:
        start.session_id = session_id
        start.session_token = session_token
    else:
        start.create.CopyFrom(pb.CreateSessionRequest(image=image or b"", prompt=prompt, seed=seed, limits=limits))
    return pb.ConverseRequest(start=start)


def audio_request(pcm) -> pb.ConverseRequest:
    data = pcm if isinstance(pcm, (bytes, bytearray)) else np.asarray(pcm, "<i2").tobytes()
    return pb.ConverseRequest(audio=pb.ConverseRequest.AudioChunk(pcm=bytes(data)))


def playout_request(frames_played: int, underruns: int) -> pb.ConverseRequest:
    return pb.ConverseRequest(playout=pb.ConverseRequest.PlayoutReport(frames_played=frames_played, underruns=underruns))


def interrupt_request(frames_played: int | None = None, underruns: int = 0) -> pb.ConverseRequest:
    it = pb.ConverseRequest.Interrupt()
    if frames_played is not None:
        it.playout.CopyFrom(pb.ConverseRequest.PlayoutReport(frames_played=frames_played, underruns=underruns))
    return pb.ConverseRequest(interrupt=it)


END_OF_SPEECH = pb.ConverseRequest(end_of_speech=pb.ConverseRequest.EndOfSpeech())
END_OF_AUDIO = pb.ConverseRequest(end_of_audio=pb.ConverseRequest.EndOfAudio())


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


class Conversation(_Senders):
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


class AsyncConversation(_Senders):
    """`Conversation` over grpc.aio: the same requests and the same dropping after an
    interrupt; `async for item in conv` yields the same messages. Build it with
    `AsyncConversation.open(channel, start_request(...), balanced=...)`."""

    def __init__(self, call, outbox: asyncio.Queue, rx: _Receiver, opened: asyncio.Event):
        self._call, self._outbox, self._rx, self._opened = call, outbox, rx, opened

    @classmethod
    def open(cls, channel: grpc.aio.Channel, start: pb.ConverseRequest, *, balanced: bool) -> "AsyncConversation":
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


def aio_channel(target: str, balanced: bool | None = None, credentials: ClientCredentials | None = None) -> tuple[grpc.aio.Channel, ChannelTarget]:
    """A grpc.aio channel to `target` with the same balancing, limits and credentials as
    CharacterClient."""
    t = parse_target(target, balanced)
    return open_channel(t, credentials, aio=True), t


@dataclasses.dataclass
class ConverseResult:
    """Everything a session returned, and the client-side measurements."""

    chunks: list  # VideoChunk protos kept (frames left as bytes), in order
    final_event: object  # SessionEvent or None
    recv_times: list[float]  # monotonic arrival time of each kept chunk
    send_times: np.ndarray  # [n_sent_chunks, 2]: (end sample of the sent audio, monotonic send time)
    underruns: int
    frames_played: int
    stall_s: float
    t_start: float
    session: object = None  # the Session (RUNNING)
    events: list = dataclasses.field(default_factory=list)  # SpeechEvents, in order
    open_time: float = 0.0  # monotonic arrival time of the Session
    attempts: int = 1  # Converse calls the client made to open the session (gRPC's own retries not counted)

    @property
    def frames(self) -> list[np.ndarray]:
        """All frames, [H, W, 3] uint8 each, in order."""
        return [np.frombuffer(f, np.uint8).reshape(c.height, c.width, 3) for c in self.chunks for f in c.frames]

    @property
    def audio(self) -> np.ndarray:
        """The audio slices of all chunks, concatenated: int16 [n]."""
        return np.concatenate([np.frombuffer(c.audio_pcm, "<i2") for c in self.chunks]) if self.chunks else np.zeros(0, np.int16)

    def sample_send_time(self, sample: int) -> float:
        """When the client sent the audio chunk holding speech sample `sample`."""
        i = int(np.searchsorted(self.send_times[:, 0], sample, side="right"))
        return float(self.send_times[min(i, len(self.send_times) - 1), 1])

    def summary(self, fps: int) -> dict:
        c = self.chunks
        out: dict = {"steps": len(c), "frames": sum(len(x.frames) for x in c), "playout_underruns": self.underruns, "playout_stall_s": round(self.stall_s, 3)}
        if len(c) >= 2:
            span = self.recv_times[-1] - self.recv_times[0]
            out["sustained_fps"] = round((out["frames"] - len(c[0].frames)) / span, 2) if span > 0 else None
        for key, vals in (("step", [x.diffusion_ms for x in c]), ("decode", [x.decode_ms for x in c]), ("period", [x.step_period_ms for x in c[1:]])):
            if vals:
                out[f"{key}_ms_p50"] = round(float(np.percentile(vals, 50)), 2)
                out[f"{key}_ms_p99"] = round(float(np.percentile(vals, 99)), 2)
        spoken = [(x.speech[0], t) for x, t in zip(c, self.recv_times) if x.speech]
        if len(self.send_times) and spoken:
            lat = [t - self.sample_send_time(sp.segment_offset_samples) for sp, t in spoken]
            out["audio_to_frame_latency_s_first"] = round(lat[0], 3)
            out["audio_to_frame_latency_s_p50"] = round(float(np.percentile(lat, 50)), 3)
            out["audio_to_frame_latency_s_p99"] = round(float(np.percentile(lat, 99)), 3)
        if self.final_event is not None:
            out["final_state"] = pb.SessionState.Name(self.final_event.state)
            out["end_reason"] = pb.EndReason.Name(self.final_event.end_reason)
        return out


class CharacterClient:
    def __init__(self, target: str, balanced: bool | None = None, reopen: bool | None = None, credentials: ClientCredentials | None = None):
        """target: 'host:port', 'h1:p1,h2:p2,...' or 'dns:///name:port' (see parse_target).
        reopen: a conversation that a worker refuses (RESOURCE_EXHAUSTED, UNAVAILABLE) before
        its Session tries again until its open_timeout; default on for a balanced target (set
        it for one address that is a balancing proxy, such as Envoy). credentials: TLS and a
        bearer token (None: plaintext)."""
        self.target = parse_target(target, balanced)
        self.reopen = self.target.balanced if reopen is None else reopen
        self.address = target
        self.channel = open_channel(self.target, credentials)
        self.stub = characters_pb2_grpc.CharacterServiceStub(self.channel)
        self._tokens: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._tokens_lock = threading.Lock()

    def _keep_token(self, session: pb.Session) -> None:
        """Remembers the session token of a session this client created."""
        if session.session_token:
            with self._tokens_lock:
                self._tokens[session.session_id] = session.session_token
                while len(self._tokens) > KEPT_SESSION_TOKENS:
                    self._tokens.popitem(last=False)

    def session_token(self, session_id: str) -> str:
        """The token of a session this client created ('' if it did not)."""
        with self._tokens_lock:
            return self._tokens.get(session_id, "")

    @property
    def balanced(self) -> bool:
        return self.target.balanced

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout: float) -> None:
        """Waits until the channel is connected (balanced: to some worker, busy or not)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def _direct(self, what: str) -> None:
        if self.balanced:
            raise ValueError(f"{what} needs a direct connection to one worker: on a balanced target, open sessions with "
                             "conversation(image=...) and reach a session's worker at Session.worker_id")

    def create_session(self, image: bytes, prompt: str = "", seed: int = 0, limits: pb.SessionLimits | None = None, timeout: float = 180.0) -> pb.Session:
        self._direct("create_session")
        session = self.stub.CreateSession(pb.CreateSessionRequest(image=image, prompt=prompt, seed=seed, limits=limits), timeout=timeout)
        self._keep_token(session)
        return session

    def get_session(self, session_id: str, timeout: float = 10.0, session_token: str | None = None) -> pb.Session:
        """session_token: default, the one this client received when it created the session."""
        token = self.session_token(session_id) if session_token is None else session_token
        return self.stub.GetSession(pb.GetSessionRequest(session_id=session_id, session_token=token), timeout=timeout)

    def close_session(self, session_id: str, timeout: float = 10.0, session_token: str | None = None) -> pb.Session:
        """session_token: as in get_session."""
        token = self.session_token(session_id) if session_token is None else session_token
        return self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id, session_token=token), timeout=timeout)

    def conversation(self, session_id: str = "", *, image: bytes | None = None, prompt: str = "", seed: int = 0,
                     limits: pb.SessionLimits | None = None, playout: PlayoutClock | None = None, playout_reports: bool | None = None,
                     begin_with_speech: bool = False, audio_format: pb.AudioFormat = PCM_FORMAT,
                     open_timeout: float | None = 300.0, session_token: str | None = None) -> Conversation:
        """Opens a Converse stream: of `session_id` (from create_session on this worker;
        session_token as in get_session), or a new session from `image`. playout: a
        PlayoutClock that plays and reports (else the caller reports, or, with
        playout_reports=False, the worker paces by its wall clock). open_timeout: how long to
        wait for a worker to take the session (balanced: for one to be idle)."""
        if session_id:
            self._direct("a conversation on an existing session")
        token = self.session_token(session_id) if session_token is None else session_token
        reports = playout is not None if playout_reports is None else playout_reports
        start = start_request(session_id=session_id, session_token=token, image=image, prompt=prompt, seed=seed, limits=limits,
                              playout_reports=reports, begin_with_speech=begin_with_speech, audio_format=audio_format)
        return Conversation(self.stub, start, wait_for_ready=self.balanced, open_timeout=open_timeout, playout=playout,
                            reopen=self.reopen and not session_id, on_session=self._keep_token)

    def converse(
        self,
        session_id: str | None,
        pcm: np.ndarray | bytes,
        *,
        image: bytes | None = None,
        prompt: str = "",
        seed: int = 0,
        limits: pb.SessionLimits | None = None,
        fps: int = 24,
        realtime: bool = True,
        send_realtime: bool | None = None,
        chunk_ms: int = 20,
        max_ahead_s: float = 20.0,
        sample_rate: int = 16000,
        channels: int = 1,
        encoding: int = pb.AudioFormat.PCM_S16LE,
        prebuffer_frames: int = 8,
        begin_with_speech: bool = True,
        on_chunk=None,
        on_event=None,
        stop_after_chunks: int | None = None,
        open_timeout: float | None = 300.0,
    ) -> ConverseResult:
        """Streams `pcm` (int16 mono samples, or raw bytes sent as they are) as one speech
        segment and collects the video; the session ends when it has played (END_OF_AUDIO).

        session_id: a session from create_session, or None with `image` (the stream opens
        its own; the only way on a balanced target). realtime: send the audio at its real
        pace and play out at `fps` (else: send at once, at most `max_ahead_s` ahead of the
        video received, and count frames as played on arrival); send_realtime overrides the
        sending half. begin_with_speech: the video starts with the speech (a clip).
        stop_after_chunks: cancel the RPC after that many chunks (a client that goes away).
        Raises grpc.RpcError on a non-OK status."""
        send_realtime = realtime if send_realtime is None else send_realtime
        data = pcm if isinstance(pcm, (bytes, bytearray)) else np.asarray(pcm, "<i2").tobytes()
        bytes_per_sample = 2 * max(channels, 1)
        step_bytes = max(bytes_per_sample, int(sample_rate * chunk_ms / 1000) * bytes_per_sample)
        clock = PlayoutClock(fps, prebuffer_frames, realtime)
        fmt = pb.AudioFormat(sample_rate_hz=sample_rate, channels=channels, encoding=encoding)
        conv = self.conversation(session_id or "", image=image, prompt=prompt, seed=seed, limits=limits, playout=clock,
                                 begin_with_speech=begin_with_speech, audio_format=fmt, open_timeout=open_timeout)
        sent: list[tuple[int, float]] = []
        covered = threading.Condition()
        received_samples = [0]
        stop = threading.Event()

        def send_all():
            t0 = time.monotonic()
            for off in range(0, len(data), step_bytes):
                if stop.is_set():
                    return
                if send_realtime:
                    wait = t0 + off / bytes_per_sample / sample_rate - time.monotonic()
                    if wait > 0 and stop.wait(wait):
                        return
                else:  # bounded ahead of the video, so the worker's speech queue stays bounded
                    with covered:
                        covered.wait_for(lambda: stop.is_set() or off / bytes_per_sample - received_samples[0] < max_ahead_s * sample_rate)
                piece = data[off : off + step_bytes]
                sent.append(((off + len(piece)) // bytes_per_sample, time.monotonic()))
                conv.send_audio(piece)
            conv.end_audio()

        sender = threading.Thread(target=send_all, name="converse-send", daemon=True)
        chunks, recv, events = [], [], []
        t_start = t_open = time.monotonic()
        session = None
        try:
            session = conv.wait_open()
            t_open = time.monotonic()
            sender.start()
            for item in conv:
                if isinstance(item, pb.VideoChunk):
                    chunks.append(item)
                    recv.append(time.monotonic())
                    with covered:
                        received_samples[0] += sum(sp.samples for sp in item.speech)
                        covered.notify_all()
                    if on_chunk:
                        on_chunk(item)
                    if stop_after_chunks is not None and len(chunks) >= stop_after_chunks:
                        conv.cancel()
                        break
                elif isinstance(item, pb.SpeechEvent):
                    events.append(item)
                    if on_event:
                        on_event(item)
        finally:
            stop.set()
            with covered:
                covered.notify_all()
            conv.close()
        clock.wait_drained(timeout=30)
        return ConverseResult(chunks, conv.final, recv, np.asarray(sent, dtype=np.float64).reshape(-1, 2), clock.underruns, clock.played,
                              clock.stall_s, t_start, session, events, t_open, conv.attempts)
