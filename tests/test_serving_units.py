"""Service pieces without processes: images, the session slot, pacing signals, playout clock."""

import io
import threading
import time

import grpc
import numpy as np
import pytest
from PIL import Image

from characters_jax.serving.images import ImageError, ImageLimits, load_reference_image
from characters_jax.serving.playout import PlayoutClock
from characters_jax.serving.session import SessionTable, SlotBusy
from characters_jax.serving.signals import SessionSignals
from characters_jax.serving.tensors import tensor_from_proto, tensor_to_proto


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
    a = table.reserve(1, 0)
    with pytest.raises(SlotBusy):
        table.reserve(2, 0)
    assert not table.transition(a, "RUNNING")  # NOT_READY cannot run
    assert table.transition(a, "READY") and table.transition(a, "RUNNING")
    assert table.transition(a, "CANCELLED", grpc.StatusCode.CANCELLED, "bye")
    assert not table.transition(a, "COMPLETED")  # terminal is final
    assert table.live is None and table.get(a.session_id) is a
    assert events[-1] == ("RUNNING", "CANCELLED", True)
    ids = []
    for _ in range(3):
        r = table.reserve(0, 0)
        table.transition(r, "FAILED")
        ids.append(r.session_id)
    assert table.get(a.session_id) is None and table.get(ids[-1]) is not None  # bounded history


def test_step_waits_for_its_audio_and_for_the_playout_lead():
    sig = SessionSignals(fps=24, frames_per_step=4, playout_reports=True)
    steps_for = lambda n: -(-(-(-n * 24 // 16000)) // 4)
    results = []

    def run(step, end):
        results.append(sig.wait_for_step(step, end, steps_for, lead=2))

    t = threading.Thread(target=run, args=(0, 2666))
    t.start()
    time.sleep(0.05)
    assert results == []  # no audio yet
    sig.add_audio(b"\0\0" * 2666)
    t.join(1)
    assert results == ["run"]
    sig.add_audio(b"\0\0" * 20000)
    assert sig.wait_for_step(1, 5333, steps_for, lead=2) == "run"
    t = threading.Thread(target=run, args=(2, 8000))
    t.start()
    time.sleep(0.05)
    assert results == ["run"]  # two chunks ahead of playout: wait
    sig.report_playout(4, 0)
    t.join(1)
    assert results == ["run", "run"]
    sig.end_audio()
    assert sig.wait_for_step(9, 26666, steps_for, lead=100) == "done"
    sig.cancel(grpc.StatusCode.CANCELLED, "x")
    assert sig.wait_for_step(3, 10666, steps_for, lead=2) == "cancelled"


def test_estimated_playout_clock_paces_without_reports():
    sig = SessionSignals(fps=24, frames_per_step=4, playout_reports=False)
    sig.add_audio(b"\0\0" * 32000)
    steps_for = lambda n: 12
    assert sig.wait_for_step(0, 1, steps_for, lead=1) == "run"
    sig.chunk_sent()
    t0 = time.monotonic()
    assert sig.wait_for_step(2, 1, steps_for, lead=1) == "run"  # until playout passes step 1
    assert 0.16 < time.monotonic() - t0 < 0.5


def test_silent_client_stalls_instead_of_holding_the_worker():
    sig = SessionSignals(fps=24, frames_per_step=4, playout_reports=True, audio_timeout_s=0.2)
    t0 = time.monotonic()
    assert sig.wait_for_step(0, 2666, lambda n: 1, lead=3) == "stalled"
    assert 0.15 < time.monotonic() - t0 < 1.0


def test_playout_clock_counts_underruns():
    reports = []
    clock = PlayoutClock(fps=100, prebuffer_frames=2, on_report=lambda p, u: reports.append((p, u)))
    clock.add_frames(2)
    time.sleep(0.1)  # plays 2 frames then starves
    clock.add_frames(2)
    clock.end()
    clock.wait_drained(2)
    assert clock.played == 4 and clock.underruns == 1 and reports[-1] == (4, 1)


def test_tensor_roundtrip_and_checks():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert np.array_equal(tensor_from_proto(tensor_to_proto(x), (2, 3, 4)), x)
    with pytest.raises(ValueError, match="expected shape"):
        tensor_from_proto(tensor_to_proto(x), (3, 2, 4))


def test_ready_expiry_never_touches_a_running_session():
    """The READY timer fires late: a session that went RUNNING meanwhile is left alone."""
    table = SessionTable(lambda rec, old, idle: None)
    rec = table.reserve(seed=0, prompt_tokens=0)
    assert table.transition(rec, "READY")
    assert table.transition(rec, "RUNNING")
    assert not table.transition(rec, "CANCELLED", only_from="READY")
    assert rec.state == "RUNNING"
    assert table.transition(rec, "CANCELLED")
