"""The viewer's one gRPC client: a conversation with a worker, as the gateway needs it.

    link = WorkerLink("127.0.0.1:50051")      # or a balanced target (see client.parse_target)
    session = await link.open(image, prompt)  # Converse opens the session itself; raises LinkError
    link.send_audio(pcm_16k_s16le)            # the microphone, as it arrives: one live segment
    link.report_playout(frames_played, underruns)
    link.interrupt(frames_played, underruns)  # barge-in
    async for event in link.events(): ...     # ChunkEvent | SpeechNote | StateEvent
    await link.close()                        # ends the stream: the worker frees the session

The microphone is one speech segment that never ends while the page talks (silence
included); the session begins with it (`begin_with_speech`), and where the microphone is
late the worker fills silence, so the video never stops. After an interrupt the next audio
opens a new segment. Everything that knows the proto lives here and in the client library.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import time

import grpc
import numpy as np

from characters_jax.client.credentials import ClientCredentials
from characters_jax.client.requests import start_request
from characters_jax.client.stream import AsyncConversationStream
from characters_jax.client.targets import aio_channel
from characters_jax.protos_gen import characters_pb2 as pb

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
    worker_id: str
    max_duration_s: float
    idle_timeout_s: float


@dataclasses.dataclass(frozen=True)
class ChunkEvent:
    """One generator step's output. frames: [H, W, 3] uint8 each; audio: [n] int16 at 16 kHz,
    timeline samples [audio_first_sample, audio_first_sample + n)."""

    step: int
    first_frame: int  # on the session's timeline
    frames: list
    audio: np.ndarray
    audio_first_sample: int
    speech_samples: int  # of audio, how many are the microphone's (the rest is inserted silence)
    diffusion_ms: float
    decode_ms: float
    period_ms: float
    arrival_latency_s: float | None  # arrival minus when its first microphone sample went up


@dataclasses.dataclass(frozen=True)
class SpeechNote:
    kind: str  # SPEAKING_STARTED, SPEAKING_STOPPED, PLAYBACK_FINISHED, INTERRUPTED
    segment: int
    position_samples: int
    interrupted: bool
    played_samples: int


@dataclasses.dataclass(frozen=True)
class StateEvent:
    state: str  # COMPLETED, FAILED, CANCELLED
    message: str = ""
    end_reason: str = ""


def _link_error(err: grpc.aio.AioRpcError) -> LinkError:
    return LinkError(err.code().name, err.details() or "")


class WorkerLink:
    def __init__(self, target: str, credentials: ClientCredentials | None = None):
        """credentials: TLS and a bearer token for the worker (None: plaintext)."""
        self.target = target
        self._channel, t = aio_channel(target, credentials=credentials)
        self._balanced = t.balanced
        self._conv: AsyncConversationStream | None = None
        self._messages = None
        self.session: SessionInfo | None = None
        self.sent_samples = 0
        self._segment_starts: list[int] = []  # sent-sample index where each segment began
        self._new_segment = True
        self._send_ends: list[int] = []  # end (sent-sample index) of each audio send not yet carried by a chunk
        self._send_times: list[float] = []  # its monotonic time
        self._closed = False

    async def open(self, image: bytes, prompt: str = "", seed: int = 0, timeout_s: float = 180.0) -> SessionInfo:
        """Opens the session on a Converse stream. Raises LinkError (the worker's refusal:
        INVALID_ARGUMENT for an image it cannot read, RESOURCE_EXHAUSTED when busy, ...)."""
        start = start_request(image=image, prompt=prompt, seed=seed, playout_reports=True, begin_with_speech=True)
        self._conv = AsyncConversationStream.open(self._channel, start, balanced=self._balanced)
        self._messages = self._conv.__aiter__()
        try:
            first = await asyncio.wait_for(self._messages.__anext__(), timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _link_error(err) from None
        except StopAsyncIteration:
            raise LinkError("UNAVAILABLE", "the worker ended the stream before the session opened") from None
        except asyncio.TimeoutError:
            self._conv.cancel()
            raise LinkError("DEADLINE_EXCEEDED", f"no session from the worker within {timeout_s:g} s") from None
        if not isinstance(first, pb.Session):
            raise LinkError("INTERNAL", f"the worker's first message was a {type(first).__name__}, not the Session")
        self.session = SessionInfo(first.session_id, first.width, first.height, first.fps, first.frames_per_step, first.worker_id,
                                   first.limits.max_duration_s, first.limits.idle_timeout_s)
        return self.session

    # -- requests -----------------------------------------------------------------------------
    def send_audio(self, pcm: bytes) -> None:
        """16 kHz mono s16le, whole samples."""
        if not pcm or self._closed:
            return
        if self._new_segment:
            self._segment_starts.append(self.sent_samples)
            self._new_segment = False
        self.sent_samples += len(pcm) // 2
        self._send_ends.append(self.sent_samples)
        self._send_times.append(time.monotonic())
        self._conv.send_audio(pcm)

    def report_playout(self, frames_played: int, underruns: int) -> None:
        if not self._closed:
            self._conv.report_playout(frames_played, underruns)

    def interrupt(self, frames_played: int, underruns: int) -> None:
        """Barge-in at the playback position; chunks until the INTERRUPTED note are dropped."""
        if not self._closed:
            self._conv.interrupt(frames_played, underruns)
            self._new_segment = True

    # -- responses ----------------------------------------------------------------------------
    def _send_time(self, segment: int, offset: int) -> float | None:
        """When the microphone sample `offset` of `segment` was sent (None if unknown). Chunks
        come in order, so the sends before it are forgotten."""
        if not 1 <= segment <= len(self._segment_starts):
            return None
        i = bisect.bisect_right(self._send_ends, self._segment_starts[segment - 1] + offset)
        del self._send_ends[:i], self._send_times[:i]
        return self._send_times[0] if self._send_times else None

    def _chunk(self, c: pb.VideoChunk) -> ChunkEvent:
        now = time.monotonic()
        sent = self._send_time(c.speech[0].segment, c.speech[0].segment_offset_samples) if c.speech else None
        frames = [np.frombuffer(f, np.uint8).reshape(c.height, c.width, 3) for f in c.frames]
        return ChunkEvent(c.step_index, c.first_frame_index, frames, np.frombuffer(c.audio_pcm, "<i2").astype(np.int16), c.audio_first_sample,
                          sum(s.samples for s in c.speech), c.diffusion_ms, c.decode_ms, c.step_period_ms, None if sent is None else now - sent)

    async def events(self):
        """ChunkEvents and SpeechNotes in stream order, then one StateEvent."""
        try:
            async for msg in self._messages:
                if isinstance(msg, pb.VideoChunk):
                    yield self._chunk(msg)
                elif isinstance(msg, pb.SpeechEvent):
                    yield SpeechNote(pb.SpeechEvent.Kind.Name(msg.kind), msg.segment, msg.position_samples, msg.interrupted, msg.played_samples)
                elif isinstance(msg, pb.SessionEvent):
                    yield StateEvent(pb.SessionState.Name(msg.state), msg.message, pb.EndReason.Name(msg.end_reason))
        except grpc.aio.AioRpcError as err:
            if not self._closed:
                yield StateEvent("CANCELLED" if err.code() == grpc.StatusCode.CANCELLED else "FAILED", f"{err.code().name}: {err.details()}")

    async def close(self) -> None:
        """Ends the stream; the worker ends the session (CLIENT_GONE) and is free at once."""
        if self._closed:
            return
        self._closed = True
        if self._conv is not None:
            self._conv.cancel()
        await self._channel.close()
