"""A Pipecat agent over Pipecat's own WebRTC transport (SmallWebRTCTransport, aiortc), run in
the Pipecat client environment (.venv-pipecat) by tests/test_integrations_pipecat_webrtc.py.

    python tests/pipecat_webrtc_agent.py WORKER_ADDRESS WIDTHxHEIGHT PAGE_HTML

Serves on 127.0.0.1 (a free port): `GET /` the page, `POST /api/offer` the SmallWebRTC
signalling (`{sdp, type}` -> `{sdp, type, pc_id}`, what Pipecat's request handler answers;
one peer, a second offer gets 409). ICE stays on loopback: aiortc gathers on 127.0.0.1
alone and the offer keeps only its loopback UDP candidates (the viewer's rule,
characters_jax/viewer/ice.py). Each offer's connection gets the pipeline

    transport.input() -> CharactersVideoService -> transport.output()

(audio out, video out at the worker's size and 24 fps), with recorders around the service.
The TTS is scripted (tests/pipecat_pipeline.py's `say`: 24 kHz mono in 20 ms frames at
real-time pace, seeded jitter). Commands on stdin, one a line:

    speak SECONDS   an utterance
    interrupt       the TTS stops and an InterruptionFrame is queued
    end             an EndFrame; the figures follow and the process exits

Events on stdout, one JSON object a line, times in seconds since the epoch (the clock the
page reads as performance.timeOrigin + performance.now()): ready {url}, connected {t},
speaking {t}, stopped {t} (a TTSStoppedFrame left the transport: the segment played),
interrupted {t}, done {the figures}.
"""

import asyncio
import importlib.util
import json
import pathlib
import sys
import time

import aioice.ice
from aiohttp import web
from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.workers.runner import WorkerRunner
from pipecat_pipeline import SEED, Recorder, png, say

from characters_jax.integrations.pipecat import CharactersVideoService

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def _viewer_ice():
    """characters_jax/viewer/ice.py (dependency-free; the viewer package is not in the client environment)."""
    spec = importlib.util.spec_from_file_location("viewer_ice", ROOT / "characters_jax" / "viewer" / "ice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ice = _viewer_ice()
# aiortc (1.16) has no setting for its host addresses: its gatherer asks aioice for every
# interface but 127.0.0.1. This process answers on loopback alone.
aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [LOOPBACK]

EPOCH = time.time() - time.monotonic()  # monotonic -> seconds since the epoch


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class OutputRecorder(Recorder):
    """After transport.output(): records what the transport let through and emits `stopped`
    for each TTSStoppedFrame."""

    def __init__(self):
        super().__init__(FrameDirection.DOWNSTREAM)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        if direction == FrameDirection.DOWNSTREAM and isinstance(frame, TTSStoppedFrame):
            emit("stopped", t=time.time())
        await super().process_frame(frame, direction)


def per_second(times: list[float]) -> float | None:
    """Events per second over their span (None for fewer than two)."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


class Agent:
    def __init__(self, worker_address: str, size: tuple[int, int], page: pathlib.Path):
        self.worker_address, self.size, self.page = worker_address, size, page
        self.video: CharactersVideoService | None = None
        self.worker: PipelineWorker | None = None
        self.run_task: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self.up = Recorder(FrameDirection.UPSTREAM)  # errors reaching the pipeline's head
        self.tts_in = Recorder(FrameDirection.DOWNSTREAM)  # what reaches the service
        self.service_out = Recorder(FrameDirection.DOWNSTREAM)  # what the service pushes
        self.written = OutputRecorder()  # what the output transport has let through
        self.drawn: list[float] = []  # monotonic times the output transport handed an image to aiortc's video track
        self.talking: asyncio.Task | None = None
        self.interrupted_at: float | None = None  # monotonic
        self.transport: SmallWebRTCTransport | None = None
        self.backlog_at_interrupt: dict = {}

    async def offer(self, request: web.Request) -> web.Response:
        if self.video is not None:
            return web.json_response({"error": "this agent serves one peer"}, status=409)
        body = await request.json()
        try:
            sdp = ice.loopback_offer(body["sdp"])
        except ice.OfferError as err:
            return web.json_response({"error": str(err)}, status=400)
        connection = SmallWebRTCConnection(ice_servers=[])
        await connection.initialize(sdp=sdp, type=body["type"])
        width, height = self.size
        transport = SmallWebRTCTransport(connection, TransportParams(audio_out_enabled=True, video_out_enabled=True, video_out_width=width,
                                                                    video_out_height=height, video_out_framerate=24,
                                                                    audio_out_end_silence_secs=0))

        self.transport = transport
        output = transport.output()
        write_video_frame = output.write_video_frame

        async def counted(frame: OutputImageRawFrame) -> bool:
            self.drawn.append(time.monotonic())
            return await write_video_frame(frame)

        output.write_video_frame = counted

        @transport.event_handler("on_client_connected")
        async def _connected(_transport, _client):
            self.connected.set()
            emit("connected", t=time.time())

        self.video = CharactersVideoService(target=self.worker_address, image=png())
        pipeline = Pipeline([self.up, transport.input(), self.tts_in, self.video, self.service_out, output, self.written])
        self.worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False, params=PipelineParams())
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        self.run_task = asyncio.create_task(runner.run())
        return web.json_response(connection.get_answer())

    async def command(self, line: str) -> bool:
        """Runs one command; False after `end`."""
        words = line.split()
        if not words:
            return True
        if words[0] == "speak":
            self.talking = asyncio.create_task(say(self.worker, float(words[1]), SEED + len(self.utterances())))
            emit("speaking", t=time.time())
        elif words[0] == "interrupt":
            if self.talking is not None:
                self.talking.cancel()  # the TTS stops where the user barges in
            self.interrupted_at = time.monotonic()
            self.backlog_at_interrupt = self.track_backlog()
            await self.worker.queue_frame(InterruptionFrame())
            emit("interrupted", t=EPOCH + self.interrupted_at)
        elif words[0] == "end":
            if self.worker is not None:
                await self.worker.queue_frame(EndFrame())
            return False
        else:
            emit("error", message=f"unknown command {line!r}")
        return True

    def track_backlog(self) -> dict:
        """What waits in aiortc's output tracks for their senders (Pipecat's queues there, which
        an interruption does not clear): video frames, audio seconds."""
        client = self.transport._client
        video, audio = client._video_output_track, client._audio_output_track
        return {"video_frames": None if video is None else video._video_buffer.qsize(),
                "audio_s": None if audio is None else len(audio._chunk_queue) * 0.01}

    def utterances(self) -> list[float]:
        """Monotonic times of each utterance's first TTS audio at the service."""
        firsts, started = [], False
        for t, f in self.tts_in.frames:
            if isinstance(f, TTSStartedFrame):
                started = True
            elif isinstance(f, TTSAudioRawFrame) and started:
                firsts.append(t)
                started = False
        return firsts

    def interrupt_figures(self) -> dict:
        """Where the InterruptionFrame was when (seconds after the command), and the images the
        service pushed after it: the last frame held (the same picture) until the worker's
        first frame after the interrupt."""
        t_int = self.interrupted_at
        if t_int is None:
            return {}
        at_service = next((t for t, f in self.service_out.frames if isinstance(f, InterruptionFrame)), None)
        if at_service is None:
            return {"at_service_s": None}
        at_output = next((t for t, f in self.written.frames if isinstance(f, InterruptionFrame)), None)
        before = [f for t, f in self.service_out.frames if t < at_service and isinstance(f, OutputImageRawFrame)]
        after = [(t, f) for t, f in self.service_out.frames if t >= at_service and isinstance(f, OutputImageRawFrame)]
        held = 0
        while held < len(after) and after[held][1].image == before[-1].image:
            held += 1
        return {"at_service_s": at_service - t_int, "at_output_s": None if at_output is None else at_output - t_int, "held_images": held,
                "first_fresh_image_s": after[held][0] - t_int if held < len(after) else None, "track_backlog": self.backlog_at_interrupt}

    def figures(self) -> dict:
        if self.video is None:
            return {"errors": [], "connected": False}
        return {
            "interrupt": self.interrupt_figures(),
            "errors": [f.error for _, f in self.up.frames if isinstance(f, ErrorFrame)],
            "first_tts_audio": [EPOCH + t for t in self.utterances()],
            "service_latencies_s": self.video.latencies_s,
            "images_out": sum(isinstance(f, OutputImageRawFrame) for _, f in self.service_out.frames),
            "service_fps": per_second([t for t, f in self.service_out.frames if isinstance(f, OutputImageRawFrame)]),
            "images_drawn": len(self.drawn),
            "drawn_fps": per_second(self.drawn),
            "images_written": sum(isinstance(f, OutputImageRawFrame) for _, f in self.written.frames),
            "audio_written_s": sum(len(f.audio) / 2 / f.sample_rate for _, f in self.written.frames if isinstance(f, TTSAudioRawFrame)),
            "stopped": sum(isinstance(f, TTSStoppedFrame) for _, f in self.written.frames),
            "session_final": None if self.video.session.final is None else int(self.video.session.final.end_reason),
        }


async def main(worker_address: str, size: str, page: str) -> None:
    logger.remove()
    logger.add(sys.stderr, level="INFO")
    width, height = (int(x) for x in size.split("x"))
    agent = Agent(worker_address, (width, height), pathlib.Path(page))
    app = web.Application()
    app.router.add_get("/", lambda _r: web.FileResponse(agent.page))
    app.router.add_post("/api/offer", agent.offer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    emit("ready", url=f"http://{LOOPBACK}:{port}/")
    while await agent.command(await asyncio.to_thread(sys.stdin.readline)):
        pass
    if agent.run_task is not None:
        await asyncio.wait_for(agent.run_task, 30)
    await runner.cleanup()
    figures = agent.figures()
    figures["tasks_left"] = sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())
    emit("done", **figures)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
