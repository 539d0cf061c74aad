"""The LiveKit avatar worker driven by livekit-agents' own DataStreamAudioOutput (1.8.9) over
a fake room pair in one process (tests/livekit_fake_room.py; no LiveKit server runs here),
against the in-process FakeWorker, publishing through the real rtc.AudioSource and
rtc.VideoSource.

Agent audio is 16 kHz mono in 20 ms frames at real-time pace with +-20 ms of jitter (seed 3).
"""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason="livekit-agents is the [livekit] extra (make venv installs it with dev)")

from livekit import rtc  # noqa: E402
from livekit.agents.voice.avatar import DataStreamAudioOutput  # noqa: E402
from livekit.agents.voice.avatar import _datastream_io  # noqa: E402
from livekit_fake_room import FakeServer  # noqa: E402
from serving_harness import png  # noqa: E402

from characters_jax.config import load_config  # noqa: E402
from characters_jax.demo.fakes import FakeWorker  # noqa: E402
from characters_jax.integrations import livekit_agent  # noqa: E402
from characters_jax.integrations.livekit_agent import CharacterAvatarSession, avatar_token, launch_avatar  # noqa: E402
from characters_jax.integrations.livekit_avatar import AGENT_LEFT, ROOM_CLOSED, SESSION_ENDED, CharacterAvatar, RoomPublisher  # noqa: E402
from characters_jax.integrations.livekit_dispatcher import AvatarDispatcher  # noqa: E402
from characters_jax.integrations.playout import SessionError  # noqa: E402
from characters_jax.protos_gen import characters_pb2 as pb  # noqa: E402
from characters_jax.serving.worker import WorkerOptions  # noqa: E402

KEY, SECRET, URL = "devkey", "devsecret-devsecret-devsecret-0123", "ws://127.0.0.1:7880"
AGENT, AVATAR, ROOM = "agent", "character-avatar", "room-1"
SEED = 3


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(load_config("tiny"), WorkerOptions(idle_timeout_s=60))
    yield w
    w.close()


class RecordingPublisher(RoomPublisher):
    """The room publisher, and what it published when: (monotonic time, tick)."""

    def __init__(self, room):
        super().__init__(room)
        self.ticks: list = []
        self.audio_queued_s: list[float] = []

    async def publish(self, tick):
        await super().publish(tick)
        self.ticks.append((time.monotonic(), tick))
        self.audio_queued_s.append(self.audio.queued_duration)


def agent_token(room=ROOM):
    from livekit import api

    return api.AccessToken(KEY, SECRET).with_identity(AGENT).with_kind("agent").with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt()


async def rooms(server, room=ROOM):
    agent = server.room()
    await agent.connect(URL, agent_token(room))
    avatar = server.room()
    await avatar.connect(URL, avatar_token(room_name=room, avatar_identity=AVATAR, agent_identity=AGENT, api_key=KEY, api_secret=SECRET))
    return agent, avatar


def frames(seconds: float, seed: int, rate: int = 16000, channels: int = 1):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 180 * t) * 6000 + rng.standard_normal(t.size) * 300).astype(np.int16)
    step = rate // 50
    for off in range(0, len(pcm), step):
        piece = np.repeat(pcm[off: off + step, None], channels, axis=1)
        yield rtc.AudioFrame(piece.tobytes(), rate, channels, len(piece) // 1)


async def speak(out: DataStreamAudioOutput, seconds: float, seed: int, realtime: bool = True, flush: bool = True, **fmt) -> float:
    """Captures an utterance at real-time pace (+-20 ms jitter); returns when it began."""
    rng = np.random.default_rng(seed)
    t0 = time.monotonic()
    for i, f in enumerate(frames(seconds, seed, **fmt)):
        if realtime:
            await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 + rng.uniform(-0.02, 0.02) - time.monotonic()))
        await out.capture_frame(f)
    if flush:
        out.flush()
    return t0


async def start_avatar(server, worker, **kw):
    agent_room, avatar_room = await rooms(server)
    publisher = RecordingPublisher(avatar_room)
    avatar = CharacterAvatar(avatar_room, target=worker.address, image=png(), publisher=publisher, **kw)
    run = asyncio.create_task(avatar.run())
    out = DataStreamAudioOutput(agent_room, destination_identity=AVATAR, sample_rate=16000, wait_remote_track=rtc.TrackKind.KIND_VIDEO,
                                wait_playback_start=True)
    return agent_room, avatar_room, avatar, publisher, run, out


def events(out):
    seen = {"started": [], "finished": []}
    out.on("playback_started", lambda ev: seen["started"].append(time.monotonic()))
    out.on("playback_finished", lambda ev: seen["finished"].append(ev))
    return seen


def test_speech_clear_buffer_and_segment_ends_over_the_room(worker):
    async def scenario():
        server = FakeServer()
        agent_room, avatar_room, avatar, pub, run, out = await start_avatar(server, worker)
        seen = events(out)
        # the avatar's tracks count as the agent's
        assert agent_room.remote_participants[AVATAR].attributes == {"lk.publish_on_behalf": AGENT}
        t_first = await speak(out, 1.5, SEED)
        ev = await asyncio.wait_for(out.wait_for_playout(), 20)
        assert not ev.interrupted and ev.playback_position == pytest.approx(1.5, abs=0.02)
        first_speaking = next(t for t, tick in pub.ticks if tick.segment == 1)
        latency = first_speaking - t_first
        assert seen["started"] and 0.1 < latency < 1.5

        # a barge-in: lk.clear_buffer -> lk.playback_finished with the position played
        talking = asyncio.create_task(speak(out, 4.0, SEED + 1, flush=False))
        await asyncio.wait_for(_until(lambda: sum(tick.segment == 2 for _, tick in pub.ticks) >= 24), 20)
        talking.cancel()
        t_clear = time.monotonic()
        out.clear_buffer()
        out.flush()  # as the agent's generation does when it is interrupted
        ev = await asyncio.wait_for(out.wait_for_playout(), 10)
        played = sum(tick.segment == 2 for t, tick in pub.ticks if t <= time.monotonic())
        assert ev.interrupted and ev.playback_position == pytest.approx(played / 24, abs=2 / 24)
        stale = [t - t_clear for t, tick in pub.ticks if tick.segment == 2 and t > t_clear]
        assert len(stale) <= 1  # at most the frame being published when the clear came

        # a clear_buffer with no segment playing is refused with a clear error
        with pytest.raises(rtc.RpcError) as err:
            await agent_room.local_participant.perform_rpc(destination_identity=AVATAR, method="lk.clear_buffer", payload="")
        assert err.value.message == "no speech segment is playing"

        # audio at another rate: refused, the segment answered at 0 (interrupted)
        await speak(out, 0.3, SEED + 2, realtime=False, rate=24000)
        ev = await asyncio.wait_for(out.wait_for_playout(), 10)
        assert ev.interrupted and ev.playback_position == 0.0
        assert avatar.errors and "24000 Hz" in avatar.errors[-1]

        await agent_room.disconnect()  # the agent leaves: the avatar ends its session
        assert await asyncio.wait_for(run, 10) == AGENT_LEFT
        # audio queued ahead of each frame's own samples when the frame is captured: how late its sound starts
        offsets = np.asarray(pub.audio_queued_s[len(pub.audio_queued_s) // 4:]) - 1 / 24
        print(f"\nlivekit: first TTS audio -> first speaking frame {latency:.3f} s; clear_buffer -> last stale frame "
              f"{max(stale, default=0.0) * 1e3:.1f} ms ({len(stale)} frame); a frame's audio starts after the frame by "
              f"p50 {np.median(offsets) * 1e3:.1f} ms, max {offsets.max() * 1e3:.1f} ms; ticks {len(pub.ticks)}, held "
              f"{sum(t.held for _, t in pub.ticks)}")
        return latency

    asyncio.run(scenario())
    _worker_idle(worker)


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.02)


def _worker_idle(worker):
    assert worker.server.table.wait_idle(10), "the worker still holds the session"


def test_a_lost_trailer_ends_the_segment_after_the_receivers_idle_timeout(worker, monkeypatch):
    monkeypatch.setattr(_datastream_io, "STREAM_IDLE_TIMEOUT", 0.5)

    async def scenario():
        server = FakeServer()
        agent_room, avatar_room, avatar, pub, run, out = await start_avatar(server, worker)
        await speak(out, 0.5, SEED, realtime=False, flush=False)  # the trailer never comes
        ev = await asyncio.wait_for(out.wait_for_playout(), 15)
        assert not ev.interrupted and ev.playback_position == pytest.approx(0.5, abs=0.02)
        server.close_room(ROOM)
        assert await asyncio.wait_for(run, 10) == ROOM_CLOSED

    asyncio.run(scenario())
    _worker_idle(worker)


def test_the_session_ending_takes_the_avatar_out_of_the_room(worker):
    async def scenario():
        server = FakeServer()
        left = asyncio.Event()
        agent_room, avatar_room, avatar, pub, run, out = await start_avatar(server, worker, limits=pb.SessionLimits(idle_timeout_s=1.0))
        agent_room.on("participant_disconnected", lambda p: left.set() if p.identity == AVATAR else None)
        assert await asyncio.wait_for(run, 20) == SESSION_ENDED  # idle_timeout: the worker ended it
        await asyncio.wait_for(left.wait(), 5)
        assert not avatar_room.isconnected() and avatar.session.final.end_reason == pb.IDLE_TIMEOUT

    asyncio.run(scenario())
    _worker_idle(worker)


def test_an_unreachable_worker_fails_the_avatar_and_leaves_nothing_running():
    async def scenario():
        server = FakeServer()
        _agent_room, avatar_room = await rooms(server)
        avatar = CharacterAvatar(avatar_room, target="127.0.0.1:1", image=png(), publisher=RecordingPublisher(avatar_room))
        with pytest.raises(SessionError) as err:
            await avatar.run()
        assert err.value.code == "UNAVAILABLE"
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []


def test_the_dispatcher_starts_one_avatar_per_room_and_the_agent_session_routes_audio(worker):
    async def scenario():
        server = FakeServer()
        dispatcher = AvatarDispatcher(target=worker.address, image=png(), room_factory=server.room)
        port = await dispatcher.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/launch"
        agent_room = server.room()
        await agent_room.connect(URL, agent_token())

        class AgentSessionStub:  # what AvatarSession.start and the tail swap use of an AgentSession
            def __init__(self):
                self.output = self
                self.tail = None

            def on(self, *_a):
                pass

            def off(self, *_a):
                pass

            def emit(self, *_a):
                pass

            def replace_audio_tail(self, sink):
                self.tail = sink

        stub = AgentSessionStub()
        session = CharacterAvatarSession(dispatcher_url=url, livekit_url=URL, api_key=KEY, api_secret=SECRET)
        await session.start(stub, agent_room)
        assert isinstance(stub.tail, DataStreamAudioOutput) and stub.tail.sample_rate == 16000
        await session.wait_for_join(timeout=10)  # the avatar joined and published its video
        assert ROOM in dispatcher.avatars

        token = avatar_token(room_name=ROOM, avatar_identity="second", agent_identity=AGENT, api_key=KEY, api_secret=SECRET)
        with pytest.raises(livekit_agent.AvatarLaunchError, match="409.*already serves room 'room-1'"):
            await launch_avatar(url, ROOM, URL, token)
        with pytest.raises(livekit_agent.AvatarLaunchError, match="400"):
            await launch_avatar(url, "", URL, "")

        busy = AvatarDispatcher(target="127.0.0.1:1", image=png(), room_factory=server.room)
        busy_port = await busy.start("127.0.0.1", 0)
        other = avatar_token(room_name="room-2", avatar_identity=AVATAR, agent_identity=AGENT, api_key=KEY, api_secret=SECRET)
        with pytest.raises(livekit_agent.AvatarLaunchError, match="502.*refused the session: UNAVAILABLE"):
            await launch_avatar(f"http://127.0.0.1:{busy_port}/launch", "room-2", URL, other)
        assert busy.avatars == {} and "room-2" not in server.rooms or server.rooms["room-2"] == {}

        await agent_room.disconnect()
        await asyncio.wait_for(_until(lambda: ROOM not in dispatcher.avatars), 10)
        assert dispatcher.ended[ROOM] == AGENT_LEFT
        await session.aclose()
        await dispatcher.stop()
        await busy.stop()

    asyncio.run(scenario())
    _worker_idle(worker)
