"""The metrics an operator alerts on each move, and every listener binds where it is told.

In-process (the fake model, demo/fakes.py): a conversation moves the session metrics
(first frame, fps while running and 0 when idle, the health gauge, queued speech, silence
inserted into a late segment, the end reason); RPC errors by method and code (the worker's
bad input, and a toy service for UNKNOWN, UNIMPLEMENTED and a stream's error); the pool and
admission gauges; the decoder channel gauge and restart counter; the metrics server binds
the host it is given.
A real `serve` process bound to 127.0.0.2: its metrics and /healthz follow --host (nothing
on 127.0.0.1), killing its decoder moves characters_decoder_restarts_total and
characters_decoder_up, and SIGTERM stops it (0).
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from serving_harness import Recorder, png, poll, speech
from serving_stress import IdleRequests

from characters_jax.audio.timeline import Timeline
from characters_jax.config import load_config
from characters_jax.decoder.service import start_decoder_server
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.client.character_client import CharacterClient
from characters_jax.serving.decoder_link import DecoderClient
from characters_jax.serving.metrics_http import scrape
from characters_jax.demo.fakes import FakeVaeRuntime, FakeWorker
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.serving.metrics import WorkerMetrics
from characters_jax.serving.metrics_http import MetricsHttpServer
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.serving.rpc_handlers import register
from characters_jax.serving.rpc_metrics import RpcMetricsInterceptor
from characters_jax.processes import child_env
from characters_jax.processes import terminate
from characters_jax.serving.worker import WorkerOptions

CFG = load_config("tiny")
TL = Timeline.from_config(CFG)
SPEED = 4  # the playout clock runs 4x real time
K = pb.SpeechEvent
CHARACTER = "CharacterService RPCs"


def value(metrics: WorkerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(CFG, WorkerOptions(idle_timeout_s=30, max_queued_audio_s=20))
    yield w
    w.close()


def test_a_conversation_moves_the_session_metrics(worker):
    m = worker.server.ctx.metrics
    ended_before = value(m, "characters_sessions_ended_by_reason_total", reason="END_OF_AUDIO")
    assert value(m, "characters_fps") == 0 and value(m, "characters_health_serving", service=SERVICE_NAME) == 1
    assert value(m, "characters_health_serving", service="") == 1
    frames_before = value(m, "characters_first_frame_seconds_count")
    with CharacterClient(worker.address) as client, client.conversation(image=png(), playout=PlayoutClock(SPEED * 24, prebuffer_frames=8)) as conv:
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 4)  # listening video
        assert value(m, "characters_first_frame_seconds_count") == frames_before + 1
        assert value(m, "characters_fps") > 0 and value(m, "characters_health_serving", service=SERVICE_NAME) == 0

        rec.send_speech(speech(8.0, seed=1), speed=1000)  # one segment at once, far ahead of its playback
        poll(lambda: value(m, "characters_queued_speech_seconds") > 1.0, timeout=10)
        rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=20)
        assert value(m, "characters_inserted_silence_seconds_total") == 0  # the negative: speech on time

        late = speech(1.0, seed=2)
        half = len(late) // 2
        rec.send_speech(late[:half], speed=1000, end=False)
        start = rec.wait_event(K.SPEAKING_STARTED, 2).position_samples
        # two whole steps of the timeline past the first half: silence went into the open segment
        rec.wait(lambda: any(c.audio_first_sample >= start + half + 2 * TL.max_step_samples for c in rec.chunks))
        rec.send_speech(late[half:], speed=1000)
        stopped = rec.wait_event(K.SPEAKING_STOPPED, 2)
        gap = (stopped.position_samples - start - stopped.segment_samples) / TL.sample_rate
        assert gap >= 2 * TL.step_seconds - 1e-9
        assert value(m, "characters_inserted_silence_seconds_total") == pytest.approx(gap)
        conv.end_audio()
        rec.join()
    poll(lambda: value(m, "characters_health_serving", service=SERVICE_NAME) == 1)
    assert value(m, "characters_sessions_ended_by_reason_total", reason="END_OF_AUDIO") == ended_before + 1
    assert value(m, "characters_fps") == 0 and value(m, "characters_queued_speech_seconds") == 0
    print(f"\nfirst frame {value(m, 'characters_first_frame_seconds_sum') * 1e3:.1f} ms; inserted silence {gap:.3f} s")


def test_rpc_errors_are_counted_by_method_and_code(worker):
    m = worker.server.ctx.metrics

    def errors(method, code):
        return value(m, "characters_rpc_errors_total", method=f"/characters.v1.CharacterService/{method}", code=code)

    before = {k: errors(*k) for k in (("CreateSession", "INVALID_ARGUMENT"), ("GetSession", "NOT_FOUND"), ("Converse", "FAILED_PRECONDITION"))}
    with grpc.insecure_channel(worker.address) as ch:
        stub = characters_pb2_grpc.CharacterServiceStub(ch)
        for call, code in ((lambda: stub.CreateSession(pb.CreateSessionRequest(image=b"not an image"), timeout=10), grpc.StatusCode.INVALID_ARGUMENT),
                           (lambda: stub.GetSession(pb.GetSessionRequest(session_id="nope"), timeout=10), grpc.StatusCode.NOT_FOUND),
                           (lambda: list(stub.Converse(iter([pb.ConverseRequest(end_of_audio=pb.ConverseRequest.EndOfAudio())]), timeout=10)), grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == code
    for key, n in before.items():
        poll(lambda key=key, n=n: errors(*key) == n + 1)  # counted as the RPC ends


def test_unknown_unimplemented_and_stream_errors_are_counted():
    """A toy service behind the interceptor: a handler that raises (UNKNOWN), a stream that
    raises after a message (UNKNOWN), an abort (its code), an OK call (not counted), a
    method nobody serves (UNIMPLEMENTED, as "unknown")."""
    m = WorkerMetrics()

    def boom(request, context):
        raise RuntimeError("a bug")

    def stream(request, context):
        yield b"one"
        raise RuntimeError("a bug mid-stream")

    def refuse(request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2), interceptors=(RpcMetricsInterceptor(m.rpc_errors),))
    register(server, "toy.Toy", {"Boom": grpc.unary_unary_rpc_method_handler(boom), "Stream": grpc.unary_stream_rpc_method_handler(stream),
                                 "Refuse": grpc.unary_unary_rpc_method_handler(refuse), "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for method, kind in (("Boom", ch.unary_unary), ("Refuse", ch.unary_unary), ("Nothing", ch.unary_unary)):
                with pytest.raises(grpc.RpcError):
                    kind(f"/toy.Toy/{method}")(b"x", timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                list(ch.unary_stream("/toy.Toy/Stream")(b"x", timeout=10))
            assert e.value.code() == grpc.StatusCode.UNKNOWN
            assert ch.unary_unary("/toy.Toy/Echo")(b"x", timeout=10) == b"x"
        for method, code in (("/toy.Toy/Boom", "UNKNOWN"), ("/toy.Toy/Stream", "UNKNOWN"), ("/toy.Toy/Refuse", "INVALID_ARGUMENT"), ("unknown", "UNIMPLEMENTED")):
            poll(lambda method=method, code=code: value(m, "characters_rpc_errors_total", method=method, code=code) == 1)
        assert not [s for s in m.rpc_errors.collect()[0].samples if "Echo" in s.labels.get("method", "")]
    finally:
        server.stop(0).wait(5)


def test_pool_and_admission_gauges_follow_the_streams(worker):
    m = worker.server.ctx.metrics
    limits = worker.server.limits
    assert value(m, "characters_rpc_admission_limit", service=CHARACTER) == limits.max_character_rpcs
    assert value(m, "characters_rpc_pool_threads", pool="rpc") == limits.max_character_rpcs + limits.spare_threads
    assert value(m, "characters_rpc_pool_threads", pool="health") == limits.health_threads
    poll(lambda: value(m, "characters_rpc_admitted", service=CHARACTER) == 0)
    release = threading.Event()
    with grpc.insecure_channel(worker.address) as ch:
        calls = [characters_pb2_grpc.CharacterServiceStub(ch).Converse(IdleRequests(release)) for _ in range(3)]
        poll(lambda: value(m, "characters_rpc_admitted", service=CHARACTER) == 3)
        assert value(m, "characters_rpc_pool_busy", pool="rpc") >= 3 and value(m, "characters_rpc_pool_busy", pool="health") == 0
        release.set()  # the streams end empty: INVALID_ARGUMENT
        assert all(c.code() == grpc.StatusCode.INVALID_ARGUMENT for c in calls)
    poll(lambda: value(m, "characters_rpc_admitted", service=CHARACTER) == 0 and value(m, "characters_rpc_pool_busy", pool="rpc") == 0)


def test_decoder_gauge_and_restart_counter():
    m = WorkerMetrics()
    server, port = start_decoder_server(FakeVaeRuntime(CFG), "127.0.0.1:0")
    decoder = DecoderClient(f"127.0.0.1:{port}", CFG)
    try:
        m.watch_decoder(decoder.channel)
        poll(lambda: value(m, "characters_decoder_up") == 1)
        server.stop(0).wait(5)
        poll(lambda: value(m, "characters_decoder_up") == 0)
        m.decoder_started(0)
        assert value(m, "characters_decoder_restarts_total") == 0  # the first start is no restart
        m.decoder_started(1)
        assert value(m, "characters_decoder_restarts_total") == 1
    finally:
        m.unwatch_decoder()
        decoder.close()
        server.stop(0)


def test_the_metrics_server_binds_the_given_host():
    http = MetricsHttpServer(WorkerMetrics().registry, "127.0.0.2", 0)
    try:
        assert http.host == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{http.port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"characters_rpc_errors" in r.read()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", http.port), timeout=5)
    finally:
        http.close()


# -- a real worker process ---------------------------------------------------------------------
def test_serve_binds_metrics_to_its_host_and_reports_decoder_restarts(tmp_path):
    state_file, log_path = tmp_path / "worker.json", tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "characters_jax.cli", "serve", "--config", "tiny", "--host", "127.0.0.2", "--port", "0",
                                 "--set", "serve.metrics_port=0", "--set", "serve.drain_timeout_s=1", "--state-file", str(state_file)],
                                env=child_env(1), stdout=log, stderr=subprocess.STDOUT)
    try:
        poll(lambda: proc.poll() is None and state_file.exists() and "startup_s" in state_file.read_text(), timeout=300, every=0.1)
        state = json.loads(state_file.read_text())
        assert state["metrics_host"] == "127.0.0.2"
        mport = state["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.2:{mport}/healthz", timeout=10) as r:
            assert r.status == 200 and b"SERVING" in r.read()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", mport), timeout=5)
        poll(lambda: scrape("127.0.0.2", mport).get("characters_decoder_up") == 1, timeout=30, every=0.1)
        assert scrape("127.0.0.2", mport)["characters_decoder_restarts_total"] == 0
        terminate_pid(state["decoder_pid"])
        poll(lambda: scrape("127.0.0.2", mport).get("characters_decoder_up") == 0, timeout=30, every=0.05)
        poll(lambda: scrape("127.0.0.2", mport)["characters_decoder_restarts_total"] == 1, timeout=60, every=0.1)
        poll(lambda: scrape("127.0.0.2", mport).get("characters_decoder_up") == 1, timeout=120, every=0.1)
        with CharacterClient(f"127.0.0.2:{state['port']}") as client:  # a session and a bad request, for the scrape below
            assert client.converse(None, speech(1.0), image=png(), realtime=False, open_timeout=30).final_event.state == pb.COMPLETED
            with pytest.raises(grpc.RpcError):
                client.create_session(b"not an image")
        text = urllib.request.urlopen(f"http://127.0.0.2:{mport}/metrics", timeout=10).read().decode()
        shown = ("characters_decoder_up", "characters_decoder_restarts_total", "characters_health_serving", "characters_first_frame_seconds_count",
                 "characters_first_frame_seconds_sum", "characters_sessions_ended_by_reason_total", "characters_rpc_errors_total",
                 "characters_rpc_pool_busy", "characters_rpc_admitted", "characters_rpc_admission_limit", "characters_fps",
                 "characters_queued_speech_seconds", "characters_inserted_silence_seconds_total")
        print("\n" + "\n".join(line for line in text.splitlines() if line.split("{")[0].split(" ")[0] in shown))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(1 + 20) == 0
    finally:
        terminate(proc, 10)
        assert proc.returncode == 0, log_path.read_text()[-3000:]


def terminate_pid(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() - t0 < 10
        time.sleep(0.05)
