"""A LiveKit server in one process, for livekit-agents' data-stream avatar I/O: the Room
and participant members that DataStreamAudioOutput, DataStreamAudioReceiver,
AvatarSession and livekit.agents.utils use, and nothing else.

    server = FakeServer()
    agent_room = server.room(); await agent_room.connect(URL, token)   # the token's identity, room, kind, attributes

Room: name, isconnected(), connection_state, local_participant, remote_participants,
register_byte_stream_handler(topic, handler), unregister_byte_stream_handler, disconnect(),
and the events connection_state_changed, participant_active, participant_connected,
participant_disconnected, disconnected, track_published, local_track_published.
LocalParticipant: identity, kind, attributes, _rpc_handlers, register_rpc_method,
unregister_rpc_method, perform_rpc (a handler's RpcError reaches the caller; a missing
method is UNSUPPORTED_METHOD; other exceptions APPLICATION_ERROR), stream_bytes (a writer
whose chunks reach each destination's reader), publish_track. RemoteParticipant: identity,
kind, state (ACTIVE), attributes, track_publications.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time

import jwt
from livekit import rtc

KINDS = {"agent": rtc.ParticipantKind.PARTICIPANT_KIND_AGENT, "": rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD,
         "standard": rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD}
_ids = itertools.count(1)


class FakeServer:
    def __init__(self):
        self.rooms: dict[str, dict[str, FakeRoom]] = {}  # room name -> identity -> its connection

    def room(self) -> "FakeRoom":
        return FakeRoom(self)

    def members(self, name: str) -> dict[str, "FakeRoom"]:
        return self.rooms.setdefault(name, {})

    def close_room(self, name: str) -> None:
        """The server deletes the room: every participant is disconnected at once."""
        members = list(self.members(name).values())
        self.rooms.pop(name, None)
        for room in members:
            room._drop()


class FakeByteStreamReader:
    def __init__(self, info: rtc.ByteStreamInfo):
        self.info = info
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        pass


class FakeByteStreamWriter:
    def __init__(self, readers: list[FakeByteStreamReader]):
        self.readers = readers

    async def write(self, data: bytes) -> None:
        for r in self.readers:
            r._queue.put_nowait(bytes(data))

    async def aclose(self, **_kw) -> None:
        for r in self.readers:
            r._queue.put_nowait(None)


class FakePublication:
    def __init__(self, track, name: str):
        self.sid, self.name, self.kind, self.track = f"TR_{next(_ids)}", name, track.kind, track
        self.subscribed = True

    async def wait_for_subscription(self) -> None:
        pass


class FakeRemoteParticipant:
    def __init__(self, room: "FakeRoom"):
        self.identity, self.name, self.kind, self.attributes = room._identity, room._identity, room._kind, dict(room._attributes)
        self.state = rtc.ParticipantState.PARTICIPANT_STATE_ACTIVE
        self.track_publications: dict[str, FakePublication] = {}
        self.sid = f"PA_{next(_ids)}"


class FakeLocalParticipant:
    def __init__(self, room: "FakeRoom"):
        self._room = room
        self.identity, self.name, self.kind, self.attributes = room._identity, room._identity, room._kind, dict(room._attributes)
        self._rpc_handlers: dict = {}
        self.track_publications: dict[str, FakePublication] = {}
        self.sid = f"PA_{next(_ids)}"

    def register_rpc_method(self, method_name: str, handler=None):
        def register(fn):
            self._rpc_handlers[method_name] = fn
            return fn

        return register(handler) if handler is not None else register

    def unregister_rpc_method(self, method: str) -> None:
        self._rpc_handlers.pop(method, None)

    async def perform_rpc(self, *, destination_identity: str, method: str, payload: str, response_timeout: float | None = None, **_kw) -> str:
        dest = self._room._peer(destination_identity)
        if dest is None:
            raise rtc.RpcError(rtc.RpcError.ErrorCode.RECIPIENT_NOT_FOUND, f"{destination_identity} is not in the room")
        handler = dest.local_participant._rpc_handlers.get(method)
        if handler is None:
            raise rtc.RpcError(rtc.RpcError.ErrorCode.UNSUPPORTED_METHOD, f"{method} is not registered")
        data = rtc.RpcInvocationData(f"RQ_{next(_ids)}", self.identity, payload, response_timeout or 10.0, method)
        await asyncio.sleep(0)  # delivered on the next turn of the loop, as over a network
        try:
            result = handler(data)
            if inspect.isawaitable(result):
                result = await result
        except rtc.RpcError:
            raise
        except Exception as err:
            raise rtc.RpcError(rtc.RpcError.ErrorCode.APPLICATION_ERROR, str(err)) from None
        return result

    async def stream_bytes(self, name: str, *, topic: str = "", attributes=None, destination_identities=None, **_kw) -> FakeByteStreamWriter:
        readers = []
        for identity in destination_identities or [i for i in self._room._server.members(self._room.name) if i != self.identity]:
            dest = self._room._peer(identity)
            handler = dest._byte_handlers.get(topic) if dest is not None else None
            if handler is None:
                continue
            reader = FakeByteStreamReader(rtc.ByteStreamInfo(stream_id=f"ST_{next(_ids)}", mime_type="application/octet-stream", topic=topic,
                                                             timestamp=int(time.time() * 1000), size=None, attributes=dict(attributes or {}), name=name))
            readers.append(reader)
            asyncio.get_running_loop().call_soon(handler, reader, self.identity)
        return FakeByteStreamWriter(readers)

    async def publish_track(self, track, options=None) -> FakePublication:
        pub = FakePublication(track, getattr(track, "name", "track"))
        self.track_publications[pub.sid] = pub
        self._room.emit("local_track_published", pub, track)
        for peer in self._room._peers():
            remote = peer.remote_participants[self.identity]
            remote.track_publications[pub.sid] = pub
            peer.emit("track_published", pub, remote)
            peer.emit("track_subscribed", track, pub, remote)
        return pub


class FakeRoom(rtc.EventEmitter):
    def __init__(self, server: FakeServer):
        super().__init__()
        self._server = server
        self.name = ""
        self._connected = False
        self._byte_handlers: dict = {}
        self.remote_participants: dict[str, FakeRemoteParticipant] = {}
        self.local_participant: FakeLocalParticipant | None = None
        self.disconnects = 0

    async def connect(self, url: str, token: str, options=None) -> None:
        claims = jwt.decode(token, options={"verify_signature": False})
        grant = claims.get("video") or {}
        if not grant.get("roomJoin") or not grant.get("room"):
            raise rtc.ConnectError("the token grants no room")
        self.name, self._identity = grant["room"], claims["sub"]
        self._kind, self._attributes = KINDS.get(claims.get("kind", ""), KINDS[""]), claims.get("attributes") or {}
        members = self._server.members(self.name)
        if self._identity in members:
            raise rtc.ConnectError(f"{self._identity} is already in the room")
        self.local_participant = FakeLocalParticipant(self)
        for peer in members.values():
            self.remote_participants[peer._identity] = FakeRemoteParticipant(peer)
            for pub in peer.local_participant.track_publications.values():
                self.remote_participants[peer._identity].track_publications[pub.sid] = pub
        members[self._identity] = self
        self._connected = True
        self.emit("connection_state_changed", rtc.ConnectionState.CONN_CONNECTED)
        for peer in self._peers():
            p = FakeRemoteParticipant(self)
            peer.remote_participants[self._identity] = p
            peer.emit("participant_connected", p)
            peer.emit("participant_active", p)

    def isconnected(self) -> bool:
        return self._connected

    @property
    def connection_state(self):
        return rtc.ConnectionState.CONN_CONNECTED if self._connected else rtc.ConnectionState.CONN_DISCONNECTED

    def register_byte_stream_handler(self, topic: str, handler) -> None:
        if topic in self._byte_handlers:
            raise ValueError(f"a byte stream handler for topic {topic!r} is already set")
        self._byte_handlers[topic] = handler

    def unregister_byte_stream_handler(self, topic: str) -> None:
        self._byte_handlers.pop(topic, None)

    def _peer(self, identity: str) -> "FakeRoom | None":
        return self._server.members(self.name).get(identity)

    def _peers(self) -> list["FakeRoom"]:
        return [r for i, r in self._server.members(self.name).items() if i != self._identity]

    async def disconnect(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if not self._connected:
            return
        self._connected = False
        self.disconnects += 1
        self._server.members(self.name).pop(self._identity, None)
        for peer in self._peers():
            gone = peer.remote_participants.pop(self._identity, None)
            if gone is not None:
                peer.emit("participant_disconnected", gone)
        self.emit("connection_state_changed", rtc.ConnectionState.CONN_DISCONNECTED)
        self.emit("disconnected", rtc.DisconnectReason.CLIENT_INITIATED if hasattr(rtc, "DisconnectReason") else 0)
