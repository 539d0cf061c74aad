"""The avatar dispatcher: starts one avatar (livekit_avatar.CharacterAvatar) per room when
an agent asks (CharacterAvatarSession posts the room's connection info).

    python -m characters_jax.integrations.livekit_dispatcher --worker 127.0.0.1:50051 --image face.png --port 8089

POST /launch `{"room_name", "url", "token"}`: joins the room with the token, opens a session
on the worker and serves the room until it closes, the agent leaves or the session ends.
Answers 200 `{"room": name}` once the avatar is in the room with its session open; 400 for
a malformed request, 409 while an avatar serves that room already (one worker session per
room), 502 when the room or the worker cannot be reached (the message says which; nothing is
left running). GET /rooms lists the rooms served. The HTTP listener binds where it is told
(default 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
from typing import Callable

from aiohttp import web
from livekit import rtc

from characters_jax.client.credentials import ClientCredentials, load_client_credentials
from characters_jax.integrations.livekit_avatar import CharacterAvatar
from characters_jax.integrations.playout import SessionError

log = logging.getLogger("characters_jax.integrations.livekit_dispatcher")


class AvatarDispatcher:
    def __init__(self, *, target: str, image: bytes, prompt: str = "", credentials: ClientCredentials | None = None,
                 room_factory: Callable[[], rtc.Room] = rtc.Room, avatar_factory=CharacterAvatar):
        """target, image, prompt, credentials: every avatar's worker session; room_factory:
        a new (unconnected) room per launch."""
        self.target, self.image, self.prompt, self.credentials = target, image, prompt, credentials
        self.room_factory, self.avatar_factory = room_factory, avatar_factory
        self.avatars: dict[str, asyncio.Task] = {}  # room name -> the avatar serving it
        self.ended: dict[str, str] = {}  # room name -> why its last avatar ended
        self.app = web.Application()
        self.app.router.add_post("/launch", self.launch)
        self.app.router.add_get("/rooms", self.rooms)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8089) -> int:
        """Serves HTTP on host:port (0: any free port); returns the port."""
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for task in list(self.avatars.values()):
            task.cancel()
        await asyncio.gather(*self.avatars.values(), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    async def rooms(self, _request: web.Request) -> web.Response:
        return web.json_response({"rooms": sorted(self.avatars)})

    async def launch(self, request: web.Request) -> web.Response:
        try:
            info = await request.json()
            room_name, url, token = (info[k] for k in ("room_name", "url", "token"))
            if not all(isinstance(v, str) and v for v in (room_name, url, token)):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected JSON {room_name, url, token}, each a non-empty string"}, status=400)
        if room_name in self.avatars:
            return web.json_response({"error": f"an avatar already serves room {room_name!r}"}, status=409)
        room = self.room_factory()
        try:
            await room.connect(url, token)
        except Exception as err:  # the SDK's ConnectError, a bad URL, a refused token
            return web.json_response({"error": f"could not join room {room_name!r} at {url}: {err}"}, status=502)
        avatar = self.avatar_factory(room, target=self.target, image=self.image, prompt=self.prompt, credentials=self.credentials)
        opened = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._serve(room_name, room, avatar, opened))
        self.avatars[room_name] = task
        error = await opened
        if error is not None:
            return web.json_response({"error": error}, status=502)
        return web.json_response({"room": room_name})

    async def _serve(self, room_name: str, room, avatar: CharacterAvatar, opened: asyncio.Future) -> None:
        reason = "cancelled"
        try:
            run = asyncio.create_task(avatar.run())
            opened_wait = asyncio.create_task(avatar.opened.wait())
            await asyncio.wait([run, opened_wait], return_when=asyncio.FIRST_COMPLETED)
            opened_wait.cancel()
            if avatar.opened.is_set() and not opened.done():
                opened.set_result(None)
            reason = await run
        except SessionError as err:
            reason = f"worker session: {err}"
            if not opened.done():
                opened.set_result(f"the character worker refused the session: {err}")
        finally:
            if not opened.done():
                opened.set_result(f"the avatar ended before it opened: {reason}")
            if room.isconnected():
                await room.disconnect()
            self.avatars.pop(room_name, None)
            self.ended[room_name] = reason
            log.info("avatar ended", extra={"fields": {"room": room_name, "reason": reason}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m characters_jax.integrations.livekit_dispatcher", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, help="the character worker: host:port, a comma list or dns:///name:port")
    p.add_argument("--image", required=True, type=pathlib.Path, help="the reference image (PNG, JPEG or WebP)")
    p.add_argument("--prompt", default="")
    p.add_argument("--credentials", type=pathlib.Path, help="the client credentials TOML (TLS, token) for the worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8089)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    creds = load_client_credentials(args.credentials) if args.credentials else None
    dispatcher = AvatarDispatcher(target=args.worker, image=args.image.read_bytes(), prompt=args.prompt, credentials=creds)

    async def serve():
        port = await dispatcher.start(args.host, args.port)
        log.info("dispatcher listening", extra={"fields": {"host": args.host, "port": port}})
        try:
            await asyncio.Event().wait()
        finally:
            await dispatcher.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
