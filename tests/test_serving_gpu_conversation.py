"""A conversation on a GPU worker, as a voice agent drives it: listening video, 3 s of speech
at real-time pace, an interrupt 1 s into its playback, 1 s of reply. Reports what a voice
agent cares about: how long from its first audio to the first speaking chunk, from an
interrupt to its acknowledgement and to the first listening chunk after it, and the
playout underruns.

Set CHARACTERS_CONVERSATION_REPORT=PATH to also write the figures as JSON.
"""

import json
import threading
import time

import pytest

from characters_jax.audio.timeline import Timeline
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving import placement
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.processes import child_env
from serving_harness import Recorder, Worker, png, poll, report_writer, speech

K = pb.SpeechEvent
REPORTS, write_report = report_writer("CHARACTERS_CONVERSATION_REPORT")  # $CHARACTERS_CONVERSATION_REPORT: the figures as JSON


def converse_and_interrupt(w: Worker, cfg) -> dict:
    """One conversation on worker `w`; checks its events and returns the figures."""
    tl = Timeline.from_config(cfg)
    clock = PlayoutClock(cfg.video.fps, prebuffer_frames=8)
    utterance, reply = speech(3.0, seed=21), speech(1.0, seed=22)
    agent = threading.Event()
    with w.client.conversation(image=png(), prompt="a calm voice", playout=clock) as conv:
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 6, timeout=60)  # listening
        t_audio = time.monotonic()
        rec.send_speech(utterance, block=False, stop=agent)
        started = rec.wait_event(K.SPEAKING_STARTED, 1, timeout=60)
        t_started = rec.times[rec.index(started)]
        rec.wait(lambda: any(sp.segment == 1 for c in rec.chunks for sp in c.speech), timeout=60)
        t_speaking = next(t for c, t in zip(rec.chunks, rec.chunk_times()) if any(sp.segment == 1 for sp in c.speech))
        poll(lambda: tl.frame_start(clock.played) >= started.position_samples + 16000, timeout=60)
        t_interrupt = time.monotonic()
        agent.set()
        conv.interrupt()
        played = clock.played
        ack = rec.wait_event(K.INTERRUPTED, timeout=30)
        rec.wait(lambda: len(rec.chunks_after(ack)) >= 1, timeout=30)
        t_listening = rec.times[rec.index(rec.chunks_after(ack)[0])]
        rec.send_speech(reply)
        rec.wait_event(K.PLAYBACK_FINISHED, 2, timeout=60)
        conv.end_audio()
        rec.join(60)
    assert conv.final.state == pb.COMPLETED
    assert ack.position_samples == tl.frame_start(played) and ack.segment == 1
    assert all(sp.segment != 1 for c in rec.chunks_after(ack) for sp in c.speech)
    return {
        "first_audio_to_speaking_started_event_s": round(t_started - t_audio, 3),
        "first_audio_to_first_speaking_chunk_s": round(t_speaking - t_audio, 3),
        "interrupt_to_ack_ms": round(1e3 * (rec.times[rec.index(ack)] - t_interrupt), 1),
        "interrupt_to_first_listening_chunk_ms": round(1e3 * (t_listening - t_interrupt), 1),
        "cut_into_utterance_s": round(ack.segment_samples / 16000, 3),
        "playout_underruns": clock.underruns,
        "playout_stall_s": round(clock.stall_s, 3),
        "gap_after_interrupt_s": round(clock.gap_s, 3),
        "chunks": len(rec.chunks),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["small", "characters-57b"])
def test_a_conversation_on_the_gpu(tmp_path, config):
    cfg = load_config(config)
    try:
        placement.plan(cfg, 1, placement.visible_gpus())
    except placement.PlacementError as err:
        pytest.skip(f"{config} does not fit this machine: {err}")
    w = Worker(tmp_path, config, env=child_env(1, {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}), ready_timeout=600)
    try:
        figures = {"step_ms": w.state()["warmup"]["step_ms"], **converse_and_interrupt(w, cfg)}
    finally:
        w.stop()
    REPORTS[config] = figures
    print(f"\n{config}: " + json.dumps(figures, indent=1))
