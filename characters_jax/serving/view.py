"""`characters-jax view`: the character live in a web page, over WebRTC, on this machine.

A small web gateway (aiohttp + aiortc) on 127.0.0.1 serves one page (`web/`) and bridges it
to a generator worker as one more gRPC client (`view_link.WorkerLink`):

    page --offer (SDP, reference image)--> gateway --CreateSession--> worker
    microphone track (48 kHz Opus) --> MicResampler (16 kHz mono s16le) --Converse--> worker
    worker --VideoChunk (4 frames + their audio)--> Playout (jitter buffer, one clock)
           --> CharacterVideoTrack (a frame every 1/24 s) + CharacterAudioTrack (20 ms packets)
    data channel "events": session state, per-chunk timing, playout figures -> the page

The worker never sees WebRTC. Loopback only: the gateway gathers its ICE candidates on
127.0.0.1 alone (aiortc's host gathering skips loopback and would offer every other
interface; it is given the loopback address explicitly) and keeps only the loopback
candidates of the browser's offer, so no media packet is addressed off this host. Browsers
do not offer loopback candidates by default: Chromium needs --allow-loopback-in-peer-connection,
Firefox media.peerconnection.ice.loopback = true; an offer without one is refused with that
message. A page that goes away is noticed when its microphone stops arriving (`mic_timeout_s`)
or its connection closes; the worker's session is cancelled at once.

Without --server, `view` starts a worker for --config itself (like `demo`) and stops it on exit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from characters_jax.serving.images import ImageError, load_reference_image
from characters_jax.serving.view_link import ChunkEvent, LinkError, SpeechNote, WorkerLink
from characters_jax.serving.view_media import CharacterAudioTrack, CharacterVideoTrack, MicResampler, Playout, Upsampler

log = logging.getLogger("characters_jax.serving.view")

WEB_DIR = pathlib.Path(__file__).resolve().parent / "web"
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
LOOPBACK = "127.0.0.1"
MAX_OFFER_BYTES = 8 << 20  # an SDP plus a base64 reference image of up to 4 MiB


class OfferError(ValueError):
    """The page's offer cannot be answered; the message is shown in the page."""


@dataclasses.dataclass(frozen=True)
class BridgeOptions:
    prebuffer_chunks: int = 2  # chunks in the jitter buffer before playback starts
    audio_rate: int = 48000  # the outgoing voice track's rate (a multiple of 16 kHz)
    mic_timeout_s: float = 0.5  # no microphone audio for this long: the page is gone
    connect_timeout_s: float = 10.0  # from the answer to the first microphone packet
    stats_period_s: float = 0.5  # playout figures to the page


# -- ICE on loopback ---------------------------------------------------------------------------
def _candidate_transport_address(line: str) -> tuple[str, str]:
    """`a=candidate:foundation component TRANSPORT priority ADDRESS port typ ...` -> (TRANSPORT, ADDRESS)."""
    parts = line.split()
    return (parts[2].lower(), parts[4]) if len(parts) > 5 else ("", "")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # an mDNS name (*.local) or garbage
        return False


def loopback_offer(sdp: str) -> str:
    """The offer with only its loopback UDP ICE candidates. Raises OfferError if none is left."""
    lines = sdp.replace("\r\n", "\n").split("\n")
    kept, dropped, loop = [], 0, 0
    for line in lines:
        if line.startswith("a=candidate:"):
            transport, address = _candidate_transport_address(line)
            if transport != "udp" or not _is_loopback(address):
                dropped += 1
                continue
            loop += 1
        kept.append(line)
    if not loop:
        raise OfferError(
            f"the browser offered no loopback ICE candidate ({dropped} other candidates); this viewer connects over "
            "127.0.0.1 only. Chromium: start it with --allow-loopback-in-peer-connection; Firefox: set "
            "media.peerconnection.ice.loopback to true in about:config")
    return "\r\n".join(kept)


def _ice_gatherers(pc) -> list:
    seen: dict[int, object] = {}
    for t in pc.getTransceivers():
        g = t.receiver.transport.transport.iceGatherer
        seen[id(g)] = g
    if pc.sctp is not None:
        g = pc.sctp.transport.transport.iceGatherer
        seen[id(g)] = g
    return list(seen.values())


async def gather_on(pc, host: str = LOOPBACK) -> None:
    """Gathers the peer connection's host candidates on `host` alone, before its answer is made.

    aiortc (1.16) offers no setting for the host addresses: its gatherer asks aioice for every
    interface except 127.0.0.1. Here each aioice connection gathers on `host` and is marked as
    gathered, so aiortc's own gathering (inside setLocalDescription) finds nothing to do."""
    for g in _ice_gatherers(pc):
        conn = g._connection  # aioice.Connection (aioice 0.13)
        if conn._local_candidates_start:
            continue
        conn._local_candidates_start = True
        for component in conn._components:
            conn._local_candidates += await conn.get_component_candidates(component=component, addresses=[host])
        conn._local_candidates_end = True


# -- one page's session -------------------------------------------------------------------------
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
        self.link = WorkerLink(worker_address)
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
        if o.audio_rate % 16000:
            raise OfferError(f"the voice track's rate must be a multiple of 16000 Hz, got {o.audio_rate}")
        marks = {}

        async def open_session():
            s = await self.link.open(image, prompt)
            marks["session_ms"] = round((time.monotonic() - t0) * 1e3, 1)
            return s

        async def take_offer():
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            kinds = sorted(t.kind for t in self.pc.getTransceivers())
            if kinds != ["audio", "video"]:
                raise OfferError(f"the offer must have one audio (microphone up, voice down) and one video transceiver, got {kinds}")
            marks["offer_ms"] = round((time.monotonic() - t0) * 1e3, 1)

        opening = asyncio.ensure_future(open_session())
        try:
            await take_offer()
        finally:
            session = await opening  # a LinkError wins over an OfferError: the page is told about the worker first
        self.playout = Playout(session.fps, o.audio_rate, o.prebuffer_chunks * session.frames_per_step, session.frames_per_step)
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


# -- the worker behind the gateway --------------------------------------------------------------
class LocalWorker:
    """`characters-jax serve` started by `view`: a subprocess on a free port, its log in a file."""

    def __init__(self, config: str, checkpoint: str | None, log_path: pathlib.Path):
        from characters_jax.serving.server import child_env

        self._tmp = tempfile.TemporaryDirectory(prefix="characters-view-")
        self.state_file = pathlib.Path(self._tmp.name) / "worker.json"
        self.log_path = log_path
        argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", config, "--host", LOOPBACK, "--port", "0",
                "--metrics-port", "0", "--state-file", str(self.state_file)]
        if checkpoint:
            argv += ["--checkpoint", checkpoint]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=child_env(1), stdout=self._log, stderr=subprocess.STDOUT)
        self.state, self.address, self.message = "starting", None, "compiling the model"

    async def wait_ready(self, timeout_s: float) -> bool:
        """Polls the worker's state file (written once it is ready). Returns whether it became ready."""
        t0 = time.monotonic()
        while not self.state_file.exists() or "startup_s" not in self.state_file.read_text():
            if self.proc.poll() is not None:
                self.state, self.message = "failed", f"the worker exited with code {self.proc.returncode}; see {self.log_path}"
                return False
            if time.monotonic() - t0 > timeout_s:
                self.state, self.message = "failed", f"the worker was not ready after {timeout_s:g} s; see {self.log_path}"
                return False
            await asyncio.sleep(0.2)
        st = json.loads(self.state_file.read_text())
        self.state, self.address, self.message = "ready", f"{LOOPBACK}:{st['port']}", f"ready in {st['startup_s']:.1f} s"
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()


@dataclasses.dataclass
class RemoteWorker:
    """A worker that is already running (`view --server`)."""

    address: str
    state: str = "ready"
    message: str = ""


# -- the web gateway ----------------------------------------------------------------------------
_LINK_HTTP_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 409, "FAILED_PRECONDITION": 409, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}


class Gateway:
    """The aiohttp application: the page, its files, /status, /image and /offer."""

    def __init__(self, worker, options: BridgeOptions, reference_image: bytes, prompt: str):
        self.worker, self.options = worker, options
        self.reference_image, self.prompt = reference_image, prompt
        self.bridge: ViewerBridge | None = None

    def app(self):
        app = web.Application(client_max_size=MAX_OFFER_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/reference", self._reference)
        app.router.add_get("/status", self._status)
        app.router.add_post("/image", self._image)
        app.router.add_post("/offer", self._offer)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _index(self, request):
        return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-store"})

    async def _static(self, request):
        name = request.match_info["name"]
        path = WEB_DIR / name
        if "/" in name or name.startswith(".") or not path.is_file() or path.suffix not in STATIC_TYPES:
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Content-Type": STATIC_TYPES[path.suffix], "Cache-Control": "no-store"})

    async def _reference(self, request):
        return web.Response(body=self.reference_image, content_type="image/png")

    async def _status(self, request):
        w = self.worker
        return web.json_response({"worker": w.state, "address": w.address, "message": w.message, "busy": self.bridge is not None})

    async def _image(self, request):
        """Checks an uploaded reference image as the worker will (decode, size limits)."""
        data = await request.read()
        try:
            load_reference_image(data, 64, 64)
        except ImageError as err:
            return web.json_response({"error": str(err)}, status=400)
        return web.json_response({"ok": True, "bytes": len(data)})

    async def _offer(self, request):
        try:
            body = await request.json()
            sdp = body["sdp"]
            image = base64.b64decode(body["image"], validate=True) if body.get("image") else self.reference_image
        except (ValueError, KeyError, TypeError) as err:
            return web.json_response({"error": f"the offer must be JSON with 'sdp' (and optionally 'image', base64): {err}"}, status=400)
        if self.worker.state != "ready":
            return web.json_response({"error": f"the worker is not ready: {self.worker.message}"}, status=503)
        if self.bridge is not None:
            return web.json_response({"error": "the character is already in a call with another page (one session per worker)"}, status=409)
        bridge = ViewerBridge(self.worker.address, self.options, on_closed=self._on_bridge_closed)
        self.bridge = bridge
        try:
            answer = await bridge.answer(sdp, image, body.get("prompt", self.prompt))
        except OfferError as err:
            await bridge.close(str(err))
            return web.json_response({"error": str(err)}, status=400)
        except LinkError as err:
            await bridge.close(str(err))
            return web.json_response({"error": err.message, "code": err.code}, status=_LINK_HTTP_STATUS.get(err.code, 502))
        return web.json_response({"sdp": answer, "type": "answer"})

    def _on_bridge_closed(self, bridge) -> None:
        if self.bridge is bridge:
            self.bridge = None

    async def _on_shutdown(self, app) -> None:
        if self.bridge is not None:
            await self.bridge.close("the gateway is shutting down")


async def serve_gateway(gateway: Gateway, port: int, started=None) -> None:
    """Serves until cancelled. started(port) is called once the gateway listens."""
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, port)
    await site.start()
    bound = runner.addresses[0][1]
    try:
        if started:
            started(bound)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _write_state(path: str | None, data: dict) -> None:
    if path:
        tmp = pathlib.Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


async def _run_view(args) -> int:
    from characters_jax.serving import assets

    image = pathlib.Path(args.image or assets.PORTRAIT).read_bytes()
    options = BridgeOptions(prebuffer_chunks=args.prebuffer_chunks)
    local = None
    if args.server:
        worker = RemoteWorker(args.server)
    else:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        local = worker = LocalWorker(args.config, args.checkpoint, out / "view_worker.log")
    gateway = Gateway(worker, options, image, args.prompt)
    state: dict = {"pid": os.getpid()}

    def publish() -> None:
        _write_state(args.state_file, {**state, "worker": worker.state, "worker_address": worker.address, "worker_message": worker.message})

    def started(port: int) -> None:
        state.update(port=port, url=f"http://{LOOPBACK}:{port}/")
        publish()
        print(f"view: open {state['url']} (Chromium: --allow-loopback-in-peer-connection; Firefox: "
              f"media.peerconnection.ice.loopback = true); worker: {worker.address or 'starting, config ' + args.config}", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = asyncio.ensure_future(serve_gateway(gateway, args.port, started))
    code = 0
    try:
        if local is not None:
            ready = asyncio.ensure_future(local.wait_ready(args.startup_timeout))
            await asyncio.wait([ready, server, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                publish()
                print(f"view: worker {worker.state}: {worker.message}", flush=True)
                code = 0 if ready.result() else 1
        if code == 0 and not server.done():
            await asyncio.wait([server, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if server.done() and server.exception() is not None:
            print(f"characters-jax view: {server.exception()}", file=sys.stderr)
            code = 1
    finally:
        if gateway.bridge is not None:
            await gateway.bridge.close("the gateway is shutting down")
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await server
        if local is not None:
            local.stop()
    return code


def view_command(args) -> int:
    from characters_jax.serving.logs import setup_logging

    setup_logging("view", args.log_level)
    return asyncio.run(_run_view(args))
