"""Sessions that outlive their worker, in-process over loopback with the fake generator and
decoder (demo/fakes.py: the real orchestration, its latent of step n holds n and its audio
tokens' mean, so a frame shows which step and which audio made it).

- A drain migrates a live session: the client library re-opens Converse on the other
  worker, which resumes from the MIGRATE snapshot; steps, frame timestamps and audio sample
  positions go on without a gap or a repeat, the speech on the timeline is exactly what was
  sent (the audio sent after the snapshot is replayed: nothing lost or doubled), every
  speech event comes once, and a 24 fps playout clock with the default lead never underruns.
  The asyncio stream (the viewer's and the integrations') follows a migration the same way.
- A resume is refused with a clear status, the worker healthy afterwards: a wrong token or
  an unknown session (the same NOT_FOUND), a missing step, another config or tp size (the
  message names the field), a damaged manifest or array (DATA_LOSS naming it), a session
  live on another worker (ABORTED), a worker without a store; a snapshot request outside a
  session or in one that is not resumable. Tokens never reach the log or a status message.
- The store's limits: snapshots kept per session, sessions past keep_s, the size limit
  (unclaimed sessions removed oldest first, a live one never), a failed snapshot counted and
  the session going on.
- The playout clock counts no underrun for a stream that ends while it waits.

Speech from serving_harness.speech with seeds 1 and 2; session seed 0.
"""

import json
import logging
import os
import threading
import time

import grpc
import numpy as np
import pytest

from characters_jax.audio.timeline import Timeline
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeWorker
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.snapshot_store import MANIFEST, SnapshotStore, StoreFull, _manifest_crc
from characters_jax.serving.worker import WorkerOptions
from characters_jax.wire.service import PCM_FORMAT
from serving_harness import Recorder, png, poll, speech, timeline_of

K = pb.SpeechEvent
CFG = load_config("tiny")
TIMELINE = Timeline.from_config(CFG)


def _options(store, worker_id, **kw) -> WorkerOptions:
    return WorkerOptions(worker_id=worker_id, snapshot_dir=str(store), drain_timeout_s=10.0, **kw)


def _metric(worker, name, labels=None) -> float:
    return worker.server.ctx.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def _resume_start(session_id, token, step=None) -> pb.ConverseRequest:
    resume = pb.ConverseRequest.Resume(session_id=session_id, session_token=token)
    if step is not None:
        resume.step = step
    return pb.ConverseRequest(start=pb.ConverseRequest.Start(resumable=True, playout_reports=False, audio_format=PCM_FORMAT, resume=resume))


def _first_response(address, request) -> pb.ConverseResponse:
    with grpc.insecure_channel(address) as ch:
        return next(characters_pb2_grpc.CharacterServiceStub(ch).Converse(iter([request]), timeout=30))


def _check_contiguous(chunks) -> None:
    """Steps 0..n-1 once each, frame timestamps 1/fps apart, audio sample positions joined."""
    assert [c.step_index for c in chunks] == list(range(len(chunks)))
    ts = np.concatenate([c.frame_timestamps_s for c in chunks])
    np.testing.assert_allclose(np.diff(ts), 1 / CFG.video.fps, atol=1e-9)
    for a, b in zip(chunks, chunks[1:]):
        assert b.audio_first_sample == a.audio_first_sample + len(a.audio_pcm) // 2, (a.step_index, b.step_index)
        assert b.audio_first_sample == TIMELINE.step_span(b.step_index)[0]


def _frame_step(chunk) -> int:
    """The step the fake decoder drew into a chunk's frames (red = step mod 256)."""
    return int(np.frombuffer(chunk.frames[0], np.uint8)[0])


@pytest.fixture()
def store(tmp_path):
    return tmp_path / "store"


def test_a_drain_migrates_the_session_and_nothing_is_lost_or_doubled(store):
    workers = {i: FakeWorker("tiny", _options(store, f"w{i}")) for i in range(2)}
    seg1, seg2 = speech(1.6, seed=1), speech(0.8, seed=2)
    clock = PlayoutClock(CFG.video.fps)  # real time, the default prebuffer; the worker's default lead
    try:
        with CharacterClient(",".join(w.address for w in workers.values())) as client:
            conv = client.conversation(image=png(), playout=clock)
            rec = Recorder(conv)
            rec.wait(lambda: conv.session is not None, 30)
            first = next(w for w in workers.values() if w.server.options.worker_id == conv.session.worker_id)
            second = next(w for w in workers.values() if w is not first)
            assert conv.session.resumable and conv.session.snapshot_interval_s == 0
            sender = rec.send_speech(seg1, block=False)  # a microphone: audio goes on through the hand-over
            rec.wait(lambda: len(rec.chunks) >= 10, 30)
            drained = {}
            drainer = threading.Thread(target=lambda: drained.update(outcome=first.server.drain(10.0)), daemon=True)
            drainer.start()
            rec.wait(lambda: any(isinstance(x, pb.SessionResumed) for x in rec.items), 30)
            sender.join(30)
            rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=30)
            rec.send_speech(seg2)
            rec.wait_event(K.PLAYBACK_FINISHED, 2, timeout=30)
            conv.end_audio()
            rec.join(30)
            drainer.join(30)
        clock.wait_drained(5)
    finally:
        for w in workers.values():
            w.close()
    assert drained["outcome"] == "migrated"
    assert conv.final.state == pb.COMPLETED and conv.final.end_reason == pb.END_OF_AUDIO
    migrate = [x for x in rec.items if isinstance(x, pb.SnapshotEvent)]
    resumed = [x for x in rec.items if isinstance(x, pb.SessionResumed)]
    assert [m.kind for m in migrate] == [pb.SnapshotEvent.MIGRATE] and len(resumed) == 1
    assert resumed[0].step == migrate[0].step == resumed[0].next_step and resumed[0].regenerated_steps == 0
    assert resumed[0].from_worker_id == first.server.options.worker_id
    assert 0 < migrate[0].step < len(rec.chunks) and migrate[0].bytes > 0
    hand = conv.handovers[0]
    assert len(conv.handovers) == 1 and hand["kind"] == "migration" and hand["first_step"] == migrate[0].step
    assert hand["replayed"] > 0, "no input was sent after the snapshot: the replay went untested"
    chunks = rec.chunks
    _check_contiguous(chunks)
    assert [_frame_step(c) for c in chunks] == [c.step_index % 256 for c in chunks]
    timeline_of(chunks, {1: seg1, 2: seg2})  # every speech sample once, in place; silence elsewhere
    order = [(e.kind, e.segment) for e in rec.events]
    for kind in (K.SPEAKING_STARTED, K.SPEAKING_STOPPED, K.PLAYBACK_FINISHED):
        assert [s for k, s in order if k == kind] == [1, 2], order
    assert clock.underruns == 0, (clock.underruns, clock.stall_s, conv.handovers)
    # metrics on both sides; the completed session's snapshots are gone
    assert _metric(first, "characters_migrations_total") == 1
    assert _metric(first, "characters_snapshots_total", {"kind": "MIGRATE"}) == 1
    assert _metric(first, "characters_snapshot_bytes_total") == migrate[0].bytes
    assert _metric(first, "characters_snapshot_seconds_count") == 1
    assert _metric(first, "characters_snapshot_failures_total", {"kind": "MIGRATE"}) == 0
    assert _metric(second, "characters_resumes_total", {"kind": "migration"}) == 1
    assert _metric(second, "characters_resume_seconds_count") == 1
    assert SnapshotStore(store).steps(conv.session.session_id) == []


@pytest.fixture()
def fleet(store):
    """Two workers on one store, one of another config (ring_frames 8) on it, one without."""
    ws = {"a": FakeWorker("tiny", _options(store, "a")), "b": FakeWorker("tiny", _options(store, "b")),
          "other": FakeWorker(CFG.replace(cache={"ring_frames": 8}), _options(store, "other")),
          "none": FakeWorker("tiny", WorkerOptions(worker_id="none"))}
    yield ws
    for w in ws.values():
        w.close()


def test_resumes_are_refused_with_a_clear_status_and_the_worker_stays_healthy(fleet, store, caplog):
    a, b = fleet["a"], fleet["b"]
    caplog.set_level(logging.DEBUG, logger="characters_jax")
    statuses = []

    def refused(worker, request):
        code, details = _status(lambda: _first_response(worker.address, request))
        statuses.append(details)
        return code, details

    with CharacterClient(a.address) as client:
        conv = client.conversation(image=png(), playout_reports=False)
        rec = Recorder(conv)
        rec.send_speech(speech(0.5, seed=1), speed=4)
        rec.wait(lambda: len(rec.chunks) >= 3, 30)
        conv.request_snapshot()
        rec.wait(lambda: any(isinstance(x, pb.SnapshotEvent) for x in rec.items), 30)
        snap = next(x for x in rec.items if isinstance(x, pb.SnapshotEvent))
        sid, token = snap.session_id, snap.session_token
        assert snap.kind == pb.SnapshotEvent.REQUESTED and sid == conv.session.session_id and token
        # live on a: one worker at a time
        code, details = refused(b, _resume_start(sid, token))
        assert code == grpc.StatusCode.ABORTED and "live on a worker" in details, details
        conv.cancel()
        with pytest.raises(grpc.RpcError):
            rec.join(30)
    assert a.server.table.wait_idle(10)

    # knowing the id is not enough: a wrong token reads as an unknown session
    code, wrong = refused(b, _resume_start(sid, "x" * 43))
    code2, unknown = refused(b, _resume_start("0" * 32, token))
    assert code == code2 == grpc.StatusCode.NOT_FOUND and wrong == unknown.replace("0" * 32, sid)
    code, details = refused(b, _resume_start(sid, token, step=snap.step + 999))
    assert code == grpc.StatusCode.NOT_FOUND and f"snapshot {snap.step + 999}" in details
    code, details = refused(fleet["none"], _resume_start(sid, token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no snapshot store" in details
    code, details = refused(fleet["other"], _resume_start(sid, token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "config.cache.ring_frames: 6 in the snapshot, 8 on this worker" in details, details

    path = store / sid / f"{snap.step:012d}"
    manifest_text = (path / MANIFEST).read_text()
    manifest = json.loads(manifest_text)
    manifest["identity"]["tp"] = 2
    manifest["manifest_crc32"] = _manifest_crc(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    code, details = refused(b, _resume_start(sid, token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "tp: 2 in the snapshot, 1 on this worker" in details, details
    (path / MANIFEST).write_text(manifest_text.replace('"kind": "REQUESTED"', '"kind": "PERIODIC"'))  # checksum not updated
    code, details = refused(b, _resume_start(sid, token))
    assert code == grpc.StatusCode.DATA_LOSS and "checksum" in details, details
    (path / MANIFEST).write_text(manifest_text)
    entry = next(e for e in manifest["arrays"] if e["nbytes"] > 0)
    raw = bytearray((path / "arrays.bin").read_bytes())
    raw[entry["offset"]] ^= 0xFF
    (path / "arrays.bin").write_bytes(bytes(raw))
    code, details = refused(b, _resume_start(sid, token))
    assert code == grpc.StatusCode.DATA_LOSS and f"array {entry['name']}" in details, details
    raw[entry["offset"]] ^= 0xFF
    (path / "arrays.bin").write_bytes(bytes(raw))

    # a snapshot request outside a session; in a session that is not resumable
    code, details = refused(b, pb.ConverseRequest(snapshot=pb.ConverseRequest.SnapshotRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    with CharacterClient(b.address) as client:
        conv = client.conversation(image=png(), playout_reports=False, resumable=False)
        rec = Recorder(conv)
        rec.wait(lambda: conv.session is not None, 30)
        assert not conv.session.resumable
        conv.request_snapshot()
        with pytest.raises(grpc.RpcError) as err:
            rec.join(30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not resumable" in err.value.details()
    assert b.server.table.wait_idle(10)

    # the positive control: the owner resumes on b, and b is healthy for a new session after it
    with grpc.insecure_channel(b.address) as ch:
        end = threading.Event()

        def requests():
            yield _resume_start(sid, token)
            end.wait(30)
            yield pb.ConverseRequest(end_of_audio=pb.ConverseRequest.EndOfAudio())

        stream = characters_pb2_grpc.CharacterServiceStub(ch).Converse(requests(), timeout=60)
        first, second = next(stream), next(stream)
        end.set()
        rest = list(stream)
    assert first.session.state == pb.RUNNING and first.session.session_id == sid and first.session.session_token == ""
    assert second.resumed.step == snap.step and second.resumed.from_worker_id == "a"
    assert [r.chunk.step_index for r in rest if r.HasField("chunk")][0] == snap.step
    assert rest[-1].session_event.state == pb.COMPLETED
    assert SnapshotStore(store).steps(sid) == []  # completed: its snapshots removed
    with CharacterClient(b.address) as client:
        res = client.converse(None, speech(0.3, seed=2), image=png(), realtime=False)
    assert res.final_event.state == pb.COMPLETED
    logged = [str(r.__dict__) for r in caplog.records]
    assert any(sid in line for line in logged)  # the log names the session (its own worker's) ...
    assert not any(token in line for line in logged)  # ... never its token
    assert not any(token in s for s in statuses)


def _write(st: SnapshotStore, session_id: str, step: int, nbytes: int = 1000):
    manifest = {"session": {"session_id": session_id, "token_sha256": "0" * 64}, "step": step, "kind": "PERIODIC", "identity": {}}
    return st.write(manifest, {"a": np.zeros(nbytes, np.uint8)})


def _age(st: SnapshotStore, session_id: str, seconds: float) -> None:
    """Dates a session's files `seconds` back."""
    then = time.time() - seconds
    for root, dirs, files in os.walk(st.root / session_id):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then))
    os.utime(st.root / session_id, (then, then))


def test_the_store_keeps_its_limits(tmp_path):
    ids = [f"{i:032x}" for i in range(1, 5)]
    st = SnapshotStore(tmp_path / "s", keep_per_session=2)
    for step in (3, 6, 9):
        _write(st, ids[0], step)
    assert st.steps(ids[0]) == [6, 9]  # the latest two
    # keep_s: an unclaimed session whose newest snapshot is older goes; a claimed one stays
    _write(st, ids[1], 1)
    claim = st.claim(ids[1], "test")
    for sid in ids[:2]:
        _age(st, sid, 100)
    aged = SnapshotStore(st.root, keep_s=50)
    assert aged.prune() == [ids[0]] and aged.steps(ids[0]) == [] and aged.steps(ids[1]) == [1]
    # max_bytes: the oldest unclaimed session goes first; a live one never
    size = _write(st, ids[2], 1).bytes
    _age(st, ids[2], 20)  # older than ids[3]'s
    _write(st, ids[3], 1)
    capped = SnapshotStore(st.root, max_bytes=3 * size + 10)
    _write(capped, ids[3], 2)  # needs room: ids[2] (unclaimed, older) goes, ids[1] (claimed) stays
    assert capped.steps(ids[2]) == [] and capped.steps(ids[1]) == [1] and capped.steps(ids[3]) == [1, 2]
    full = SnapshotStore(st.root, max_bytes=capped.usage() + 10)
    claim3 = full.claim(ids[3], "test")
    with pytest.raises(StoreFull, match="snapshot_max_gib"):
        _write(full, ids[1], 2)
    claim.release()
    claim3.release()


def test_a_failed_snapshot_is_counted_and_the_session_goes_on(store):
    # a store too small for any snapshot: the request fails, the session completes
    with FakeWorker("tiny", _options(store, "a", snapshot_max_gib=1e-9)) as w, CharacterClient(w.address) as client:
        conv = client.conversation(image=png(), playout_reports=False)
        rec = Recorder(conv)
        sender = rec.send_speech(speech(0.4, seed=1), speed=4, block=False)
        rec.wait(lambda: len(rec.chunks) >= 2, 30)
        conv.request_snapshot()
        poll(lambda: _metric(w, "characters_snapshot_failures_total", {"kind": "REQUESTED"}) == 1, timeout=30)
        sender.join(30)
        conv.end_audio()
        rec.join(30)
    assert conv.final.state == pb.COMPLETED
    assert not any(isinstance(x, pb.SnapshotEvent) for x in rec.items)
    assert _metric(w, "characters_snapshots_total", {"kind": "REQUESTED"}) == 0


def test_the_async_stream_follows_a_migration(store):
    """AsyncConversationStream (the viewer's and the integrations' stream) resumes a drained
    session on the other worker, replays its audio and hands each step out once."""
    import asyncio

    from characters_jax.client.requests import start_request
    from characters_jax.client.stream import AsyncConversationStream
    from characters_jax.client.targets import aio_channel

    workers = [FakeWorker("tiny", _options(store, f"w{i}")) for i in range(2)]
    seg = speech(1.2, seed=1)

    async def run():
        channel, target = aio_channel(",".join(w.address for w in workers))
        conv = AsyncConversationStream.open(channel, start_request(image=png(), playout_reports=False), balanced=target.balanced)
        items, drained = [], []
        piece = 16 * 20
        async for msg in conv:
            items.append(msg)
            chunks = [x for x in items if isinstance(x, pb.VideoChunk)]
            if isinstance(msg, pb.Session) and len(items) == 1:
                for off in range(0, len(seg), piece):
                    conv.send_audio(seg[off : off + piece])
            if len(chunks) == 4 and not drained:
                first = next(w for w in workers if w.server.options.worker_id == items[0].worker_id)
                drained.append(asyncio.get_running_loop().run_in_executor(None, first.server.drain, 10.0))
            if isinstance(msg, pb.SessionResumed):
                conv.end_speech()
                conv.end_audio()
        await channel.close()
        return conv, items, await drained[0]

    try:
        conv, items, outcome = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        for w in workers:
            w.close()
    assert outcome == "migrated" and items[-1].state == pb.COMPLETED
    assert len(conv.handovers) == 1 and conv.handovers[0]["kind"] == "migration"
    chunks = [x for x in items if isinstance(x, pb.VideoChunk)]
    _check_contiguous(chunks)
    timeline_of(chunks, {1: seg})


def test_a_stream_that_ends_while_the_playout_clock_waits_is_no_underrun():
    """A session's stream that ends after its last frame has played (its end comes after the
    next frame was due: the worker closing a completed session) has finished playing, as a
    drain's hand-over that the lead covers must show no underrun either. A frame that comes
    while the clock waits is one (the control)."""
    clock = PlayoutClock(24, prebuffer_frames=4)

    def waiting():  # every frame received has played, and the clock waits for the next
        with clock._cond:
            return clock.played == clock.received and len(clock._cond._waiters) == 1

    clock.add_frames(4)
    poll(waiting, 10)
    clock.add_frames(1)  # late: an underrun
    poll(lambda: clock.played == 5 and waiting(), 10)
    clock.end()  # the stream ends while the clock waits
    clock.wait_drained(10)
    assert (clock.played, clock.underruns) == (5, 1) and clock.stall_s > 0
