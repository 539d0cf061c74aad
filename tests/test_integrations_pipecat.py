"""The Pipecat video service in real Pipecat pipelines (pipecat-ai 1.14.0), against the
in-process FakeWorker.

Pipecat needs protobuf < 7 and the worker pins 7.36.2, so the pipelines run in the Pipecat
client environment (.venv-pipecat: `make pipecat-env`, or made here on first use; skipped
with pip's reason when the registry cannot be reached) as tests/pipecat_pipeline.py, which
prints its measurements as JSON. The client's stubs there are generated for protobuf 5.29 and
also load on the worker's 7.36 (checked here).
"""

import json
import os
import pathlib
import subprocess

import pytest

from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeWorker
from characters_jax.integrations import client_env
from characters_jax.serving.worker import WorkerOptions

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-pipecat"
SCRIPT = ROOT / "tests" / "pipecat_pipeline.py"


@pytest.fixture(scope="module")
def pipecat_python():
    try:
        return client_env.ensure(VENV, "pipecat")
    except (RuntimeError, subprocess.CalledProcessError) as err:
        pytest.skip(f"the Pipecat client environment could not be made: {err}")


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(load_config("tiny"), WorkerOptions(idle_timeout_s=60))
    yield w
    w.close()


def run_pipeline(python, scenario: str, address: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(python), str(SCRIPT), scenario, address], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n{scenario}: {json.dumps({k: v for k, v in result.items() if k != 'tasks_left'})}")
    assert result["tasks_left"] == [], result["tasks_left"]  # nothing left running
    return result


def test_client_stubs_load_on_both_protobuf_runtimes(pipecat_python):
    probe = ("import google.protobuf as p; from characters_jax.protos_gen import characters_pb2 as pb; "
             "print(p.__version__, pb.ConverseRequest(audio=pb.ConverseRequest.AudioChunk(pcm=b'ab')).SerializeToString().hex())")
    client = subprocess.run([str(pipecat_python), "-c", probe], cwd=VENV, capture_output=True, text=True, check=True).stdout.split()
    assert client[0].startswith("5.29."), client  # the oldest runtime Pipecat accepts
    worker_side = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", f"import sys; sys.path.insert(0, {str(VENV / 'client')!r}); {probe}"],
                                 cwd=VENV, capture_output=True, text=True, check=True).stdout.split()
    assert worker_side[0] == "7.36.2" and worker_side[1] == client[1]
    header = (VENV / "client" / "characters_jax" / "protos_gen" / "characters_pb2.py").read_text()
    assert "Protobuf Python Version: 5.29.0" in header


def test_speech_interrupt_and_playback_in_a_pipeline(pipecat_python, worker, tmp_path):
    r = run_pipeline(pipecat_python, "speak", worker.address, tmp_path)
    assert r["errors"] == []
    assert r["stopped_after_playback"]  # TTSStoppedFrame once the segment played
    assert 0.1 < r["first_latency_s"] < 1.5, r
    assert r["stale_frames"] == 0, r  # nothing of the cut utterance after the interrupt
    assert r["images_after_interrupt"] >= 20  # the video goes on (listening)
    assert len(r["latencies_s"]) == 2


def test_sixty_seconds_on_one_clock_have_no_av_offset_or_drift(pipecat_python, worker, tmp_path):
    r = run_pipeline(pipecat_python, "long", worker.address, tmp_path)
    assert r["errors"] == [] and r["media_s"] >= 60, r
    # each frame leaves with exactly its samples: the audio published before a frame never
    # differs from its presentation time by more than the sample rounding of a frame's share
    # (666 or 667 samples), however long the exchange and however late the pacing under load
    assert r["av_offset_max_s"] <= 1e-3, r


def test_bad_audio_is_an_error_frame_and_other_formats_are_converted(pipecat_python, worker, tmp_path):
    r = run_pipeline(pipecat_python, "bad_audio", worker.address, tmp_path)
    assert r["errors"] == ["character worker: bad TTS audio (3 bytes are not whole s16 samples)"]
    assert r["played_converted"]  # 48 kHz stereo is resampled to 16 kHz mono and spoken


def test_an_unreachable_worker_is_an_error_frame(pipecat_python, tmp_path):
    r = run_pipeline(pipecat_python, "unreachable", "127.0.0.1:1", tmp_path)
    assert len(r["errors"]) == 1 and r["errors"][0].startswith("character worker: UNAVAILABLE"), r
    assert r["images"] == 0
