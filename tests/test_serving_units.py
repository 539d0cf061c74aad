"""Service pieces without processes: images, the session slot, the playout clock, targets,
limits, message sizes, health."""

import io
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from PIL import Image

from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.wire.channel_options import chunk_message_bytes, worker_server_options
from characters_jax.client.character_client import parse_target
from characters_jax.serving.conversation import Limits, PlaybackPosition
from characters_jax.serving.health import WorkerHealth
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.serving.worker import WorkerOptions, resolve_limits

from characters_jax.wire.images import ImageError, ImageLimits, load_reference_image
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.serving.session import SessionTable, SlotBusy
from characters_jax.decoder.tensors import tensor_from_proto, tensor_to_proto


LIMITS = Limits(60.0, 10.0)


def _png(w, h, mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, (w, h), 128).save(buf, format="PNG")
    return buf.getvalue()


def test_reference_image_is_cropped_and_resized():
    img = Image.new("RGB", (300, 100), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 100, 100))  # the left third is blue: cropped away
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = load_reference_image(buf.getvalue(), 128, 128)
    assert out.shape == (128, 128, 3) and out.dtype == np.uint8
    assert out[64, 64].tolist() == [255, 0, 0]
    assert load_reference_image(_png(50, 40, "L"), 96, 64).shape == (64, 96, 3)


@pytest.mark.parametrize("data,limits,msg", [
    (b"", ImageLimits(), "empty"),
    (b"GIF89a nonsense", ImageLimits(), "not a readable image"),
    (_png(64, 64), ImageLimits(max_bytes=100), "over the limit of 100 bytes"),
    (_png(64, 64), ImageLimits(max_pixels=1000), "4096 pixels is over the limit"),
])
def test_bad_images_are_named(data, limits, msg):
    with pytest.raises(ImageError, match=msg):
        load_reference_image(data, 128, 128, limits)


def test_one_live_session_and_legal_transitions():
    events = []
    table = SessionTable(lambda rec, old, idle: events.append((old, rec.state, idle)), keep_finished=2)
    a = table.reserve(1, 0, LIMITS)
    with pytest.raises(SlotBusy):
        table.reserve(2, 0, LIMITS)
    assert not table.transition(a, "RUNNING")  # NOT_READY cannot run
    assert table.transition(a, "READY") and table.transition(a, "RUNNING")
    assert table.transition(a, "CANCELLED", grpc.StatusCode.CANCELLED, "bye")
    assert not table.transition(a, "COMPLETED")  # terminal is final
    assert table.live is None and table.get(a.session_id) is a
    assert events[-1] == ("RUNNING", "CANCELLED", True)
    ids = []
    for _ in range(3):
        r = table.reserve(0, 0, LIMITS)
        table.transition(r, "FAILED")
        ids.append(r.session_id)
    assert table.get(a.session_id) is None and table.get(ids[-1]) is not None  # bounded history


def test_playout_clock_counts_underruns():
    reports = []
    clock = PlayoutClock(fps=100, prebuffer_frames=2, on_report=lambda p, u: reports.append((p, u)))
    clock.add_frames(2)
    time.sleep(0.1)  # plays 2 frames then starves
    clock.add_frames(2)
    clock.end()
    clock.wait_drained(2)
    assert clock.played == 4 and clock.underruns == 1 and reports[-1] == (4, 1)


def test_a_report_ahead_of_the_recorded_send_is_kept():
    """gRPC can hand a chunk to the client, and its report come back, before the stream
    records the chunk as sent: the report counts once the send is recorded."""
    clock = PlaybackPosition(24, reports=True)
    clock.on_sent(4, now=0.0)
    clock.report(4, 0)
    assert clock.played(0.1) == 4.0
    clock.report(8, 0)  # the client played a chunk the stream has not recorded yet
    assert clock.played(0.2) == 4.0
    clock.on_sent(4, now=0.3)
    assert clock.played(0.3) == 8.0
    clock.truncate(6, now=0.4)  # an interrupt at frame 6
    assert clock.played(0.4) == 6.0 and clock.sent == 6


def test_tensor_roundtrip_and_checks():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert np.array_equal(tensor_from_proto(tensor_to_proto(x), (2, 3, 4)), x)
    with pytest.raises(ValueError, match="expected shape"):
        tensor_from_proto(tensor_to_proto(x), (3, 2, 4))


def test_ready_expiry_never_touches_a_running_session():
    """The READY timer fires late: a session that went RUNNING meanwhile is left alone."""
    table = SessionTable(lambda rec, old, idle: None)
    rec = table.reserve(seed=0, prompt_tokens=0, limits=LIMITS)
    assert table.transition(rec, "READY")
    assert table.transition(rec, "RUNNING")
    assert not table.transition(rec, "CANCELLED", only_from="READY")
    assert rec.state == "RUNNING"
    assert table.transition(rec, "CANCELLED")


def test_playout_flush_is_a_gap_not_an_underrun():
    clock = PlayoutClock(fps=200, prebuffer_frames=2)
    clock.add_frames(8)
    time.sleep(0.02)
    played = clock.flush()  # an interrupt: the frames not shown are dropped
    assert played < 8 and clock.received == played
    time.sleep(0.05)
    clock.add_frames(2)
    clock.end()
    clock.wait_drained(2)
    assert clock.played == played + 2 and clock.underruns == 0 and clock.gap_s > 0.03


def test_targets_one_worker_a_list_or_a_dns_name():
    assert parse_target("127.0.0.1:50051") == parse_target("127.0.0.1:50051", balanced=False)
    assert not parse_target("localhost:1").balanced
    t = parse_target("127.0.0.1:1, localhost:2,")
    assert t.balanced and t.uri == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert parse_target("[::1]:5,[::1]:6").uri == "ipv6:[::1]:5,[::1]:6"
    assert parse_target("dns:///workers.example:50051").balanced
    config = dict(parse_target("dns:///w:1").options)["grpc.service_config"]
    assert '"round_robin"' in config and SERVICE_NAME in config and '"waitForReady": true' in config and "RESOURCE_EXHAUSTED" in config
    assert "grpc.service_config" not in dict(parse_target("w:1").options)
    for bad, msg in (("", "empty"), ("nohost", "host:port"), ("127.0.0.1:1,b", "host:port"), ("no-such-host.invalid:1,127.0.0.1:2", "cannot resolve"), ("127.0.0.1:1,[::1]:2", "mixes")):
        with pytest.raises(ValueError, match=msg):
            parse_target(bad)


def test_client_limits_are_capped_by_the_worker():
    opts = WorkerOptions(max_duration_s=600, idle_timeout_s=60)
    assert resolve_limits(pb.SessionLimits(), opts) == Limits(600, 60)
    assert resolve_limits(pb.SessionLimits(max_duration_s=30, idle_timeout_s=120), opts) == Limits(30, 60)
    for bad in (pb.SessionLimits(max_duration_s=-1), pb.SessionLimits(idle_timeout_s=float("nan"))):
        with pytest.raises(ValueError, match="limits"):
            resolve_limits(bad, opts)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        WorkerOptions(idle_timeout_s=0)


def test_message_limits_follow_the_video_size():
    tiny, big = load_config("tiny"), load_config("tiny").replace(video={"height": 1088, "width": 1920})
    one_chunk = 4 * 1088 * 1920 * 3
    assert one_chunk > 16 << 20  # what a fixed 16 MiB limit refused
    assert one_chunk < chunk_message_bytes(big) < one_chunk + (1 << 20)
    assert dict(worker_server_options(big, 4 << 20))["grpc.max_send_message_length"] == chunk_message_bytes(big)
    assert chunk_message_bytes(tiny) < 1 << 20
    assert dict(worker_server_options(tiny, 4 << 20))["grpc.max_receive_message_length"] > 4 << 20


def test_health_follows_the_slot_and_draining_is_final():
    idle = [True]
    h = WorkerHealth(lambda: idle[0])

    def status(name):
        return h.servicer.Check(health_pb2.HealthCheckRequest(service=name), None).status

    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert (status(""), status(SERVICE_NAME)) == (N, N)  # not started
    h.ready()
    assert (status(""), status(SERVICE_NAME)) == (S, S)
    idle[0] = False
    h.refresh()
    assert (status(""), status(SERVICE_NAME)) == (S, N)
    idle[0] = True
    h.drain()
    h.refresh()
    assert (status(""), status(SERVICE_NAME)) == (N, N)
