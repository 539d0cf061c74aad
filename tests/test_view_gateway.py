"""The gateway end to end without a browser: a page played by aiortc in this process (a
microphone track at real-time pace, a video and a voice track received), the gateway of
`characters-jax view`, and a worker whose model is the fakes' (frames whose red channel is
the generator step), all on 127.0.0.1. Checks the pacing and order of the frames, the voice,
the data channel, a page that goes silent freeing the worker, and bad offers."""

import asyncio
import base64
import fractions
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the viewer needs aiohttp and aiortc (see pyproject's view extra)")
pytest.importorskip("aiortc", reason="the viewer needs aiortc (see pyproject's view extra)")

from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription  # noqa: E402

from characters_jax.demo import assets  # noqa: E402
from characters_jax.demo.fakes import FakeWorker  # noqa: E402
from characters_jax.viewer.gateway import BridgeOptions, Gateway, RemoteWorker, serve_gateway  # noqa: E402
from characters_jax.viewer.ice import gather_on  # noqa: E402
from characters_jax.serving.worker import WorkerOptions  # noqa: E402
from test_view_browser import worker_serving  # noqa: E402

SEED = 7


class Microphone(MediaStreamTrack):
    """48 kHz mono s16 in 20 ms packets at real-time pace, like a browser's; `mute()` stops
    it sending anything (a page that went away without a word)."""

    kind = "audio"

    def __init__(self, seed: int):
        super().__init__()
        self.rng = np.random.default_rng(seed)
        self.sent = 0
        self.t0 = None
        self.muted = asyncio.Event()

    async def recv(self):
        import av

        if self.t0 is None:
            self.t0 = time.monotonic()
        wait = self.t0 + self.sent / 48000 - time.monotonic()
        if wait > 0:  # the microphone's own clock
            await asyncio.sleep(wait)
        if self.muted.is_set():
            await asyncio.Event().wait()
        pcm = (self.rng.standard_normal(960) * 3000).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.sent, fractions.Fraction(1, 48000)
        self.sent += 960
        return frame


async def _start_gateway(address: str):
    gateway = Gateway(RemoteWorker(address), BridgeOptions(), assets.PORTRAIT.read_bytes(), "hello")
    port = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve_gateway(gateway, 0, port.set_result))
    return gateway, server, f"http://127.0.0.1:{await asyncio.wait_for(port, 10)}"


async def _offer(http, url: str, pc, **extra) -> tuple[int, dict]:
    """POSTs the page's offer as the page does: JSON, with the page's Origin."""
    await gather_on(pc)
    await pc.setLocalDescription(await pc.createOffer())
    async with http.post(url + "/offer", json={"sdp": pc.localDescription.sdp, "type": "offer", **extra}, headers={"Origin": url}) as r:
        return r.status, await r.json()


def _page():
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    mic = Microphone(SEED)
    pc.addTransceiver(mic, direction="sendrecv")
    pc.addTransceiver("video", direction="recvonly")
    return pc, mic, pc.createDataChannel("events")


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker("small", WorkerOptions(idle_timeout_s=30))
    yield w
    w.close()


def test_a_page_gets_paced_frames_in_order_with_their_voice_and_going_silent_frees_the_worker(worker):
    async def run():
        gateway, server, url = await _start_gateway(worker.address)
        pc, mic, dc = _page()
        video, voice, messages = [], [], []
        dc.on("message", lambda m: messages.append(__import__("json").loads(m)))

        async def take(track, into):
            while True:
                f = await track.recv()
                into.append((time.monotonic(), f))

        tasks = []
        pc.on("track", lambda t: tasks.append(asyncio.ensure_future(take(t, video if t.kind == "video" else voice))))
        async with aiohttp.ClientSession() as http:
            status, answer = await _offer(http, url, pc)
            assert status == 200, answer
            t_answer = time.monotonic()
            await pc.setRemoteDescription(RTCSessionDescription(**answer))
            while len(video) < 24 * 3 + 1:
                assert time.monotonic() - t_answer < 15, f"{len(video)} frames after 15 s"
                await asyncio.sleep(0.05)
            first_frame_s = video[0][0] - t_answer
            assert worker_serving(worker.address) == "NOT_SERVING"
            mic.muted.set()  # the page goes silent: no packet, no goodbye
            t_gone = time.monotonic()
            while worker_serving(worker.address) != "SERVING":
                assert time.monotonic() - t_gone < 5, "the worker was still busy 5 s after the page went silent"
                await asyncio.sleep(0.01)
            freed_s = time.monotonic() - t_gone
        for t in tasks:
            t.cancel()
        await pc.close()
        server.cancel()
        return video, voice, messages, first_frame_s, freed_s

    video, voice, messages, first_frame_s, freed_s = asyncio.run(run())
    arrivals = np.array([t for t, _ in video])
    # pts: frame k of the playback timeline at k * 90000 / 24 from the first
    index = np.array([round((f.pts - video[0][1].pts) * float(f.time_base) * 24) for _, f in video])
    assert np.array_equal(index, np.arange(index.size)), index[:20]
    red = np.array([f.to_ndarray(format="rgb24")[..., 0].mean() for _, f in video])
    assert np.all(np.abs(red - index // 4) < 8), np.c_[index, red][:24]  # frame k came from step k // 4
    fps = (index.size - 9) / (arrivals[-1] - arrivals[8])
    gaps = np.diff(arrivals[8:])
    assert 23.0 < fps < 25.0 and np.median(gaps) > 0.030, (fps, np.median(gaps))  # paced at 1/24 s, not in 4-frame bursts
    assert first_frame_s < 2.0
    assert freed_s < 1.0, freed_s
    v = [f for _, f in voice]
    assert len(v) > 40 * 2 and v[0].sample_rate == 48000
    kinds = {m["type"] for m in messages}
    assert {"session", "state", "chunk", "playout"} <= kinds, kinds
    chunk = next(m for m in messages if m["type"] == "chunk")
    assert chunk["frames"] == 4 and len(chunk["peaks"]) == 4


def test_bad_offers_get_clear_messages(worker):
    async def run():
        gateway, server, url = await _start_gateway(worker.address)
        out = {}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/offer", data=b"{not json", headers={"Origin": url, "Content-Type": "application/json"}) as r:
                out["json"] = (r.status, await r.json())
            async with http.post(url + "/image", data=b"a line of text, not an image") as r:
                out["image"] = (r.status, await r.json())
            pc, _, _ = _page()
            out["not_image_offer"] = await _offer(http, url, pc, image=base64.b64encode(b"GIF89a but not really").decode())
            await pc.close()
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            pc.addTransceiver("audio")
            pc.addTransceiver("video")
            await pc.setLocalDescription(await pc.createOffer())  # aiortc's own gathering: no loopback candidate
            async with http.post(url + "/offer", json={"sdp": pc.localDescription.sdp, "type": "offer"}, headers={"Origin": url}) as r:
                out["no_loopback"] = (r.status, await r.json())
            await pc.close()
        server.cancel()
        return out

    out = asyncio.run(run())
    assert out["json"][0] == 400 and "JSON" in out["json"][1]["error"]
    assert out["image"][0] == 400 and "not a readable image" in out["image"][1]["error"]
    status, body = out["not_image_offer"]
    assert status == 400 and body["code"] == "INVALID_ARGUMENT" and "image" in body["error"], body
    assert out["no_loopback"][0] == 400 and "allow-loopback-in-peer-connection" in out["no_loopback"][1]["error"]
    assert worker_serving(worker.address) == "SERVING"
