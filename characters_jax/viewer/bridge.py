"""One page's call: its peer connection, its worker conversation, and the media between them.

    microphone track (48 kHz Opus) --> MicResampler (16 kHz mono s16le) --> WorkerLink --> worker
    worker --VideoChunk (4 frames + their audio)--> TrackPlayoutClock (jitter buffer, one clock)
           --> CharacterVideoTrack (a frame every 1/24 s) + CharacterAudioTrack (20 ms packets)
    data channel "events": session state, speech events, per-chunk timing and per-frame audio
    peaks, playout figures -> the page; hangup and interrupt <- the page

A page that goes away is noticed when its microphone stops arriving (`mic_timeout_s`), its
data channel closes or its connection fails; the worker's conversation is ended first, so the
worker is free at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from characters_jax.client.credentials import ClientCredentials
from characters_jax.viewer.ice import LOOPBACK, OfferError, gather_on, loopback_offer
from characters_jax.viewer.link import ChunkEvent, SpeechNote, WorkerLink
from characters_jax.viewer.media import CharacterAudioTrack, CharacterVideoTrack, MicResampler, TrackPlayoutClock, Upsampler

log = logging.getLogger("characters_jax.viewer.bridge")


@dataclasses.dataclass(frozen=True)
class BridgeOptions:
    prebuffer_chunks: int = 2  # chunks in the jitter buffer before playback starts
    audio_rate: int = 48000  # the outgoing voice track's rate (a multiple of 16 kHz)
    mic_timeout_s: float = 0.5  # no microphone audio for this long: the page is gone
    connect_timeout_s: float = 10.0  # from the answer to the first microphone packet
    stats_period_s: float = 0.5  # playout figures to the page
    credentials: ClientCredentials | None = None  # TLS and a bearer token for the worker (None: plaintext)

    def __post_init__(self):
        if self.audio_rate <= 0 or self.audio_rate % 16000:
            raise ValueError(f"audio_rate: the voice track's rate must be a multiple of 16000 Hz, got {self.audio_rate}")
        if self.prebuffer_chunks < 1:
            raise ValueError(f"prebuffer_chunks: at least 1, got {self.prebuffer_chunks}")


def frame_peaks(audio: np.ndarray, first_sample: int, first_frame: int, frames: int, sample_rate: int, fps: int) -> list[float]:
    """Peak |amplitude| (0..1) of the audio each frame carries: frame k carries samples
    [floor(k * rate / fps), floor((k + 1) * rate / fps))."""
    out = []
    for k in range(first_frame, first_frame + frames):
        lo, hi = k * sample_rate // fps - first_sample, (k + 1) * sample_rate // fps - first_sample
        seg = audio[max(lo, 0) : max(hi, 0)]
        out.append(round(float(np.abs(seg.astype(np.int32)).max()) / 32768, 4) if seg.size else 0.0)
    return out


class ViewerBridge:
    """One page: its peer connection, its worker session, and the media between them."""

    def __init__(self, worker_address: str, options: BridgeOptions, on_closed=None):
        self.options = options
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # no STUN: nothing leaves the host
        self.link = WorkerLink(worker_address, options.credentials)
        self.playout = None
        self.channel = None
        self.on_closed = on_closed
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._tasks: list[asyncio.Task] = []
        self._pending: list[dict] = []  # messages for the page before its data channel is open
        self._mic = None
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_connection_state)

    # -- set-up ------------------------------------------------------------------------------
    async def answer(self, offer_sdp: str, image: bytes, prompt: str) -> str:
        """Opens the worker session and answers the page's offer (the two at once). Raises
        OfferError or LinkError."""
        t0 = time.monotonic()
        sdp = loopback_offer(offer_sdp)
        o = self.options
        marks = {}

        async def open_session():
            s = await self.link.open(image, prompt)
            marks["session_ms"] = round((time.monotonic() - t0) * 1e3, 1)
            return s

        async def take_offer():
            try:
                await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            except Exception as err:  # aiortc's SDP parser: ValueError, KeyError, ...
                raise OfferError(f"the offer's SDP cannot be used: {type(err).__name__}: {err}") from None
            kinds = sorted(t.kind for t in self.pc.getTransceivers())
            if kinds != ["audio", "video"]:
                raise OfferError(f"the offer must have one audio (microphone up, voice down) and one video transceiver, got {kinds}")
            marks["offer_ms"] = round((time.monotonic() - t0) * 1e3, 1)

        opening = asyncio.ensure_future(open_session())
        try:
            await take_offer()
        finally:
            session = await opening  # a LinkError wins over an OfferError: the page is told about the worker first
        self.playout = TrackPlayoutClock(session.fps, o.audio_rate, o.prebuffer_chunks * session.frames_per_step, session.frames_per_step)
        self.pc.addTrack(CharacterVideoTrack(self.playout, on_frame=self._on_frame_sent))
        self.pc.addTrack(CharacterAudioTrack(self.playout))
        await gather_on(self.pc, LOOPBACK)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        marks["answer_ms"] = round((time.monotonic() - t0) * 1e3, 1)
        self._spawn(self._pump_worker())
        self._spawn(self._pump_stats())
        self._spawn(self._watch_connect())
        self.send({"type": "session", "session_id": session.session_id, "width": session.width, "height": session.height, "fps": session.fps,
                   "frames_per_step": session.frames_per_step, "prebuffer_frames": self.playout.prebuffer, "worker_id": session.worker_id,
                   "max_duration_s": session.max_duration_s, "idle_timeout_s": session.idle_timeout_s, "gateway_ms": marks})
        self.send({"type": "state", "state": "RUNNING"})
        return self.pc.localDescription.sdp

    def _spawn(self, coro) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    def _on_datachannel(self, channel) -> None:
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("close", lambda: self._spawn(self.close("the page closed its data channel")))
        for msg in self._pending:
            self.send(msg)
        self._pending.clear()

    def _on_message(self, message) -> None:
        try:
            msg = json.loads(message)
        except (TypeError, ValueError):
            return
        if msg.get("type") == "hangup":
            self._spawn(self.close("hung up by the page"))
        elif msg.get("type") == "interrupt" and self.playout is not None:
            self._spawn(self._interrupt())

    async def _interrupt(self) -> None:
        """Barge-in: the worker drops what it has queued, the jitter buffer what it holds."""
        p = self.playout
        self.link.interrupt(p.frames_played, p.underruns)
        await p.flush()
        self.send({"type": "interrupting", "frames_played": p.frames_played})

    def _on_track(self, track) -> None:
        if track.kind == "audio" and self._mic is None:
            self._mic = track
            self._spawn(self._pump_mic(track))

    def _on_connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._spawn(self.close(f"peer connection {self.pc.connectionState}"))

    def send(self, msg: dict) -> None:
        """A JSON message to the page (queued until its data channel is open)."""
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(msg))
        elif self.channel is None:
            self._pending.append(msg)

    # -- pumps -------------------------------------------------------------------------------
    async def _watch_connect(self) -> None:
        """The page must start sending its microphone within connect_timeout_s of the answer."""
        await asyncio.sleep(self.options.connect_timeout_s)
        if self._mic is None:
            await self.close(f"no microphone track within {self.options.connect_timeout_s:g} s of the answer")

    async def _pump_mic(self, track) -> None:
        resample = MicResampler(16000)
        timeout = self.options.connect_timeout_s
        try:
            while not self.closed.is_set():
                try:
                    frame = await asyncio.wait_for(track.recv(), timeout)
                except asyncio.TimeoutError:
                    await self.close(f"the page sent no microphone audio for {timeout:g} s")
                    return
                timeout = self.options.mic_timeout_s
                self.link.send_audio(resample(frame))
        except MediaStreamError:
            await self.close("the page's microphone track ended")

    async def _pump_worker(self) -> None:
        up = Upsampler(self.options.audio_rate // 16000)
        session = self.link.session
        final = None
        async for ev in self.link.events():
            if isinstance(ev, ChunkEvent):
                first = await self.playout.push(ev.frames, up(ev.audio))
                self.send({"type": "chunk", "step": ev.step, "first_frame": first, "timeline_frame": ev.first_frame, "frames": len(ev.frames),
                           "peaks": frame_peaks(ev.audio, ev.audio_first_sample, ev.first_frame, len(ev.frames), 16000, session.fps),
                           "speech_samples": ev.speech_samples, "diffusion_ms": round(ev.diffusion_ms, 2), "decode_ms": round(ev.decode_ms, 2),
                           "period_ms": round(ev.period_ms, 2), "arrival_latency_s": None if ev.arrival_latency_s is None else round(ev.arrival_latency_s, 4)})
            elif isinstance(ev, SpeechNote):
                self.send({"type": "speech", "kind": ev.kind, "segment": ev.segment, "position_s": round(ev.position_samples / 16000, 3),
                           "interrupted": ev.interrupted, "played_s": round(ev.played_samples / 16000, 3)})
            else:
                final = ev
                self.send({"type": "state", "state": ev.state, "message": ev.message, "end_reason": ev.end_reason})
        await self.playout.end()
        if final is not None and final.state == "COMPLETED":
            await self.playout.drained.wait()  # the page sees the session to its last frame
        await self.close(f"session {final.state} ({final.end_reason}): {final.message}" if final else "the worker ended the stream")

    async def _pump_stats(self) -> None:
        while not self.closed.is_set():
            p = self.playout
            self.send({"type": "playout", "frames_played": p.frames_played, "underruns": p.underruns, "buffered_frames": p.buffered_frames,
                       "stalled_s": round(p.stalled_s, 3), "catchups": p.catchups, "mic_samples": self.link.sent_samples})
            await asyncio.sleep(self.options.stats_period_s)

    def _on_frame_sent(self, index: int) -> None:
        self.link.report_playout(index + 1, self.playout.underruns)

    # -- teardown ----------------------------------------------------------------------------
    async def close(self, reason: str) -> None:
        """Cancels the worker session first (so the worker is free at once), then the rest."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.close_reason = reason
        log.info("viewer closed", extra={"fields": {"reason": reason}})
        self.send({"type": "closed", "reason": reason})
        await self.link.close()
        if self.playout is not None:
            await self.playout.end()
        await self.pc.close()
        current = asyncio.current_task()
        for t in self._tasks:
            if t is not current:
                t.cancel()
        if self.on_closed:
            self.on_closed(self)
