"""`characters-jax view`: the character live in a web page, over WebRTC, on this machine.

A small web gateway (aiohttp) on 127.0.0.1 serves one page (`web/`: HTML, JS and CSS, no
build step) and bridges each page to a generator worker as one more gRPC client: the page's
microphone goes up as the conversation's audio, the character's video and voice come back as
WebRTC tracks (bridge.py, media.py, link.py). The worker never sees WebRTC.
Loopback only (ice.py).

Without --server, `view` starts a worker for --config itself (like `demo`, with the `--set`
items of the config's tables) and stops it on exit. `--set view.KEY=VALUE` sets the
bridge's options (`BridgeOptions`: prebuffer_chunks, ...).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from characters_jax.client.credentials import load_client_credentials
from characters_jax.config import load_config
from characters_jax.config.arguments import config_sets, set_argv
from characters_jax.config.loader import with_sets
from characters_jax.processes import child_env, terminate, write_state_file
from characters_jax.viewer.bridge import BridgeOptions, ViewerBridge
from characters_jax.viewer.guard import RouteRules, check_request
from characters_jax.viewer.ice import LOOPBACK, OfferError
from characters_jax.viewer.link import LinkError
from characters_jax.wire.images import ImageError, load_reference_image

WEB_DIR = pathlib.Path(__file__).resolve().parent / "web"
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
MAX_OFFER_BYTES = 8 << 20  # an SDP plus a base64 reference image of up to 4 MiB


class LocalWorker:
    """`characters-jax serve` started by `view`: a subprocess on a free port, its log in a file."""

    def __init__(self, config: str, checkpoint: str | None, log_path: pathlib.Path, sets: tuple[str, ...] = ()):
        """sets: `--set` items of the config's tables, for the worker."""
        self._tmp = tempfile.TemporaryDirectory(prefix="characters-view-")
        self.state_file = pathlib.Path(self._tmp.name) / "worker.json"
        self.log_path = log_path
        argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", config, "--host", LOOPBACK, "--port", "0",
                "--state-file", str(self.state_file), "--set", f"serve.metrics_host={LOOPBACK}", "--set", "serve.metrics_port=0",
                *set_argv(sets)]
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
        terminate(self.proc)
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
# Beyond a good Host and no foreign Origin (guard.py): the offer opens a session.
_ROUTE_RULES = {"/offer": RouteRules(origin_required=True, json_body=True)}


class Gateway:
    """The aiohttp application: the page, its files, /status, /image and /offer. Every
    request passes guard.py's checks (Host; Origin and content type where it changes state)."""

    def __init__(self, worker, options: BridgeOptions, reference_image: bytes, prompt: str):
        self.worker, self.options = worker, options
        self.reference_image, self.prompt = reference_image, prompt
        self.bridge: ViewerBridge | None = None
        self._decoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="view-image")  # uploads, off the event loop

    def app(self):
        app = web.Application(client_max_size=MAX_OFFER_BYTES, middlewares=[self._guard])
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/reference", self._reference)
        app.router.add_get("/status", self._status)
        app.router.add_post("/image", self._image)
        app.router.add_post("/offer", self._offer)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @web.middleware
    async def _guard(self, request, handler):
        refusal = check_request(request.method, request.headers, request.transport and request.transport.get_extra_info("sockname"),
                                _ROUTE_RULES.get(request.path, RouteRules()))
        if refusal is not None:
            return web.json_response({"error": refusal.message}, status=refusal.status)
        return await handler(request)

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
        """Checks an uploaded reference image as the worker will (format, decode, size limits),
        in a thread. 400 with {"error": message} for an image the worker would refuse."""
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"image: over the limit of {MAX_OFFER_BYTES} bytes for an upload"}, status=413)
        try:
            await asyncio.get_running_loop().run_in_executor(self._decoding, load_reference_image, data, 64, 64)
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

    async def _on_cleanup(self, app) -> None:
        self._decoding.shutdown(wait=False, cancel_futures=True)


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


async def _run_view(args) -> int:
    from characters_jax.weights.directory import checkpoint_path, demo_clip
    from characters_jax.demo import assets

    try:
        # a worker started here: its weights' held-out portrait is the default image (the
        # worker checks the weights; this process starts no JAX backend)
        checkpoint = None if args.server else checkpoint_path(args.checkpoint, args.config)
        if checkpoint is not None and not checkpoint.exists():
            raise FileNotFoundError(f"--checkpoint: weights directory {checkpoint} does not exist")
        clip = demo_clip(checkpoint)
        image = pathlib.Path(args.image or (clip and clip["portrait"]) or assets.PORTRAIT).read_bytes()
        await asyncio.to_thread(load_reference_image, image, 64, 64)
        if args.credentials and not args.server:
            raise ValueError("--credentials: for a worker given with --server (the worker started here is plaintext, on loopback)")
        credentials = load_client_credentials(args.credentials) if args.credentials else None
        if credentials is not None and credentials.certificate_problem():
            raise ValueError(f"--credentials: {credentials.certificate_problem()}")
        worker_sets, view_sets = config_sets(args.set)
        startup_timeout_s = load_config(args.config, worker_sets).serve.startup_timeout_s
        options = dataclasses.replace(with_sets(BridgeOptions(), "view", view_sets), credentials=credentials)
    except (OSError, ImageError, ValueError) as err:
        print(f"characters-jax view: {err}", file=sys.stderr)
        return 2
    local = None
    if args.server:
        worker = RemoteWorker(args.server)
    else:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        local = worker = LocalWorker(args.config, str(checkpoint or "none"), out / "view_worker.log", tuple(worker_sets))
    gateway = Gateway(worker, options, image, args.prompt)
    state: dict = {"pid": os.getpid()}

    def publish() -> None:
        write_state_file(args.state_file, {**state, "worker": worker.state, "worker_address": worker.address, "worker_message": worker.message})

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
            ready = asyncio.ensure_future(local.wait_ready(startup_timeout_s))
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
    from characters_jax.logs import setup_logging

    setup_logging("view", args.log_level)
    return asyncio.run(_run_view(args))
