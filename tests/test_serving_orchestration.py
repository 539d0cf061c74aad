"""The worker's orchestration in-process, over loopback gRPC, with the fake generator and
decoder (demo/fakes.py): no model, so a conversation runs at a multiple of real time
(the client's playout clock at SPEED x 24 fps paces the worker, speech is sent SPEED times
faster than it plays).

Covered: a clip's exact audio (and each step generated from the audio its chunk carries),
a conversation's events and timeline, interrupt semantics against the reported position,
limits on time with their reason, bad requests, the drain, balancing over three workers,
and a chunk larger than a fixed message limit would allow.
"""

import threading
import time

import grpc
import numpy as np
import pytest

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.audio.timeline import Timeline
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.requests import END_OF_AUDIO, audio_request, interrupt_request, start_request
from characters_jax.client.stream import AsyncConversationStream, ConversationStream
from characters_jax.client.targets import aio_channel, parse_target
from characters_jax.wire.service import PCM_FORMAT, SERVICE_NAME
from characters_jax.demo.fakes import FakeWorker
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.serving.worker import WorkerOptions
from serving_harness import Recorder, png, speech, timeline_of

CFG = load_config("tiny")
TL = Timeline.from_config(CFG)
SPEED = 4  # the conversation runs 4x faster than real time
K = pb.SpeechEvent


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(CFG, WorkerOptions(idle_timeout_s=30, max_queued_audio_s=20))
    yield w
    w.close()


@pytest.fixture
def client(worker):
    c = CharacterClient(worker.address)
    yield c
    c.close()


def health(address, service=SERVICE_NAME):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def wait_idle(address, timeout=2.0):
    t0 = time.monotonic()
    while health(address) != "SERVING":
        assert time.monotonic() - t0 < timeout, "worker did not become idle"
        time.sleep(0.01)


def test_a_clip_carries_its_audio_and_each_step_saw_exactly_that_audio(worker, client):
    pcm = speech(1.3, seed=3)
    res = client.converse(None, pcm, image=png(), prompt="hi", realtime=False)
    steps = TL.steps_for(len(pcm))
    assert res.session.state == pb.RUNNING and res.session.limits.idle_timeout_s == 30 and res.session.worker_id
    assert [c.step_index for c in res.chunks] == list(range(steps)) and np.array_equal(res.audio, pcm)
    assert res.final_event.state == pb.COMPLETED and res.final_event.end_reason == pb.END_OF_AUDIO
    assert [(e.kind, e.position_samples) for e in res.events] == [(K.SPEAKING_STARTED, 0), (K.SPEAKING_STOPPED, len(pcm)), (K.PLAYBACK_FINISHED, len(pcm))]
    # The generator's tokens of step s are the front end's tokens of the timeline window ending at step s.
    fe, timeline = AudioFrontEnd(CFG), np.concatenate([pcm, np.zeros(TL.max_step_samples, np.int16)])
    seen = list(worker.generator.tokens_seen)
    assert len(seen) == steps
    for s in range(steps):
        expected = np.asarray(fe.tokens(fe.window(lambda lo, hi: timeline[lo:hi], s)))
        np.testing.assert_allclose(seen[s], expected, rtol=0, atol=1e-6)
    frames = np.stack(res.frames)
    assert (frames[::4, 0, 0, 0] == np.arange(steps)).all()  # the fake decoder paints each chunk's step


def test_a_conversation_listens_speaks_listens_and_speaks_again(worker, client):
    clock = PlayoutClock(SPEED * 24, prebuffer_frames=8)
    seg1, seg2 = speech(3.0, seed=1), speech(3.0, seed=2)
    with client.conversation(image=png(), playout=clock) as conv:
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 4)  # listening video first
        rec.send_speech(seg1, SPEED)
        rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=10)
        time.sleep(3.0 / SPEED)  # 3 s of silence
        rec.send_speech(seg2, SPEED)
        rec.wait_event(K.PLAYBACK_FINISHED, 2, timeout=10)
        conv.end_audio()
        rec.join()
    assert conv.final.state == pb.COMPLETED and conv.final.end_reason == pb.END_OF_AUDIO
    assert [(e.kind, e.segment) for e in rec.events] == [(K.SPEAKING_STARTED, 1), (K.SPEAKING_STOPPED, 1), (K.PLAYBACK_FINISHED, 1),
                                                          (K.SPEAKING_STARTED, 2), (K.SPEAKING_STOPPED, 2), (K.PLAYBACK_FINISHED, 2)]
    assert all(e.segment_samples == 48000 and not e.interrupted for e in rec.events if e.kind != K.SPEAKING_STARTED)
    steps = [c.step_index for c in rec.chunks]
    assert steps == list(range(len(steps)))
    ts = np.concatenate([c.frame_timestamps_s for c in rec.chunks])
    np.testing.assert_allclose(np.diff(ts), 1 / 24, atol=1e-9)
    timeline = timeline_of(rec.chunks, {1: seg1, 2: seg2})  # checks every span against what was sent
    starts = {e.segment: e.position_samples for e in rec.events if e.kind == K.SPEAKING_STARTED}
    assert starts[1] > 0 and starts[2] - (starts[1] + 48000) >= 0.5 * 16000  # listening before, silence between
    assert not timeline[: starts[1]].any() and not timeline[starts[1] + 48000 : starts[2]].any()


def test_an_interrupt_cuts_at_the_reported_position_and_the_next_utterance_plays(worker, client):
    clock = PlayoutClock(SPEED * 24, prebuffer_frames=8)
    long, reply = speech(5.0, seed=4), speech(1.0, seed=5)
    with client.conversation(image=png(), playout=clock) as conv:
        rec = Recorder(conv)
        rec.send_speech(long, SPEED * 4, end=False)  # a voice agent's burst, faster than it plays
        start = rec.wait_event(K.SPEAKING_STARTED, 1).position_samples
        rec.wait(lambda: TL.frame_start(clock.played) >= start + 16000)  # 1 s into the utterance
        n_before = len(rec.items)
        conv.interrupt()
        played = clock.played  # what the client had shown when it cut playback
        ack = rec.wait_event(K.INTERRUPTED)
        rec.wait(lambda: len(rec.chunks_after(ack)) >= 3)
        rec.send_speech(reply, SPEED)
        rec.wait_event(K.PLAYBACK_FINISHED, 2, timeout=10)
        conv.end_audio()
        rec.join()
    position = TL.frame_start(played)
    assert ack.position_samples == position and ack.played_samples == position and ack.segment == 1
    assert ack.segment_samples == position - start and 16000 <= ack.segment_samples < 16000 + 3 * TL.max_step_samples
    cut = [e for e in rec.events if e.segment == 1 and e.kind in (K.SPEAKING_STOPPED, K.PLAYBACK_FINISHED)]
    assert [(e.kind, e.position_samples, e.interrupted) for e in cut] == [(K.SPEAKING_STOPPED, position, True), (K.PLAYBACK_FINISHED, position, True)]
    # After the acknowledgement: no chunk before resume_step, no sample of the cut utterance.
    after = rec.chunks_after(ack)
    assert after[0].step_index == ack.resume_step and all(c.step_index >= ack.resume_step for c in after)
    assert all(sp.segment != 1 for c in after for sp in c.speech)
    assert all(c.frame_timestamps_s[0] * 24 >= played for c in after)
    assert after[0].frame_timestamps_s[0] == pytest.approx(played / 24)  # playback goes on from the cut
    # The chunks the conversation dropped were only those between the interrupt and its acknowledgement.
    assert all(not isinstance(x, pb.VideoChunk) or x.step_index < ack.resume_step for x in rec.items[n_before : rec.index(ack)])
    reply_events = [(e.kind, e.segment_samples, e.interrupted) for e in rec.events if e.segment == 2]
    assert reply_events == [(K.SPEAKING_STARTED, 0, False), (K.SPEAKING_STOPPED, 16000, False), (K.PLAYBACK_FINISHED, 16000, False)]
    timeline_of(after, {2: reply})


def test_the_asyncio_conversation_speaks_and_is_interrupted(worker):
    """AsyncConversationStream over grpc.aio: the same stream, the same dropping after an interrupt."""
    import asyncio

    async def run():
        channel, _ = aio_channel(worker.address)
        conv = AsyncConversationStream.open(channel, start_request(image=png(), playout_reports=False), balanced=False)
        items, sent_interrupt, after_ack = [], False, None
        async for item in conv:
            items.append(item)
            if isinstance(item, pb.Session):
                conv.send_audio(speech(3.0))  # a burst; the worker paces by its wall clock
            elif isinstance(item, pb.SpeechEvent) and item.kind == K.SPEAKING_STARTED and not sent_interrupt:
                sent_interrupt = True
                conv.interrupt()
            elif isinstance(item, pb.SpeechEvent) and item.kind == K.INTERRUPTED:
                after_ack = 0
            elif isinstance(item, pb.VideoChunk) and after_ack is not None:
                after_ack += 1
                if after_ack == 3:
                    conv.end_audio()
        await channel.close()
        return items

    items = asyncio.run(run())
    kinds = [type(x).__name__ if not isinstance(x, pb.SpeechEvent) else K.Kind.Name(x.kind) for x in items]
    assert kinds[0] == "Session" and kinds[-1] == "SessionEvent" and items[-1].end_reason == pb.END_OF_AUDIO
    ack = next(x for x in items if isinstance(x, pb.SpeechEvent) and x.kind == K.INTERRUPTED)
    after = [x for x in items[items.index(ack):] if isinstance(x, pb.VideoChunk)]
    assert len(after) >= 3 and all(x.step_index >= ack.resume_step and not x.speech for x in after)
    wait_idle(worker.address)


def test_limits_end_sessions_on_time_with_their_reason(worker, client):
    for limits, reason, seconds in ((pb.SessionLimits(idle_timeout_s=0.4), pb.IDLE_TIMEOUT, 0.4),
                                    (pb.SessionLimits(max_duration_s=0.6, idle_timeout_s=99), pb.MAX_DURATION, 0.6)):
        with client.conversation(image=png(), limits=limits, playout=PlayoutClock(24, prebuffer_frames=8)) as conv:
            session = conv.wait_open()
            t0 = time.monotonic()
            rec = Recorder(conv)
            if reason == pb.MAX_DURATION:
                rec.send_speech(speech(2.0), 1, end=False, block=False)  # speaking the whole time
            rec.join()
            elapsed = time.monotonic() - t0
        assert session.limits.idle_timeout_s == min(limits.idle_timeout_s, 30)  # more than the worker's is the worker's
        assert conv.final.state == pb.COMPLETED and conv.final.end_reason == reason
        assert seconds <= elapsed + 0.02 < seconds + 0.3, elapsed
        rec_session = client.get_session(session.session_id)
        assert rec_session.end_reason == reason and rec_session.state == pb.COMPLETED
        wait_idle(worker.address)


def converse_raw(address, requests, timeout=10):
    """Sends `requests` on one Converse stream; returns (responses, status code, details)."""
    with grpc.insecure_channel(address) as ch:
        call = characters_pb2_grpc.CharacterServiceStub(ch).Converse(iter(requests), timeout=timeout)
        out = []
        try:
            for r in call:
                out.append(r)
        except grpc.RpcError as err:
            return out, err.code(), err.details()
        return out, grpc.StatusCode.OK, ""


def test_bad_requests_get_clear_statuses_and_the_worker_stays_healthy(worker, client):
    create = start_request(image=png())
    cases = [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "stream was empty"),
        ([interrupt_request()], grpc.StatusCode.FAILED_PRECONDITION, "interrupt outside a session"),
        ([pb.ConverseRequest(start=pb.ConverseRequest.Start(audio_format=PCM_FORMAT))], grpc.StatusCode.INVALID_ARGUMENT, "needs a session_id"),
        ([start_request(image=b"")], grpc.StatusCode.INVALID_ARGUMENT, "image: empty"),
        ([start_request(image=png(), limits=pb.SessionLimits(max_duration_s=-1))], grpc.StatusCode.INVALID_ARGUMENT, "limits.max_duration_s"),
        ([start_request(session_id="nope")], grpc.StatusCode.NOT_FOUND, "not found"),
        ([create, create], grpc.StatusCode.FAILED_PRECONDITION, "a second start"),
        ([create, END_OF_AUDIO, audio_request(np.ones(10, np.int16))], grpc.StatusCode.INVALID_ARGUMENT, "audio after end_of_audio"),
        ([create, audio_request(b"\x01\x02\x03")], grpc.StatusCode.INVALID_ARGUMENT, "whole number"),
        ([create, audio_request(np.ones(21 * 16000, np.int16))], grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit"),
    ]
    for requests, code, needle in cases:
        out, got, details = converse_raw(worker.address, requests)
        assert (got, needle in details) == (code, True), (needle, got, details)
        if requests and requests[0] is create:
            assert out[0].WhichOneof("event") == "session" and out[-1].session_event.state == pb.FAILED
            assert client.get_session(out[0].session.session_id, session_token=out[0].session.session_token).end_reason == pb.ERROR
        wait_idle(worker.address)
    assert health(worker.address, "") == "SERVING"
    s = client.create_session(png())
    out, got, details = converse_raw(worker.address, [create])
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "another session" in details  # one session per worker
    assert s.session_id not in details and s.session_token not in details  # nothing of the live session's
    assert client.close_session(s.session_id).end_reason == pb.CLOSED
    wait_idle(worker.address)


def test_a_client_that_goes_away_frees_the_worker(worker):
    c = CharacterClient(worker.address)
    conv = c.conversation(image=png(), playout=PlayoutClock(24))
    session = conv.wait_open()
    next(iter(conv))
    t0 = time.monotonic()
    c.close()  # the channel goes: no cancel sent by the library
    wait_idle(worker.address, timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    with CharacterClient(worker.address) as c2:
        rec = c2.get_session(session.session_id, session_token=session.session_token)
    assert rec.state == pb.CANCELLED and rec.end_reason == pb.CLIENT_GONE


def test_drain_lets_the_live_session_finish_and_refuses_new_ones():
    with FakeWorker(CFG) as w, CharacterClient(w.address) as c:
        conv = c.conversation(image=png(), playout=PlayoutClock(SPEED * 24, prebuffer_frames=8))
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 2)
        outcome = []
        drainer = threading.Thread(target=lambda: outcome.append(w.server.drain(5.0)))
        drainer.start()
        t0 = time.monotonic()
        while health(w.address, "") != "NOT_SERVING":
            assert time.monotonic() - t0 < 1.0
        assert health(w.address) == "NOT_SERVING"
        _, code, details = converse_raw(w.address, [start_request(image=png())])
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
        rec.send_speech(speech(0.5), SPEED)
        conv.end_audio()
        rec.join()
        drainer.join(5)
        assert outcome == ["finished"] and conv.final.state == pb.COMPLETED
    with FakeWorker(CFG) as w, CharacterClient(w.address) as c:
        conv = c.conversation(image=png(), playout=PlayoutClock(24))
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 1)
        t0 = time.monotonic()
        assert w.server.drain(0.3) == "cancelled"
        assert 0.3 <= time.monotonic() - t0 < 1.0
        with pytest.raises(grpc.RpcError) as e:
            rec.join()
        assert e.value.code() == grpc.StatusCode.CANCELLED and "drain timeout" in e.value.details()
        assert conv.final.end_reason == pb.DRAIN_TIMEOUT


def test_the_balanced_channel_checks_health_on_the_client():
    """Worker A holds a session (NOT_SERVING), B is idle. Through the library's balanced
    channel every call goes to B (A's session is never found); the same channel with
    grpc's client-side health checking switched off reaches A too."""
    a, b = FakeWorker(CFG), FakeWorker(CFG)
    try:
        with CharacterClient(a.address) as direct:
            held = direct.create_session(png())
        target = parse_target(f"{a.address},{b.address}")

        def found(options) -> list[bool]:
            with grpc.insecure_channel(target.uri, options=options) as ch:
                stub = characters_pb2_grpc.CharacterServiceStub(ch)
                out = []
                for _ in range(8):
                    try:
                        out.append(stub.GetSession(pb.GetSessionRequest(session_id=held.session_id, session_token=held.session_token), timeout=5, wait_for_ready=True).session_id == held.session_id)
                    except grpc.RpcError as err:
                        assert err.code() == grpc.StatusCode.NOT_FOUND
                        out.append(False)
                return out

        assert found(target.options) == [False] * 8
        assert any(found(target.options + [("grpc.inhibit_health_checking", 1)]))
    finally:
        a.close()
        b.close()


def test_a_balanced_client_places_sessions_on_idle_workers_only():
    """Three workers, one balanced channel per client (round_robin + health checks): nine
    sessions at once all complete, never two at a time on one worker."""
    workers = [FakeWorker(CFG) for _ in range(3)]
    target = ",".join(w.address for w in workers)
    n_clients = 9  # three rounds: every freed worker is raced for by the clients still waiting
    spans, errors = [], []

    def one(i):
        try:
            with CharacterClient(target) as c:
                res = c.converse(None, speech(0.5, seed=i), image=png(seed=i), realtime=True, fps=SPEED * 24)
            spans.append((res.session.worker_id, res.open_time, res.recv_times[-1], res.final_event.state))
        except grpc.RpcError as err:
            errors.append((err.code(), err.details()))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for w in workers:
            w.close()
    assert errors == [] and len(spans) == n_clients and all(s[3] == pb.COMPLETED for s in spans)
    by_worker = {}
    for wid, a, b, _ in spans:
        by_worker.setdefault(wid, []).append((a, b))
    assert set(by_worker) == {w.server.options.worker_id for w in workers}
    for runs in by_worker.values():  # sessions on one worker one after the other
        runs.sort()
        assert all(later[0] >= earlier[1] for earlier, later in zip(runs, runs[1:])), runs


def test_a_refused_conversation_opens_again_until_its_timeout(worker, client):
    """Refused (the worker busy) before the Session: a new call after a backoff, until a
    worker takes it or open_timeout passes."""
    blocker = client.create_session(png())
    threading.Timer(0.6, client.close_session, args=(blocker.session_id,)).start()
    conv = ConversationStream(client.stub, start_request(image=png()), wait_for_ready=False, open_timeout=5.0, reopen=True)
    t0 = time.monotonic()
    session = conv.wait_open()
    assert session.state == pb.RUNNING and conv.attempts >= 2 and time.monotonic() - t0 >= 0.55
    conv.close()
    wait_idle(worker.address)
    blocker = client.create_session(png())
    conv = ConversationStream(client.stub, start_request(image=png()), wait_for_ready=False, open_timeout=0.8, reopen=True)
    with pytest.raises(grpc.RpcError) as e:
        conv.wait_open()
    assert e.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED) and time.monotonic() - t0 < 8
    client.close_session(blocker.session_id)
    wait_idle(worker.address)


def test_a_live_stream_outlives_the_connection_age_limit():
    """max_connection_age closes connections for new calls (clients re-resolve); the stream
    in flight goes on to its end."""
    with FakeWorker(CFG, WorkerOptions(max_connection_age_s=0.3)) as w, CharacterClient(w.address) as c:
        res = c.converse(None, speech(0.8), image=png(), realtime=True)
        again = c.converse(None, speech(0.2), image=png(), realtime=False)
    assert res.final_event.state == pb.COMPLETED and len(res.chunks) == TL.steps_for(int(0.8 * 16000))
    assert again.final_event.state == pb.COMPLETED


def test_a_chunk_larger_than_a_fixed_limit_streams():
    big = CFG.replace(video={"height": 1088, "width": 1920})  # one chunk ~25 MB
    with FakeWorker(big) as w, CharacterClient(w.address) as c:
        res = c.converse(None, speech(0.2), image=png(), realtime=False)
    assert res.final_event.state == pb.COMPLETED and len(res.chunks) == 2
    assert len(res.chunks[0].frames[0]) == 1088 * 1920 * 3
