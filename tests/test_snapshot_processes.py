"""Sessions that outlive their worker process: two fake-model worker processes
(snapshot_fake_worker.py: the real WorkerServer over the fake generator and decoder) on one
snapshot store, behind the client library's balancer, over loopback.

- SIGTERM on the worker running a session: it migrates (SnapshotEvent MIGRATE), the client
  resumes it on the other worker, the old process exits 0; the stream is contiguous, the
  speech exact, a 24 fps playout clock with the default lead never underruns.
- SIGKILL on the worker running a session with periodic snapshots (every INTERVAL_S): the
  stream fails UNAVAILABLE, the client resumes it from the last snapshot it heard of on the
  other worker, which regenerates the steps the client already holds (SessionResumed says
  how many and how old the snapshot was: what the crash cost) and goes on; nothing the client
  sent is lost (its inputs after the snapshot are replayed) and no step comes twice.
- A burst of SIGTERMs (what a SIGKILLed worker's decoder gets) stops a process whose main
  thread holds its stop event's lock: the signal handler takes no lock.

Speech from serving_harness.speech with seeds 3 and 4.
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from characters_jax.client.character_client import CharacterClient
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.config import load_config
from characters_jax.processes import child_env, terminate
from characters_jax.protos_gen import characters_pb2 as pb
from serving_harness import Recorder, png, speech, timeline_of

SCRIPT = pathlib.Path(__file__).with_name("snapshot_fake_worker.py")
CFG = load_config("tiny")
STEP_S = CFG.video.frames_per_step / CFG.video.fps
INTERVAL_S = 0.5
K = pb.SpeechEvent


class WorkerProcess:
    def __init__(self, tmp: pathlib.Path, worker_id: str, store: pathlib.Path, interval_s: float):
        self.worker_id, self.state_file = worker_id, tmp / f"{worker_id}.json"
        self.log_path = tmp / f"{worker_id}.log"
        self._log = open(self.log_path, "w")
        argv = [sys.executable, str(SCRIPT), "--state-file", str(self.state_file), "--worker-id", worker_id, "--snapshot-dir", str(store),
                "--snapshot-interval", str(interval_s)]
        self.proc = subprocess.Popen(argv, env=child_env(1), stdout=self._log, stderr=subprocess.STDOUT)
        self.address = ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        t0 = time.monotonic()
        while not self.state_file.exists():  # a process start: nothing to wait on but its file
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < timeout, f"{self.worker_id} not ready within {timeout} s"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(self.state_file.read_text())['port']}"

    def stop(self) -> None:
        terminate(self.proc, 20)
        self._log.close()


@pytest.fixture()
def pair(tmp_path):
    store = tmp_path / "store"
    workers = [WorkerProcess(tmp_path, f"w{i}", store, INTERVAL_S) for i in range(2)]
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            w.stop()


def _check_stream(rec, segments) -> None:
    chunks = rec.chunks
    assert [c.step_index for c in chunks] == list(range(len(chunks)))  # each step once
    ts = np.concatenate([c.frame_timestamps_s for c in chunks])
    np.testing.assert_allclose(np.diff(ts), 1 / CFG.video.fps, atol=1e-9)
    for a, b in zip(chunks, chunks[1:]):
        assert b.audio_first_sample == a.audio_first_sample + len(a.audio_pcm) // 2
    timeline_of(chunks, segments)  # every speech sample once, in place
    order = [(e.kind, e.segment) for e in rec.events]
    for kind in (K.SPEAKING_STARTED, K.SPEAKING_STOPPED, K.PLAYBACK_FINISHED):
        assert [s for k, s in order if k == kind] == sorted(segments), order


def _serving(pair, conv):
    return next(w for w in pair if w.worker_id == conv.session.worker_id), next(w for w in pair if w.worker_id != conv.session.worker_id)


def test_sigterm_migrates_the_session_to_the_other_worker(pair):
    seg = speech(2.0, seed=3)
    clock = PlayoutClock(CFG.video.fps)
    with CharacterClient(",".join(w.address for w in pair)) as client:
        conv = client.conversation(image=png(), playout=clock)
        rec = Recorder(conv)
        rec.wait(lambda: conv.session is not None, 60)
        first, second = _serving(pair, conv)
        sender = rec.send_speech(seg, block=False)
        rec.wait(lambda: len(rec.chunks) >= 8, 30)
        first.proc.send_signal(signal.SIGTERM)
        rec.wait(lambda: any(isinstance(x, pb.SessionResumed) for x in rec.items), 60)
        assert first.proc.wait(30) == 0
        sender.join(30)
        rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=30)
        conv.end_audio()
        rec.join(30)
    clock.wait_drained(5)
    assert conv.final.state == pb.COMPLETED
    resumed = next(x for x in rec.items if isinstance(x, pb.SessionResumed))
    assert resumed.from_worker_id == first.worker_id and resumed.regenerated_steps == 0
    assert conv.handovers[0]["kind"] == "migration" and conv.handovers[0]["first_step"] == resumed.next_step
    _check_stream(rec, {1: seg})
    assert clock.underruns == 0, (clock.underruns, clock.stall_s, conv.handovers)


def test_sigkill_recovers_the_session_from_its_last_periodic_snapshot(pair):
    seg1, seg2 = speech(2.4, seed=3), speech(0.6, seed=4)
    with CharacterClient(",".join(w.address for w in pair)) as client:
        conv = client.conversation(image=png(), playout_reports=False)  # paced by the worker's clock
        rec = Recorder(conv)
        rec.wait(lambda: conv.session is not None, 60)
        assert conv.session.snapshot_interval_s == INTERVAL_S
        first, second = _serving(pair, conv)
        sender = rec.send_speech(seg1, block=False)

        def periodic():
            return [x for x in rec.items if isinstance(x, pb.SnapshotEvent) and x.kind == pb.SnapshotEvent.PERIODIC]

        rec.wait(lambda: len(periodic()) >= 2 and rec.chunks[-1].step_index > periodic()[-1].step + 1, 30)
        first.proc.kill()
        held = [c.step_index for c in rec.chunks]
        assert first.proc.wait(10) == -signal.SIGKILL
        rec.wait(lambda: any(isinstance(x, pb.SessionResumed) for x in rec.items), 60)
        sender.join(30)
        rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=30)
        rec.send_speech(seg2)
        rec.wait_event(K.PLAYBACK_FINISHED, 2, timeout=30)
        conv.end_audio()
        rec.join(30)
    assert conv.final.state == pb.COMPLETED
    resumed = next(x for x in rec.items if isinstance(x, pb.SessionResumed))
    last = [x for x in rec.items[: rec.index(resumed)] if isinstance(x, pb.SnapshotEvent)][-1]
    hand = conv.handovers[0]
    assert hand["kind"] == "recovery" and hand["code"] == "UNAVAILABLE" and resumed.from_worker_id == first.worker_id
    assert resumed.step == last.step and resumed.inputs == last.inputs  # the last snapshot the client heard of
    # what the crash cost: the steps held since that snapshot, regenerated without being sent
    received_before = [s for s in held if s >= last.step]
    assert resumed.regenerated_steps >= len(received_before) and resumed.next_step == resumed.step + resumed.regenerated_steps
    assert resumed.regenerated_steps * STEP_S <= INTERVAL_S + 1.0, (resumed.regenerated_steps, INTERVAL_S)
    assert 0 < resumed.snapshot_age_s < 30
    _check_stream(rec, {1: seg1, 2: seg2})


STOP_SCRIPT = """
import logging, os, signal
from characters_jax.processes import stop_on_signals
logging.basicConfig(level=logging.INFO, format="%(message)s")
stop = stop_on_signals()
with stop._cond:  # the main thread holds the event's lock, as stop.wait() does on its way in and out
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
print("stopped" if stop.wait(20) else "not stopped", flush=True)
"""


def test_a_burst_of_sigterms_stops_a_process_whose_main_thread_holds_the_stop_events_lock():
    """The SIGTERM handler of a worker or decoder process takes no lock: a SIGKILLed worker's
    decoder gets its PR_SET_PDEATHSIG SIGTERM with others at once, and a handler that set the
    event itself would wait for the event's lock, held by the main thread it interrupted, and
    the process would never stop. Both signals are logged, the second as a drain's repeat."""
    done = subprocess.run([sys.executable, "-c", STOP_SCRIPT], check=False, env=child_env(1), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "stopped", (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stderr.count("signal received") == 2, done.stderr[-2000:]
