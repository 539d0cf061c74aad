"""The viewer's one gRPC client: a session on a worker, as the gateway needs it.

    link = WorkerLink("127.0.0.1:50051")
    session = await link.open(image_bytes, prompt)      # CreateSession; raises LinkError
    await link.start()                                  # Converse, with playout reports
    link.send_audio(pcm_16k_s16le)                      # the microphone, as it arrives
    link.report_playout(frames_played, underruns)
    async for event in link.events(): ...               # ChunkEvent | StateEvent
    await link.close()                                  # cancels the stream, closes the session

Everything that knows the proto lives here; the rest of the gateway sees plain events.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import time

import grpc
import numpy as np

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 16 << 20)]
SAMPLE_RATE = 16000


class LinkError(Exception):
    """A worker call failed; `code` is the gRPC status name, the message the worker's own."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    session_id: str
    width: int
    height: int
    fps: int
    frames_per_step: int


@dataclasses.dataclass(frozen=True)
class ChunkEvent:
    """One generator step's output. frames: [H, W, 3] uint8 each; audio: [n] int16 at 16 kHz."""

    step: int
    first_frame: int
    frames: list
    audio: np.ndarray
    audio_first_sample: int
    diffusion_ms: float
    decode_ms: float
    period_ms: float
    arrival_latency_s: float | None  # arrival minus when the chunk's first sample went up


@dataclasses.dataclass(frozen=True)
class StateEvent:
    state: str  # RUNNING, COMPLETED, FAILED, CANCELLED
    message: str = ""


class WorkerLink:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = characters_pb2_grpc.CharacterServiceStub(self._channel)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = None
        self.session: SessionInfo | None = None
        self.sent_samples = 0
        self._send_ends: list[int] = []  # end sample of each audio send not yet carried by a chunk
        self._send_times: list[float] = []  # its monotonic time
        self._finished = False

    async def open(self, image: bytes, prompt: str = "", seed: int = 0, timeout: float = 180.0) -> SessionInfo:
        try:
            s = await self._stub.CreateSession(pb.CreateSessionRequest(image=image, prompt=prompt, seed=seed), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise LinkError(err.code().name, err.details() or "") from None
        self.session = SessionInfo(s.session_id, s.width, s.height, s.fps, s.frames_per_step)
        return self.session

    async def start(self) -> None:
        fmt = pb.AudioFormat(sample_rate_hz=SAMPLE_RATE, channels=1, encoding=pb.AudioFormat.PCM_S16LE)
        self._outbox.put_nowait(pb.ConverseRequest(start=pb.ConverseRequest.Start(session_id=self.session.session_id, audio_format=fmt, playout_reports=True)))
        self._call = self._stub.Converse(self._requests())

    async def _requests(self):
        while True:
            req = await self._outbox.get()
            if req is None:
                return
            yield req

    def send_audio(self, pcm: bytes) -> None:
        """16 kHz mono s16le, whole samples."""
        if not pcm or self._finished:
            return
        self.sent_samples += len(pcm) // 2
        self._send_ends.append(self.sent_samples)
        self._send_times.append(time.monotonic())
        self._outbox.put_nowait(pb.ConverseRequest(audio=pb.ConverseRequest.AudioChunk(pcm=pcm)))

    def report_playout(self, frames_played: int, underruns: int) -> None:
        if not self._finished:
            self._outbox.put_nowait(pb.ConverseRequest(playout=pb.ConverseRequest.PlayoutReport(frames_played=frames_played, underruns=underruns)))

    def _sample_send_time(self, sample: int) -> float | None:
        """When the audio holding `sample` was sent (None if not sent by this link). Chunks come
        in order, so the sends before `sample` are forgotten."""
        i = bisect.bisect_right(self._send_ends, sample)
        del self._send_ends[:i], self._send_times[:i]
        return self._send_times[0] if self._send_times else None

    async def events(self):
        """ChunkEvent per step, then one StateEvent (COMPLETED, FAILED or CANCELLED)."""
        try:
            async for resp in self._call:
                if resp.WhichOneof("event") == "chunk":
                    c = resp.chunk
                    now = time.monotonic()
                    sent = self._sample_send_time(c.audio_first_sample)
                    frames = [np.frombuffer(f, np.uint8).reshape(c.height, c.width, 3) for f in c.frames]
                    yield ChunkEvent(c.step_index, c.first_frame_index, frames, np.frombuffer(c.audio_pcm, "<i2").astype(np.int16), c.audio_first_sample,
                                     c.diffusion_ms, c.decode_ms, c.step_period_ms, None if sent is None else now - sent)
                else:
                    e = resp.session_event
                    yield StateEvent(pb.SessionState.Name(e.state), e.message)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED or not self._finished:
                yield StateEvent("FAILED" if err.code() != grpc.StatusCode.CANCELLED else "CANCELLED", f"{err.code().name}: {err.details()}")

    async def close(self) -> None:
        """Ends the stream (the worker cancels the session at once) and the session, if still open."""
        if self._finished:
            return
        self._finished = True
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self.session is not None:
            try:
                await self._stub.CloseSession(pb.CloseSessionRequest(session_id=self.session.session_id), timeout=5)
            except grpc.aio.AioRpcError:
                pass
        await self._channel.close()
