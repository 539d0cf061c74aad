"""The worker's input jitter buffer: speech streamed at real-time pace with +-20 ms of jitter
(seed 11) plays without silence inside it, and what the buffer costs in latency.

A clip-style session (begin_with_speech; the client's playout clock prebuffers one chunk)
is the tight case: each step runs as soon as its audio is in, so without a buffer a chunk
a little late puts silence into the speech. Three 2 s segments with 0.5 s pauses, 20 ms
chunks, through the in-process FakeWorker (tiny). The same session with the buffer off
(`start.jitter_buffer_s = 0`) is the negative control. Silence inside a segment is read off
its SPEAKING_STOPPED event (where it stopped, less where it started, less its samples), as
the worker's characters_inserted_silence_seconds_total counts it.
"""

import threading
import time

import grpc
import numpy as np
import pytest
from serving_harness import png, speech

from characters_jax.client.character_client import CharacterClient
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.config import load_config
from characters_jax.config.serve import WorkerOptions
from characters_jax.demo.fakes import FakeWorker
from characters_jax.protos_gen import characters_pb2 as pb

SEED = 11
K = pb.SpeechEvent


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(load_config("tiny"), WorkerOptions())  # serve.jitter_buffer_s: -1, adaptive
    yield w
    w.close()


def stream_segments(worker, jitter_buffer_s=None, segments=3, seconds=2.0):
    """Streams the segments at real-time pace; returns (gaps per segment in ms, latency per
    segment: its first chunk sent -> the first chunk carrying it received, s)."""
    rng = np.random.default_rng(SEED)
    first_sent, first_seen, events = {}, {}, []
    with CharacterClient(worker.address) as client, client.conversation(
            image=png(), playout=PlayoutClock(24, prebuffer_frames=4), begin_with_speech=True, jitter_buffer_s=jitter_buffer_s) as conv:
        conv.wait_open()

        def read():
            for item in conv:
                if isinstance(item, pb.SpeechEvent):
                    events.append(item)
                elif isinstance(item, pb.VideoChunk):
                    for sp in item.speech:
                        first_seen.setdefault(sp.segment, time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for n in range(1, segments + 1):
            pcm = speech(seconds, seed=n)
            t0 = time.monotonic()
            for k, off in enumerate(range(0, len(pcm), 320)):
                delay = t0 + (k + 1) * 0.02 + rng.uniform(-0.02, 0.02) - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # the sender's real-time pace
                first_sent.setdefault(n, time.monotonic())
                conv.send_audio(pcm[off: off + 320])
            conv.end_speech()
            time.sleep(0.5)  # a pause between utterances
        conv.end_audio()
        reader.join(60)
    starts = {e.segment: e.position_samples for e in events if e.kind == K.SPEAKING_STARTED}
    gaps = {e.segment: (e.position_samples - starts[e.segment] - e.segment_samples) / 16 for e in events if e.kind == K.SPEAKING_STOPPED}
    return gaps, {n: first_seen[n] - first_sent[n] for n in first_sent}


def test_real_time_speech_with_jitter_plays_without_gaps_and_the_buffer_cost_is_measured(worker):
    gaps, latency = stream_segments(worker)
    control_gaps, control_latency = stream_segments(worker, jitter_buffer_s=0.0)
    added = float(np.median(list(latency.values())) - np.median(list(control_latency.values())))
    print(f"\nadaptive buffer: gaps {gaps} ms, first-chunk latency {[round(v, 3) for v in latency.values()]} s; "
          f"buffer off: gaps {control_gaps} ms, latency {[round(v, 3) for v in control_latency.values()]} s; "
          f"added latency (median) {added * 1e3:.0f} ms")
    assert len(gaps) == 3 and all(g == 0 for g in gaps.values()), gaps
    assert sum(control_gaps.values()) > 0, control_gaps  # the negative control: without the buffer, silence goes in
    assert 0 < added < 0.25


def test_a_session_asks_for_its_own_buffer_within_bounds(worker):
    with CharacterClient(worker.address) as client:
        for bad in (-0.5, 2.5, float("nan")):
            with pytest.raises(grpc.RpcError) as err, client.conversation(image=png(), jitter_buffer_s=bad) as conv:
                conv.wait_open()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "start.jitter_buffer_s: must be -1 (adaptive) or within [0, 2] seconds" in err.value.details()
    with pytest.raises(ValueError, match="jitter_buffer_s"):
        WorkerOptions(jitter_buffer_s=-0.2)
