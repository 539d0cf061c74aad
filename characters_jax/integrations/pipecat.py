"""A Pipecat (pipecat-ai 1.x) video service: the character speaks the bot's TTS audio.

    video = CharactersVideoService(target="dns:///workers:50051", image=png_bytes)
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, video, transport.output(), assistant_agg])

It opens one session on a worker through the client library (a balanced target goes to an
idle worker) when the pipeline starts and closes it when it ends. In: `TTSAudioRawFrame`
(any rate and channel count, converted to 16 kHz mono), `TTSStoppedFrame` (the end of a
speech segment), `InterruptionFrame` / `UserStartedSpeakingFrame` (an interrupt: the frames
not yet pushed are dropped at once, the worker drops its queued speech, and TTS audio that
still arrives is dropped until the next `TTSStartedFrame`). Out, every 1/24 s
on one clock: one `OutputImageRawFrame` (`sync_with_audio`, so the output transport shows
it after the audio before it) and, while the character speaks, the `TTSAudioRawFrame` of
exactly that frame's samples (the speech re-timed to the video). The TTS frames are not
passed on: their audio leaves re-timed. `TTSStoppedFrame` goes downstream when the
segment has played (the worker's PLAYBACK_FINISHED), not when the TTS finished. Errors
(the worker unreachable or failing, malformed audio) go upstream as ErrorFrames and stop
the session; the pipeline's other frames pass through.

Needs pipecat-ai, which needs protobuf < 7: run it in a client environment
(`python -m characters_jax.integrations.client_env .venv-pipecat pipecat`, or `make
pipecat-env`), not in the worker's.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    UserStartedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from characters_jax.client.credentials import ClientCredentials
from characters_jax.integrations.playout import SAMPLE_RATE, CharacterSession, Clock, PlayoutOptions, SessionError, to_mono_16k
from characters_jax.protos_gen import characters_pb2 as pb


class CharactersVideoService(FrameProcessor):
    def __init__(self, *, target: str, image: bytes, prompt: str = "", seed: int = 0, limits: pb.SessionLimits | None = None,
                 credentials: ClientCredentials | None = None, options: PlayoutOptions = PlayoutOptions(), clock: Clock | None = None,
                 **kwargs):
        """target: a worker ('host:port'), a comma list or 'dns:///name:port'; image: the
        reference image (PNG/JPEG/WebP bytes); clock: what paces the frames (default the
        monotonic clock)."""
        super().__init__(**kwargs)
        self._session = CharacterSession(target, image, prompt=prompt, seed=seed, limits=limits, credentials=credentials,
                                         options=options, clock=clock, on_event=self._on_event)
        self._publish_task: asyncio.Task | None = None
        self._closed = False
        self.first_audio_at: float | None = None  # monotonic time of the first TTS audio of the current segment
        self.latencies_s: list[float] = []  # per segment: first TTS audio in -> first speaking frame out
        self._segment_open = False
        self._after_interrupt = False  # TTS audio of the interrupted utterance still on its way: dropped
        self._last_segment = 0

    @property
    def session(self) -> CharacterSession:
        return self._session

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            await self._open()
        elif isinstance(frame, (EndFrame, CancelFrame)):
            await self._close()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSStartedFrame) and direction == FrameDirection.DOWNSTREAM:
            self._after_interrupt = False
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
            if not self._after_interrupt:
                await self._speech(frame)
        elif isinstance(frame, TTSStoppedFrame) and direction == FrameDirection.DOWNSTREAM:
            if self._segment_open:
                self._session.end_segment()
                self._segment_open = False
        elif isinstance(frame, (InterruptionFrame, UserStartedSpeakingFrame)):
            self._session.interrupt()
            self._segment_open = False
            self._after_interrupt = True
            self.first_audio_at = None
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _open(self) -> None:
        try:
            await self._session.open()
        except SessionError as err:
            await self.push_error(f"character worker: {err}", exception=err, force_treat_as_permanent=True)
            self._closed = True
            return
        self._publish_task = self.create_task(self._publish())

    async def _speech(self, frame: TTSAudioRawFrame) -> None:
        if self._closed:
            return
        try:
            if len(frame.audio) % 2:
                raise ValueError(f"{len(frame.audio)} bytes are not whole s16 samples")
            pcm = to_mono_16k(np.frombuffer(frame.audio, "<i2"), frame.sample_rate, frame.num_channels)
        except ValueError as err:
            await self.push_error(f"character worker: bad TTS audio ({err})", exception=err)
            return
        if not self._segment_open:
            self._segment_open = True
            self.first_audio_at = time.monotonic()
        self._session.push_audio(pcm)

    async def _publish(self) -> None:
        s = self._session
        async for tick in s.ticks():
            ts = int(tick.time_s * 1e9)
            if tick.segment:
                if tick.segment != self._last_segment and self.first_audio_at is not None:
                    self.latencies_s.append(time.monotonic() - self.first_audio_at)
                    self.first_audio_at = None
                audio = TTSAudioRawFrame(audio=tick.audio.tobytes(), sample_rate=SAMPLE_RATE, num_channels=1)
                audio.pts = ts
                await self.push_frame(audio)
            self._last_segment = tick.segment or self._last_segment
            image = OutputImageRawFrame(image=tick.frame.tobytes(), size=(tick.frame.shape[1], tick.frame.shape[0]), format="RGB")
            image.sync_with_audio = True
            image.pts = ts
            await self.push_frame(image)
        if s.error is not None and not self._closed:
            await self.push_error(f"character worker: {s.error}", exception=s.error, force_treat_as_permanent=True)

    def _on_event(self, event: pb.SpeechEvent) -> None:
        if event.kind == pb.SpeechEvent.PLAYBACK_FINISHED and not event.interrupted:
            self.create_task(self.push_frame(TTSStoppedFrame()))

    async def _close(self) -> None:
        if self._closed and self._publish_task is None:
            return
        self._closed = True
        await self._session.aclose()
        if self._publish_task is not None:
            await self.cancel_task(self._publish_task)
            self._publish_task = None

    async def cleanup(self):
        await super().cleanup()
        await self._close()
