"""The service on a GPU as a user runs it: `serve --config C` (the placement plans the GPU:
the decoder on a GPU of its own if one is spare, else sharing with explicit budgets), a
session of a few seconds of speech at real-time pace from the client library, frames and
audio checked as in the CPU end-to-end tests, and the figures a user asks for reported:
start-up time, step period against diffusion and decode time per chunk, sustained fps,
both processes' device memory.

Set CHARACTERS_SERVING_REPORT=PATH to also write the figures as JSON.
"""

import json

import numpy as np
import pytest

from characters_jax.audio.timeline import Timeline
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving import placement
from characters_jax.processes import child_env
from serving_harness import Worker, png, report_writer, speech

pytestmark = pytest.mark.gpu
REPORTS, write_report = report_writer("CHARACTERS_SERVING_REPORT")  # $CHARACTERS_SERVING_REPORT: the figures as JSON


@pytest.mark.parametrize("config, seconds, ready_within_s", [("small", 4.0, 120), ("talking", 4.0, 120), ("characters-57b", 4.0, 60)])
def test_a_session_on_the_gpu(tmp_path, config, seconds, ready_within_s):
    cfg = load_config(config)
    gpus = placement.visible_gpus()
    try:
        plan = placement.plan(cfg, 1, gpus)
    except placement.PlacementError as err:
        pytest.skip(f"{config} does not fit this machine: {err}")
    # A fresh compilation cache: a cold start, as on a new machine; then a restart with it.
    env = child_env(1, {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")})
    w = Worker(tmp_path / "cold", config, env=env, ready_timeout=600)
    try:
        state = w.state()
        pcm = speech(seconds, seed=7)
        session = w.client.create_session(png(), prompt="a calm voice", seed=11)
        result = w.client.converse(session.session_id, pcm, realtime=True)
        summary = result.summary(cfg.video.fps)
        final = w.client.get_session(session.session_id)
    finally:
        w.stop()
    restart = Worker(tmp_path / "warm", config, env=env, ready_timeout=600)
    restart_s = restart.state()["startup_s"]
    restart.stop()
    tl = Timeline.from_config(cfg)
    steps = tl.steps_for(len(pcm))
    assert final.state == pb.COMPLETED and result.final_event.state == pb.COMPLETED
    assert [c.step_index for c in result.chunks] == list(range(steps))
    frames = np.stack(result.frames)
    assert frames.shape == (steps * cfg.video.frames_per_step, cfg.video.height, cfg.video.width, 3)
    assert frames.std() > 1.0, "frames are constant"
    audio = result.audio
    assert np.array_equal(audio, pcm)
    report = {
        "placement": state["placement"],
        "startup_s": state["startup_s"],
        "restart_with_compile_cache_s": restart_s,
        "warmup": state["warmup"],
        "decoder_memory": state.get("decoder_memory"),
        **{k: summary[k] for k in ("frames", "sustained_fps", "playout_underruns", "step_ms_p50", "step_ms_p99",
                                   "decode_ms_p50", "period_ms_p50", "period_ms_p99", "audio_to_frame_latency_s_p50") if k in summary},
    }
    REPORTS[config] = report
    print(f"\n{config}: " + json.dumps(report, indent=1))
    assert state["startup_s"] < ready_within_s, f"ready after {state['startup_s']} s"
    # Both processes on the GPU, each within the pool the placement gave it.
    gen_mem, dec_mem = state["warmup"]["memory"], state["decoder_memory"]
    assert gen_mem.get("bytes_limit") and dec_mem.get("bytes_limit"), (gen_mem, dec_mem)
    assert gen_mem["bytes_limit"] <= plan.generator_fraction * gpus[0].total_bytes * 1.01
    assert dec_mem["bytes_limit"] <= plan.decoder_fraction * gpus[0].total_bytes * 1.01
    assert dec_mem["peak_bytes_in_use"] <= dec_mem["bytes_limit"]
    if state["warmup"]["real_time"]:
        assert summary["sustained_fps"] >= 23.5, summary
    else:
        # Not real time: the stream runs at the generator's speed, and says so honestly.
        capacity = state["warmup"]["fps_capacity"]
        assert summary["sustained_fps"] <= 1.1 * capacity, summary
        assert summary["period_ms_p50"] >= 0.9 * state["warmup"]["step_ms"], summary
