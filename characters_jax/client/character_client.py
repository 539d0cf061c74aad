"""Client library: conversations with a worker, or with any of a set of workers.

A target is one worker ("host:port": a direct connection), a comma list of workers
("h1:p1,h2:p2,..."), or a DNS name ("dns:///workers.example:50051", re-resolved by gRPC).
A list or a DNS name is balanced by gRPC itself (targets.py): round_robin over the workers
with client-side health checks, waitForReady, and retries of RESOURCE_EXHAUSTED /
UNAVAILABLE before the session opens; then the conversation opens a new call, with jittered
backoff, until its open_timeout (stream.py), so new sessions go to idle workers only.

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
carry speech past the position), and flushes its PlayoutClock. `AsyncConversationStream`
(stream.py) is the same over grpc.aio. `converse()` runs a whole clip (CreateSession's session, or its own) and
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

import collections
import dataclasses
import threading
import time

import grpc
import numpy as np

from characters_jax.client.credentials import ClientCredentials
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.client.requests import start_request
from characters_jax.client.stream import ConversationStream
from characters_jax.client.targets import open_channel, parse_target
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.wire.service import PCM_FORMAT

KEPT_SESSION_TOKENS = 256  # the tokens a client keeps, of the sessions it created last


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
                     open_timeout: float | None = 300.0, session_token: str | None = None, jitter_buffer_s: float | None = None,
                     resumable: bool = True) -> ConversationStream:
        """Opens a Converse stream: of `session_id` (from create_session on this worker;
        session_token as in get_session), or a new session from `image`. playout: a
        PlayoutClock that plays and reports (else the caller reports, or, with
        playout_reports=False, the worker paces by its wall clock). open_timeout: how long to
        wait for a worker to take the session (balanced: for one to be idle). jitter_buffer_s:
        the session's input jitter buffer (None: the worker's; -1: adaptive). resumable: the
        session goes on on another worker when its worker drains or fails after a snapshot
        (workers with a snapshot store; client/resume.py)."""
        if session_id:
            self._direct("a conversation on an existing session")
        token = self.session_token(session_id) if session_token is None else session_token
        reports = playout is not None if playout_reports is None else playout_reports
        start = start_request(session_id=session_id, session_token=token, image=image, prompt=prompt, seed=seed, limits=limits,
                              playout_reports=reports, begin_with_speech=begin_with_speech, audio_format=audio_format,
                              jitter_buffer_s=jitter_buffer_s, resumable=resumable)
        return ConversationStream(self.stub, start, wait_for_ready=self.balanced, open_timeout=open_timeout, playout=playout,
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
