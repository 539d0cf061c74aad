"""The viewer's gateway refuses what another site could make a browser send it: a request
for a foreign Host (DNS rebinding), a post from a foreign Origin or with none (/offer), an
offer sent as text/plain (a form or fetch with no CORS preflight); it takes the page's own
requests; and /image answers a bad image with 400 and its message, decoded off the event loop.

The rules on their own (viewer/guard.py: check_request), then over HTTP against a running gateway
whose worker is the fakes' (a good offer opens a session)."""

import asyncio
import io
import json
import struct
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

aiohttp = pytest.importorskip("aiohttp", reason="the viewer needs aiohttp and aiortc (see pyproject's view extra)")
pytest.importorskip("aiortc", reason="the viewer needs aiortc (see pyproject's view extra)")

from aiortc import RTCConfiguration, RTCPeerConnection  # noqa: E402

from characters_jax.demo import assets  # noqa: E402
from characters_jax.viewer import gateway as gateway_module  # noqa: E402
from characters_jax.demo.fakes import FakeWorker  # noqa: E402
from characters_jax.viewer.gateway import BridgeOptions, Gateway, RemoteWorker, serve_gateway  # noqa: E402
from characters_jax.viewer.guard import RouteRules, check_request  # noqa: E402
from characters_jax.viewer.ice import gather_on  # noqa: E402
from characters_jax.serving.worker import WorkerOptions  # noqa: E402

PORT = 8123
SOCK = ("127.0.0.1", PORT)
OFFER = RouteRules(origin_required=True, json_body=True)
PAGE = {"Host": f"127.0.0.1:{PORT}", "Origin": f"http://127.0.0.1:{PORT}", "Content-Type": "application/json"}


# -- the rules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [
    PAGE,
    {**PAGE, "Host": f"localhost:{PORT}", "Origin": f"http://localhost:{PORT}"},
    {**PAGE, "Host": f"LOCALHOST:{PORT}", "Origin": f"http://localhost:{PORT}"},
    {**PAGE, "Content-Type": "application/json; charset=utf-8"},
])
def test_the_pages_own_post_passes(headers):
    assert check_request("POST", headers, SOCK, OFFER) is None


@pytest.mark.parametrize("headers,status,words", [
    ({**PAGE, "Host": f"rebound.example:{PORT}", "Origin": f"http://rebound.example:{PORT}"}, 403, "answers only as"),  # DNS rebinding
    ({**PAGE, "Host": f"127.0.0.1:{PORT + 1}"}, 403, "answers only as"),
    ({**PAGE, "Host": "127.0.0.1"}, 403, "answers only as"),  # port 80 implied
    ({**PAGE, "Host": f"[::1]:{PORT}"}, 403, "answers only as"),  # not an address it serves on
    ({**PAGE, "Host": f"localhost.:{PORT}"}, 403, "answers only as"),
    ({**PAGE, "Host": f"evil.example/@127.0.0.1:{PORT}"}, 400, "no valid Host"),
    ({k: v for k, v in PAGE.items() if k != "Host"}, 400, "no valid Host"),
    ({**PAGE, "Origin": "http://evil.example"}, 403, "another site"),
    ({**PAGE, "Origin": f"http://localhost:{PORT}"}, 403, "another site"),  # another origin than the page's
    ({**PAGE, "Origin": f"http://127.0.0.1:{PORT + 1}"}, 403, "another site"),
    ({**PAGE, "Origin": f"https://127.0.0.1:{PORT}"}, 403, "another site"),
    ({**PAGE, "Origin": "null"}, 403, "another site"),  # a sandboxed frame or a data: page
    ({**PAGE, "Origin": "http://[::1"}, 403, "another site"),
    ({k: v for k, v in PAGE.items() if k != "Origin"}, 403, "without an Origin"),
    ({**PAGE, "Content-Type": "text/plain"}, 415, "application/json"),  # no CORS preflight for text/plain
    ({**PAGE, "Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
    ({k: v for k, v in PAGE.items() if k != "Content-Type"}, 415, "application/json"),
])
def test_offers_another_site_could_send_are_refused(headers, status, words):
    r = check_request("POST", headers, SOCK, OFFER)
    assert r is not None and r.status == status and words in r.message, r


def test_other_routes_check_host_always_and_origin_when_present():
    assert check_request("POST", {"Host": PAGE["Host"]}, SOCK) is None  # /image from a tool without Origin
    assert check_request("POST", {"Host": PAGE["Host"], "Content-Type": "image/png"}, SOCK) is None
    assert check_request("POST", {"Host": PAGE["Host"], "Origin": "http://evil.example"}, SOCK).status == 403
    assert check_request("GET", {"Host": PAGE["Host"], "Origin": "http://evil.example"}, SOCK) is None  # reads: CORS keeps them same-origin
    assert check_request("GET", {"Host": f"rebound.example:{PORT}"}, SOCK).status == 403
    assert check_request("GET", {"Host": f"[::1]:{PORT}"}, ("::1", PORT, 0, 0)) is None
    assert "http://[::1]:8123/" in check_request("GET", {"Host": f"rebound.example:{PORT}"}, ("::1", PORT, 0, 0)).message
    assert check_request("GET", PAGE, None).status == 400


# -- over HTTP ----------------------------------------------------------------------------------
def _broken_png() -> bytes:
    """A PNG whose second IDAT chunk has a type that is no chunk type (Pillow: SyntaxError)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    data = buf.getvalue()
    i = data.index(b"IDAT")
    n = struct.unpack(">I", data[i - 4 : i])[0]
    idat = data[i + 4 : i + 4 + n]

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    return data[: i - 4] + chunk(b"IDAT", idat[: n // 2]) + chunk(b"ID\x00T", idat[n // 2 :]) + chunk(b"IEND", b"")


def _dds() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 150, 120)).save(buf, format="DDS")
    return buf.getvalue()


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker("tiny", WorkerOptions(idle_timeout_s=30))
    yield w
    w.close()


async def _with_gateway(address: str, body):
    """Runs body(http, url, gateway) against a gateway on 127.0.0.1:0."""
    gateway = Gateway(RemoteWorker(address), BridgeOptions(), assets.PORTRAIT.read_bytes(), "hello")
    port = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve_gateway(gateway, 0, port.set_result))
    url = f"http://127.0.0.1:{await asyncio.wait_for(port, 10)}"
    try:
        async with aiohttp.ClientSession() as http:
            return await body(http, url, gateway)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


async def _answer(r) -> tuple[int, dict]:
    return r.status, json.loads(await r.text())


async def _offer_sdp() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.addTransceiver("video", direction="recvonly")
    pc.createDataChannel("events")
    await gather_on(pc)
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


def test_cross_site_and_rebinding_requests_are_refused_and_the_pages_own_offer_works(worker):
    async def body(http, url, gateway):
        out = {}
        port = url.rsplit(":", 1)[1]
        pc, sdp = await _offer_sdp()
        offer = json.dumps({"sdp": sdp, "type": "offer"})
        page = {"Origin": url, "Content-Type": "application/json"}
        async with http.get(url + "/", headers={"Host": f"rebound.example:{port}"}) as r:
            out["rebinding_page"] = await _answer(r)
        async with http.get(url + "/status", headers={"Host": f"rebound.example:{port}"}) as r:
            out["rebinding_status"] = await _answer(r)
        async with http.post(url + "/offer", data=offer, headers={**page, "Host": f"rebound.example:{port}", "Origin": f"http://rebound.example:{port}"}) as r:
            out["rebinding_offer"] = await _answer(r)
        async with http.post(url + "/offer", data=offer, headers={**page, "Origin": "http://evil.example"}) as r:
            out["foreign_origin"] = await _answer(r)
        async with http.post(url + "/offer", data=offer, headers={"Content-Type": "application/json"}) as r:
            out["no_origin"] = await _answer(r)
        async with http.post(url + "/offer", data=offer, headers={**page, "Content-Type": "text/plain"}) as r:
            out["text_plain"] = await _answer(r)
        async with http.post(url + "/image", data=assets.PORTRAIT.read_bytes(), headers={"Origin": "http://evil.example"}) as r:
            out["foreign_image"] = await _answer(r)
        out["busy_before"] = gateway.bridge is not None
        async with http.get(url + "/") as r:
            out["page"] = r.status, "view.js" in await r.text()
        async with http.get(f"http://localhost:{port}/status") as r:
            out["localhost_status"] = r.status
        async with http.post(url + "/offer", data=offer, headers=page) as r:  # the page's own offer
            out["good"] = await _answer(r)
        out["busy_after"] = gateway.bridge is not None
        await pc.close()
        return out

    out = asyncio.run(_with_gateway(worker.address, body))
    for key in ("rebinding_page", "rebinding_status", "rebinding_offer"):
        status, msg = out[key]
        assert status == 403 and "answers only as" in msg["error"] and "rebound.example" in msg["error"], (key, out[key])
    assert out["foreign_origin"][0] == 403 and "another site (http://evil.example)" in out["foreign_origin"][1]["error"], out
    assert out["no_origin"][0] == 403 and "without an Origin" in out["no_origin"][1]["error"], out
    assert out["text_plain"][0] == 415 and "application/json" in out["text_plain"][1]["error"], out
    assert out["foreign_image"][0] == 403, out
    assert out["busy_before"] is False  # nothing refused reached the worker
    assert out["page"] == (200, True) and out["localhost_status"] == 200
    status, answer = out["good"]
    assert status == 200 and answer["type"] == "answer" and "a=candidate" in answer["sdp"], out["good"]
    assert out["busy_after"] is True


def test_bad_images_get_400_with_the_message_decoded_off_the_event_loop(monkeypatch):
    threads = []

    def recording(*args):
        threads.append(threading.current_thread())
        return decode(*args)

    decode = gateway_module.load_reference_image
    monkeypatch.setattr(gateway_module, "load_reference_image", recording)

    async def body(http, url, gateway):
        loop_thread = threading.current_thread()
        out = {}
        for name, data in (("broken_png", _broken_png()), ("dds", _dds()), ("text", b"a line of text"), ("good", assets.PORTRAIT.read_bytes())):
            async with http.post(url + "/image", data=data, headers={"Origin": url}) as r:
                out[name] = await _answer(r)
        return out, loop_thread

    out, loop_thread = asyncio.run(_with_gateway("127.0.0.1:1", body))
    status, msg = out["broken_png"]
    assert status == 400 and "PNG data is damaged" in msg["error"] and "broken PNG file" in msg["error"], out
    assert out["dds"][0] == 400 and "DDS files are not accepted" in out["dds"][1]["error"], out
    assert out["text"][0] == 400 and "not a readable image" in out["text"][1]["error"], out
    assert out["good"][0] == 200 and out["good"][1]["ok"] is True, out
    assert len(threads) == 4 and all(t is not loop_thread for t in threads), threads
