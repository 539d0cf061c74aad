"""A LiveKit avatar worker (livekit-agents 1.8.9): the character as the remote avatar
participant of a voice agent's room.

    avatar = CharacterAvatar(room, target="dns:///workers:50051", image=png)   # room: connected with the avatar's token
    reason = await avatar.run()                                                # until the room or the session ends

The contract with the agent (livekit-agents' DataStreamAudioOutput on its side):
- audio from the agent over the byte stream topic `lk.audio_stream`, read by livekit-agents'
  own `DataStreamAudioReceiver`: one stream per speech segment, 16 kHz mono s16 (the
  stream's attributes; another rate or channel count is refused: the segment is answered
  with playback_finished at 0, interrupted, and logged with the format it had). A stream
  whose trailer is lost ends after the receiver's idle timeout (10 s).
- RPC `lk.clear_buffer` (agent -> avatar): an interrupt of the worker's session, answered
  with `lk.playback_finished` `{playback_position, interrupted: true}` once the worker has
  cut the segment (the position is the segment's seconds played). With no segment playing
  the RPC fails with APPLICATION_ERROR "no speech segment is playing".
- `lk.playback_started` when a segment's first frame is published, `lk.playback_finished`
  `{playback_position, interrupted: false}` when its last one has (the worker's
  PLAYBACK_FINISHED: it follows this avatar's playout reports).
- tracks: one audio and one video track, published by this participant; the token that
  `CharacterAvatarSession` mints carries `lk.publish_on_behalf` = the agent's identity, so
  the room counts them as the agent's. Frames and their samples are published together,
  one frame period at a time (`CharacterSession.ticks`: one clock, no A/V synchronizer).

Lifecycle: the worker session opens before the avatar listens (a worker that cannot be
reached fails `run` with SessionError, nothing left running); the avatar leaves the room
when the session ends (its max_duration or idle_timeout, an error), and ends the session
when the room disconnects or the agent leaves. `run` returns why it ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import numpy as np
from livekit import rtc
from livekit.agents import utils
from livekit.agents.voice.avatar import AudioSegmentEnd, DataStreamAudioReceiver

from characters_jax.client.credentials import ClientCredentials
from characters_jax.integrations.playout import SAMPLE_RATE, CharacterSession, Clock, MediaTick, PlayoutOptions, SessionError
from characters_jax.protos_gen import characters_pb2 as pb

log = logging.getLogger("characters_jax.integrations.livekit_avatar")

RPC_CLEAR_BUFFER = "lk.clear_buffer"  # the names livekit-agents' data-stream I/O uses
AGENT_LEFT, ROOM_CLOSED, SESSION_ENDED = "agent left", "room closed", "session ended"
# The AudioSource's queue: each frame's samples wait behind at most this much audio, so the
# audio of a frame plays at most this long after the frame is captured.
AUDIO_QUEUE_MS = 50


class Publisher(Protocol):
    """Where the avatar's media goes: one call per frame period."""

    async def start(self, width: int, height: int) -> None: ...

    async def publish(self, tick: MediaTick) -> None: ...

    async def aclose(self) -> None: ...


class RoomPublisher:
    """Publishes an audio and a video track in the room: each tick's frame to a VideoSource
    and its samples to an AudioSource, back to back (one clock)."""

    def __init__(self, room: rtc.Room):
        self.room = room
        self.audio: rtc.AudioSource | None = None
        self.video: rtc.VideoSource | None = None

    async def start(self, width: int, height: int) -> None:
        self.audio = rtc.AudioSource(SAMPLE_RATE, 1, queue_size_ms=AUDIO_QUEUE_MS)
        self.video = rtc.VideoSource(width, height)
        lp = self.room.local_participant
        await lp.publish_track(rtc.LocalAudioTrack.create_audio_track("character_audio", self.audio),
                               rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE))
        await lp.publish_track(rtc.LocalVideoTrack.create_video_track("character_video", self.video),
                               rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_CAMERA))

    async def publish(self, tick: MediaTick) -> None:
        h, w, _ = tick.frame.shape
        self.video.capture_frame(rtc.VideoFrame(w, h, rtc.VideoBufferType.RGB24, tick.frame.tobytes()), timestamp_us=int(tick.time_s * 1e6))
        await self.audio.capture_frame(rtc.AudioFrame(tick.audio.tobytes(), SAMPLE_RATE, 1, len(tick.audio)))

    async def aclose(self) -> None:
        for source in (self.audio, self.video):
            if source is not None:
                await source.aclose()


class CharacterAvatar:
    def __init__(self, room: rtc.Room, *, target: str, image: bytes, agent_identity: str | None = None, prompt: str = "",
                 limits: pb.SessionLimits | None = None, credentials: ClientCredentials | None = None,
                 publisher: Publisher | None = None, options: PlayoutOptions = PlayoutOptions(), clock: Clock | None = None):
        """room: connected (the avatar's token); agent_identity: the agent whose audio it
        speaks (None: the first agent participant); target, image, prompt, limits,
        credentials: the worker session (as in CharacterSession)."""
        self.room, self.agent_identity = room, agent_identity
        self.session = CharacterSession(target, image, prompt=prompt, limits=limits, credentials=credentials, options=options,
                                        clock=clock, on_event=self._on_event)
        self.publisher = publisher or RoomPublisher(room)
        self.receiver: DataStreamAudioReceiver | None = None
        self.errors: list[str] = []  # what the avatar refused, in order
        self.ticks_published = 0
        self.opened = asyncio.Event()  # the worker's session is open
        self._done = asyncio.Event()
        self._reason = ""
        self._active: set[int] = set()  # worker segments pushed and not yet finished
        self._segment = 0  # the worker segment the agent's current stream feeds (0: none)
        self._next_segment = 1
        self._refusing = False  # the current stream's format was refused: skip to its end
        self._started_segments: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self) -> str:
        """Serves the room until it closes, the agent leaves or the worker session ends;
        returns which. Raises SessionError when the worker refuses the session or cannot be
        reached (nothing is left running)."""
        session = await self.session.open()
        self.opened.set()
        tasks: list[asyncio.Task] = []
        self.room.on("disconnected", self._on_disconnected)
        self.room.on("participant_disconnected", self._on_participant_disconnected)
        try:
            await self.publisher.start(session.width, session.height)
            if self.agent_identity is None:
                agent = await utils.wait_for_participant(self.room, kind=rtc.ParticipantKind.PARTICIPANT_KIND_AGENT)
                self.agent_identity = agent.identity
            self.receiver = DataStreamAudioReceiver(self.room, sender_identity=self.agent_identity, frame_size_ms=20)
            await self.receiver.start()
            self.receiver.on("clear_buffer", self._on_clear_buffer)
            self.room.local_participant.register_rpc_method(RPC_CLEAR_BUFFER, self._clear_buffer_rpc)
            tasks = [asyncio.create_task(self._read_audio()), asyncio.create_task(self._publish())]
            await self._done.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.room.off("disconnected", self._on_disconnected)
            self.room.off("participant_disconnected", self._on_participant_disconnected)
            if self.receiver is not None:
                await self.receiver.aclose()
            await self.session.aclose()
            await self.publisher.aclose()
            if self._reason == SESSION_ENDED and self.room.isconnected():
                await self.room.disconnect()  # the agent sees the avatar leave
        log.info("avatar ended", extra={"fields": {"reason": self._reason, "ticks": self.ticks_published}})
        return self._reason

    def _end(self, reason: str) -> None:
        if not self._done.is_set():
            self._reason = reason
            self._done.set()

    def _on_disconnected(self, *_args) -> None:
        self._end(ROOM_CLOSED)

    def _on_participant_disconnected(self, participant) -> None:
        if participant.identity == self.agent_identity:
            self._end(AGENT_LEFT)

    # -- the agent's audio -------------------------------------------------------------
    async def _read_audio(self) -> None:
        async for item in self.receiver:
            if isinstance(item, AudioSegmentEnd):
                if self._segment:
                    self.session.end_segment()
                self._segment, self._refusing = 0, False
                continue
            if self._refusing:
                continue
            if item.sample_rate != SAMPLE_RATE or item.num_channels != 1:
                self._refusing = True
                self.errors.append(f"audio at {item.sample_rate} Hz with {item.num_channels} channel(s): the avatar takes "
                                   f"{SAMPLE_RATE} Hz mono (DataStreamAudioOutput(sample_rate={SAMPLE_RATE}))")
                log.error("audio refused", extra={"fields": {"error": self.errors[-1]}})
                self.receiver.notify_playback_finished(playback_position=0.0, interrupted=True)
                continue
            if not self._segment:
                self._segment = self._next_segment
                self._next_segment += 1
                self._active.add(self._segment)
            self.session.push_audio(np.frombuffer(item.data, np.int16))
        self._end(SESSION_ENDED if self.session.ended else ROOM_CLOSED)

    def _clear_buffer_rpc(self, data: rtc.RpcInvocationData) -> str:
        if data.caller_identity == self.agent_identity and not self._active:
            raise rtc.RpcError(rtc.RpcError.ErrorCode.APPLICATION_ERROR, "no speech segment is playing")
        return DataStreamAudioReceiver._clear_buffer_rpc_handler(data)

    def _on_clear_buffer(self) -> None:
        """The agent cleared (barge-in): the worker cuts the segment and answers
        PLAYBACK_FINISHED (interrupted), which goes back as lk.playback_finished."""
        self.session.interrupt()
        self._segment = 0

    # -- publishing --------------------------------------------------------------------
    async def _publish(self) -> None:
        async for tick in self.session.ticks():
            await self.publisher.publish(tick)
            self.ticks_published += 1
            if tick.segment and tick.segment not in self._started_segments:
                self._started_segments.add(tick.segment)
                self.receiver.notify_playback_started()
        self._end(SESSION_ENDED)

    def _on_event(self, event: pb.SpeechEvent) -> None:
        if event.kind == pb.SpeechEvent.PLAYBACK_FINISHED and event.segment in self._active:
            self._active.discard(event.segment)
            self.receiver.notify_playback_finished(playback_position=event.segment_samples / SAMPLE_RATE, interrupted=event.interrupted)


__all__ = ["AGENT_LEFT", "ROOM_CLOSED", "SESSION_ENDED", "CharacterAvatar", "Publisher", "RoomPublisher", "SessionError"]
