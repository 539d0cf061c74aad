"""A migrated session on the real engine equals the uninterrupted one, bitwise on CPU.

Three in-process workers over DiTGenerator (the tiny config, random weights of seed 0, one
CPU device each) and one real decoder process's servicer (VaeRuntime, random weights of
seed 0) on loopback: C (no snapshot store) runs the reference session; A and B share a store,
A takes periodic snapshots every INTERVAL_S while it steps, then drains mid-speech and the
session moves to B. Every chunk's frames and audio equal the reference's, step for step; the
steps, timestamps and sample positions are contiguous; the snapshots' step-loop share (the
export and the state copy dispatched at a boundary) is measured and printed.

The speech (serving_harness.speech, seed 5) goes in one message at the start, with
begin_with_speech and no jitter buffer, so both runs place the same audio on the same steps.
"""

import threading

import numpy as np
import pytest

from characters_jax.client.character_client import CharacterClient
from characters_jax.config import load_config
from characters_jax.decoder.runtime import VaeRuntime
from characters_jax.decoder.service import start_decoder_server
from characters_jax.engine.generator import DiTGenerator
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.composition import build_worker
from characters_jax.serving.decoder_link import DecoderClient
from characters_jax.serving.worker import WorkerOptions
from serving_harness import Recorder, png, speech

CFG = load_config("tiny")
SEED = 0
INTERVAL_S = 0.25
STEP_S = CFG.video.frames_per_step / CFG.video.fps


@pytest.fixture(scope="module")
def decoder():
    server, port = start_decoder_server(VaeRuntime(CFG, seed=SEED), "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    server.stop(grace=0.5).wait()


def _worker(decoder_address, options):
    link = DecoderClient(decoder_address, CFG)
    server = build_worker(DiTGenerator(CFG, tp=1, seed=SEED), link, options)
    server.start()
    return server, link


def _run(target, pcm, on_chunks=None) -> tuple[Recorder, object]:
    """One session: the whole speech at once, then the end of audio; on_chunks(rec) runs
    once its first chunks are in."""
    with CharacterClient(target) as client:
        conv = client.conversation(image=png(seed=4), prompt="a face", seed=3, playout_reports=False, begin_with_speech=True,
                                   jitter_buffer_s=0.0)
        rec = Recorder(conv)
        conv.send_audio(pcm)
        conv.end_speech()
        conv.end_audio()
        if on_chunks is not None:
            on_chunks(rec)
        rec.join(120)
    return rec, conv


def test_a_migrated_session_equals_the_uninterrupted_one_bitwise(decoder, tmp_path):
    pcm = speech(2.0, seed=5)
    opts = {name: WorkerOptions(worker_id=name, snapshot_dir=str(tmp_path / "store"), snapshot_interval_s=INTERVAL_S, drain_timeout_s=30.0)
            for name in ("a", "b")}
    servers = {"c": _worker(decoder, WorkerOptions(worker_id="c"))}
    try:
        reference, ref_conv = _run(servers["c"][0].address, pcm)
        servers.update({name: _worker(decoder, o) for name, o in opts.items()})
        drained = {}

        def drain_mid_speech(rec):
            rec.wait(lambda: len(rec.chunks) >= 6 and sum(isinstance(x, pb.SnapshotEvent) for x in rec.items) >= 1, 120)
            drained["from"] = rec.conv.session.worker_id
            first = servers[drained["from"]][0]
            t = threading.Thread(target=lambda: drained.update(outcome=first.drain(30.0)), daemon=True)
            t.start()
            rec.wait(lambda: any(isinstance(x, pb.SessionResumed) for x in rec.items), 120)
            t.join(60)

        migrated, conv = _run(f"{servers['a'][0].address},{servers['b'][0].address}", pcm, drain_mid_speech)
        first = servers[drained["from"]][0]
        metrics = first.ctx.metrics.registry
        boundary_n = metrics.get_sample_value("characters_snapshot_boundary_seconds_count")
        boundary_s = metrics.get_sample_value("characters_snapshot_boundary_seconds_sum")
        periodic = metrics.get_sample_value("characters_snapshots_total", {"kind": "PERIODIC"}) or 0
    finally:
        for server, link in servers.values():
            server.drain(0.0)
            server.stop(grace=1.0)
            link.close()
    assert ref_conv.final.state == conv.final.state == pb.COMPLETED and drained["outcome"] == "migrated"
    resumed = next(x for x in migrated.items if isinstance(x, pb.SessionResumed))
    assert resumed.from_worker_id == drained["from"] != conv.session.worker_id and 0 < resumed.step < len(migrated.chunks)
    ref, got = reference.chunks, migrated.chunks
    assert [c.step_index for c in got] == list(range(len(got))) and [c.step_index for c in ref] == list(range(len(ref)))
    assert len(got) == len(ref) and len(ref) >= 2.0 / STEP_S, (len(got), len(ref))
    for a, b in zip(ref, got):
        assert b.frame_timestamps_s == a.frame_timestamps_s and b.audio_first_sample == a.audio_first_sample, b.step_index
        assert b.audio_pcm == a.audio_pcm, f"step {b.step_index}: audio differs"
        assert list(b.frames) == list(a.frames), f"step {b.step_index}: frames differ (snapshot at step {resumed.step})"
    assert len({bytes(c.frames[0]) for c in got}) > 1  # the frames move: equality is not of constants
    # periodic snapshots ran while A stepped; their share of the step loop is small
    assert periodic >= 1 and boundary_n >= periodic
    per_boundary = boundary_s / boundary_n
    print(f"snapshot boundary (step loop's share): {per_boundary * 1e3:.2f} ms mean over {boundary_n:.0f}; step period {STEP_S * 1e3:.1f} ms")
    assert per_boundary < STEP_S, per_boundary
