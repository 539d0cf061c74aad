"""End to end over loopback: a real worker process (tiny config, real DiTGenerator) with its
supervised decoder process, driven by the client library.

One worker serves the whole module (start-up compiles once); the SIGTERM test runs last
and ends it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from characters_jax.audio.timeline import Timeline
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.server import child_env
from serving_harness import Worker, png, speech

CFG = load_config("tiny")
TL = Timeline.from_config(CFG)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker"))
    yield w
    w.stop()


def quick_session(w: Worker, seconds=0.5, prompt="hi", **kw):
    s = w.client.create_session(png(), prompt=prompt, seed=3)
    return s, w.client.converse(s.session_id, speech(seconds), realtime=False, **kw)


def code_of(excinfo):
    return excinfo.value.code()


def test_full_session(worker):
    pcm = speech(1.5)
    s = worker.client.create_session(png(), prompt="a calm voice", seed=5)
    assert s.state == pb.READY and (s.width, s.height, s.fps, s.frames_per_step) == (128, 128, 24, 4)
    assert worker.serving() == "NOT_SERVING"
    health_during = []
    res = worker.client.converse(s.session_id, pcm, realtime=True, on_chunk=lambda c: health_during.append(worker.serving()) if c.step_index == 2 else None)
    steps = TL.steps_for(len(pcm))
    assert [c.step_index for c in res.chunks] == list(range(steps))
    assert all(len(c.frames) == 4 and c.width == 128 and c.height == 128 and all(len(f) == 128 * 128 * 3 for f in c.frames) for c in res.chunks)
    ts = np.concatenate([c.frame_timestamps_s for c in res.chunks])
    np.testing.assert_allclose(np.diff(ts), 1 / 24, atol=1e-9)
    assert ts[0] == 0.0
    assert [c.first_frame_index for c in res.chunks] == [4 * i for i in range(steps)]
    assert np.array_equal(res.audio, pcm)  # the slices add up to the input exactly
    assert [c.audio_first_sample for c in res.chunks] == [TL.step_span(i)[0] for i in range(steps)]
    assert res.final_event.state == pb.COMPLETED
    assert health_during == ["NOT_SERVING"]
    assert worker.client.get_session(s.session_id).state == pb.COMPLETED
    assert worker.client.get_session(s.session_id).frames == 4 * steps
    summary = res.summary(24)
    assert summary["playout_underruns"] <= 2, summary  # CI machines are noisy; the demo reports the count
    assert 0 < summary["step_ms_p50"] < 166.7
    worker.wait_idle()
    m = worker.metrics()
    assert m["characters_step_seconds_count"] >= steps and m['characters_sessions_ended_total{state="COMPLETED"}'] >= 1
    assert "characters_fps" in m and "characters_playout_underruns_total" in m and 'characters_sessions{state="RUNNING"}' in m


def test_step_loop_keeps_a_bounded_lead_over_playout(worker):
    """Audio uploaded at once, playout in real time: chunks come paced by the playout clock."""
    pcm = speech(1.5, seed=1)
    s = worker.client.create_session(png(), seed=1)
    res = worker.client.converse(s.session_id, pcm, realtime=True, send_realtime=False)
    t = np.asarray(res.recv_times) - res.recv_times[0]
    lead, step_s = 3, 4 / 24
    # chunk k may not arrive before playout has reached chunk k - lead (minus a little slack)
    for k in range(len(t)):
        assert t[k] >= (k - lead - 1) * step_s - 0.05, (k, t[k])
    assert t[-1] >= (len(t) - lead - 2) * step_s
    assert res.final_event.state == pb.COMPLETED


def test_bad_input_gets_clear_status_and_worker_stays_healthy(worker):
    c = worker.client
    with pytest.raises(grpc.RpcError) as e:
        c.create_session(b"this is not an image")
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "not a readable image" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        c.create_session(b"\x89PNG" + b"\0" * (4 << 20))
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        c.create_session(png(), prompt="x" * 33)
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        c.get_session("no-such-session")
    assert code_of(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        c.converse("no-such-session", speech(0.2), realtime=False)
    assert code_of(e) == grpc.StatusCode.NOT_FOUND
    assert worker.serving() == "SERVING"

    s = c.create_session(png())
    with pytest.raises(grpc.RpcError) as e:
        c.create_session(png())
    assert code_of(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
    for kw, needle in (({"sample_rate": 44100}, "sample rate 44100"), ({"channels": 2}, "2 channels"), ({"encoding": pb.AudioFormat.PCM_F32LE}, "encoding f32le")):
        with pytest.raises(grpc.RpcError) as e:
            c.converse(s.session_id, speech(0.2), realtime=False, **kw)
        assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
        assert c.get_session(s.session_id).state == pb.READY  # a refused stream leaves it READY
    res = c.converse(s.session_id, speech(0.3), realtime=False)
    assert res.final_event.state == pb.COMPLETED and len(res.chunks) == TL.steps_for(int(0.3 * 16000))
    with pytest.raises(grpc.RpcError) as e:
        c.converse(s.session_id, speech(0.2), realtime=False)
    assert code_of(e) == grpc.StatusCode.FAILED_PRECONDITION and "not READY" in e.value.details()

    s = c.create_session(png())
    with pytest.raises(grpc.RpcError) as e:
        c.converse(s.session_id, b"\x01\x02\x03", realtime=False)
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and "whole number" in e.value.details()
    assert c.get_session(s.session_id).state == pb.FAILED
    worker.wait_idle()
    s = c.create_session(png())
    assert c.close_session(s.session_id).state == pb.CANCELLED
    worker.wait_idle()
    _, res = quick_session(worker)
    assert res.final_event.state == pb.COMPLETED
    assert worker.proc.poll() is None and worker.serving("") == "SERVING"


def test_reflection_lists_the_services(worker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(worker.client.channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"characters.v1.CharacterService", "grpc.health.v1.Health"} <= names


def test_client_disconnect_frees_the_worker_within_a_second(worker):
    s = worker.client.create_session(png())
    res = worker.client.converse(s.session_id, speech(3.0), realtime=True, stop_after_chunks=2)
    t_cancel = time.monotonic()
    assert len(res.chunks) == 2
    freed = worker.wait_idle(timeout=1.0)
    assert time.monotonic() - t_cancel < 1.0, freed
    assert worker.client.get_session(s.session_id).state == pb.CANCELLED
    _, res = quick_session(worker)
    assert res.final_event.state == pb.COMPLETED


def test_killing_the_decoder_fails_the_session_and_it_is_restarted(worker):
    pid = worker.state()["decoder_pid"]
    s = worker.client.create_session(png())
    with pytest.raises(grpc.RpcError) as e:
        worker.client.converse(s.session_id, speech(3.0), realtime=True, on_chunk=lambda c: os.kill(pid, signal.SIGKILL) if c.step_index == 1 else None)
    assert code_of(e) == grpc.StatusCode.UNAVAILABLE and "decoder" in e.value.details()
    rec = worker.client.get_session(s.session_id)
    assert rec.state == pb.FAILED and rec.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert worker.proc.poll() is None and worker.serving() == "SERVING"
    t0 = time.monotonic()
    while worker.state().get("decoder_pid") == pid:
        assert time.monotonic() - t0 < 30, "decoder not restarted"
        time.sleep(0.1)
    _, res = quick_session(worker)  # waits for the restarted decoder to be ready
    assert res.final_event.state == pb.COMPLETED and len(res.chunks) == TL.steps_for(8000)


def test_twenty_sessions_do_not_grow_programs_or_memory(worker):
    rng = np.random.default_rng(0)
    lengths = [0, 12, 32] + list(rng.integers(0, 33, size=17))
    seen = []
    for i, n in enumerate(lengths):
        _, res = quick_session(worker, seconds=0.3, prompt="p" * int(n))
        assert res.final_event.state == pb.COMPLETED
        worker.wait_idle()
        m = worker.metrics()
        seen.append((m["characters_compiled_programs"], m["characters_generator_programs"], m["characters_live_device_bytes"], m["characters_live_device_arrays"]))
    assert all(x == seen[2] for x in seen[2:]), seen
    assert seen[-1][0] > 0 and seen[-1][1] > 0 and seen[-1][2] > 0, seen


def test_talk_command(worker, tmp_path):
    from characters_jax.audio.pcm import write_wav
    from characters_jax.serving.mp4 import probe_mp4

    (tmp_path / "face.png").write_bytes(png())
    write_wav(tmp_path / "ok.wav", speech(0.5))
    write_wav(tmp_path / "bad.wav", speech(0.5), sample_rate=44100)
    base = [sys.executable, "-m", "characters_jax.cli", "talk", "--server", worker.address, "--image", str(tmp_path / "face.png"), "--fast"]
    bad = subprocess.run(base + ["--audio", str(tmp_path / "bad.wav"), "--out", str(tmp_path / "bad.mp4")], capture_output=True, text=True, timeout=120, env=child_env(1))
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "44100" in bad.stderr
    worker.wait_idle(timeout=2)  # talk closed the session the worker refused to stream
    ok = subprocess.run(base + ["--audio", str(tmp_path / "ok.wav"), "--out", str(tmp_path / "ok.mp4"), "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120, env=child_env(1))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "sustained fps" in ok.stdout and json.loads((tmp_path / "r.json").read_text())["session_state"] == "COMPLETED"
    probe = probe_mp4(tmp_path / "ok.mp4")
    assert probe["video_frames"] == 4 * TL.steps_for(8000) and probe["audio_streams"] == 1


def test_sigterm_cancels_the_live_session_and_stops(worker):
    s = worker.client.create_session(png())
    decoder_pid = worker.state()["decoder_pid"]
    with pytest.raises(grpc.RpcError) as e:
        worker.client.converse(s.session_id, speech(3.0), realtime=True, on_chunk=lambda c: worker.proc.send_signal(signal.SIGTERM) if c.step_index == 1 else None)
    assert code_of(e) == grpc.StatusCode.CANCELLED and "shutting down" in e.value.details()
    assert worker.proc.wait(20) == 0
    t0 = time.monotonic()
    while os.path.exists(f"/proc/{decoder_pid}") and open(f"/proc/{decoder_pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() - t0 < 10, "decoder still running"
        time.sleep(0.1)
    log = worker.log.name
    worker.log.flush()
    lines = [json.loads(x) for x in open(log) if x.startswith("{")]
    assert any(x["msg"] == "session ended" and x.get("state") == "CANCELLED" and x.get("session_id") == s.session_id for x in lines)
