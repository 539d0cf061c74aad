"""The agent's side of the LiveKit avatar (livekit-agents 1.8.9): an `AvatarSession` that
mints the avatar's token and has the dispatcher start it, then sends the agent's speech to
it over the room.

    avatar = CharacterAvatarSession(dispatcher_url="http://127.0.0.1:8089/launch")
    await avatar.start(agent_session, room=ctx.room)   # before agent_session.start(...)

The token (signed with LIVEKIT_API_KEY / LIVEKIT_API_SECRET, or the keys given) lets the
avatar join this room only, as an agent participant, with the attribute
`lk.publish_on_behalf` = the agent's identity: the room counts its tracks as the agent's.
The dispatcher (livekit_dispatcher.py) gets `{room_name, url, token}` and starts one avatar
for the room; a refusal (another avatar in the room: 409, the worker unreachable: 502, ...)
raises AvatarLaunchError with its message. The agent's audio output becomes livekit-agents'
DataStreamAudioOutput to the avatar at 16 kHz (the agent resamples its TTS), waiting for the
avatar's video track and its lk.playback_started.
"""

from __future__ import annotations

import os

import aiohttp
from livekit import api, rtc
from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF
from livekit.agents.voice.avatar import AvatarSession, DataStreamAudioOutput

SAMPLE_RATE = 16000  # what the avatar takes (the worker's audio format)


class AvatarLaunchError(Exception):
    """The dispatcher did not start the avatar; the message is the dispatcher's."""


def avatar_token(*, room_name: str, avatar_identity: str, agent_identity: str, api_key: str, api_secret: str) -> str:
    """A LiveKit access token for the avatar: joins `room_name` only, as an agent
    participant, publishing on behalf of `agent_identity`."""
    return (api.AccessToken(api_key, api_secret)
            .with_identity(avatar_identity)
            .with_name("character")
            .with_kind("agent")
            .with_grants(api.VideoGrants(room_join=True, room=room_name))
            .with_attributes({ATTRIBUTE_PUBLISH_ON_BEHALF: agent_identity})
            .to_jwt())


class CharacterAvatarSession(AvatarSession):
    def __init__(self, *, dispatcher_url: str, avatar_identity: str = "character-avatar", livekit_url: str | None = None,
                 api_key: str | None = None, api_secret: str | None = None, launch_timeout_s: float = 60.0):
        """dispatcher_url: the dispatcher's /launch; livekit_url: the server the avatar
        joins (default LIVEKIT_URL); api_key, api_secret: default LIVEKIT_API_KEY /
        LIVEKIT_API_SECRET."""
        super().__init__()
        self.dispatcher_url, self._identity = dispatcher_url, avatar_identity
        self.livekit_url = livekit_url or os.environ.get("LIVEKIT_URL", "")
        self._api_key = api_key or os.environ.get("LIVEKIT_API_KEY", "")
        self._api_secret = api_secret or os.environ.get("LIVEKIT_API_SECRET", "")
        self.launch_timeout_s = launch_timeout_s

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "characters-jax"

    async def start(self, agent_session, room: rtc.Room) -> None:
        if not (self._api_key and self._api_secret and self.livekit_url):
            raise ValueError("CharacterAvatarSession needs livekit_url, api_key and api_secret (or LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET)")
        await super().start(agent_session, room)
        token = avatar_token(room_name=room.name, avatar_identity=self._identity, agent_identity=room.local_participant.identity,
                             api_key=self._api_key, api_secret=self._api_secret)
        await launch_avatar(self.dispatcher_url, room.name, self.livekit_url, token, self.launch_timeout_s)
        agent_session.output.replace_audio_tail(DataStreamAudioOutput(
            room, destination_identity=self._identity, sample_rate=SAMPLE_RATE, wait_remote_track=rtc.TrackKind.KIND_VIDEO,
            wait_playback_start=True))


async def launch_avatar(dispatcher_url: str, room_name: str, livekit_url: str, token: str, timeout_s: float = 60.0) -> dict:
    """POSTs the room's connection info to the dispatcher. Raises AvatarLaunchError."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.post(dispatcher_url, json={"room_name": room_name, "url": livekit_url, "token": token}) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise AvatarLaunchError(f"the dispatcher refused the avatar ({resp.status}): {body.get('error', body)}")
                return body
    except (aiohttp.ClientError, TimeoutError) as err:
        raise AvatarLaunchError(f"the dispatcher at {dispatcher_url} could not be reached: {err or type(err).__name__}") from None
