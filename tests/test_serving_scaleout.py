"""Scale-out with gRPC's own balancing, end to end: three real worker processes (tiny
config) behind one comma-list target (round_robin, health checks on
characters.v1.CharacterService, waitForReady, retries of RESOURCE_EXHAUSTED), no router of
our own. Six clients at once; a worker drained by SIGTERM in the middle of a session.

The first worker starts alone (it fills the run's compilation cache), the other two then
start together.
"""

import signal
import threading
import time

import grpc
import pytest

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.playout_clock import PlayoutClock
from serving_harness import Recorder, Worker, png, poll, speech


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    def start(i, wait):
        return Worker(tmp_path_factory.mktemp(f"w{i}"), args=("--set", "serve.drain_timeout_s=30", "--set", f"serve.worker_id=w{i}"), wait=wait)

    ws = [start(0, True)]
    ws += [start(i, False) for i in (1, 2)]
    try:
        for w in ws[1:]:
            w.wait_ready()
        yield ws
    finally:
        for w in ws:
            w.terminate()
        for w in ws:
            w.stop()


def run_clip(target, seed, seconds, results, errors):
    try:
        with CharacterClient(target) as c:
            t0 = time.monotonic()
            res = c.converse(None, speech(seconds, seed=seed), image=png(seed=seed), realtime=True)
            results.append({"worker": res.session.worker_id, "asked": t0, "opened": res.open_time, "ended": res.recv_times[-1],
                            "state": res.final_event.state, "underruns": res.underruns, "frames": len(res.frames)})
    except grpc.RpcError as err:
        errors.append((err.code(), err.details()))


def intervals_do_not_overlap(results):
    by_worker = {}
    for r in results:
        by_worker.setdefault(r["worker"], []).append((r["opened"], r["ended"]))
    for runs in by_worker.values():
        runs.sort()
        assert all(b[0] >= a[1] for a, b in zip(runs, runs[1:])), runs
    return by_worker


def refusals(w) -> float:
    return sum(v for k, v in w.metrics().items() if k.startswith("characters_sessions_refused_total"))


def test_six_clients_on_three_workers(workers):
    target = ",".join(w.address for w in workers)
    results, errors = [], []
    threads = [threading.Thread(target=run_clip, args=(target, i, 1.0, results, errors)) for i in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.monotonic() - t0
    assert errors == [], errors  # no NOT_FOUND, no RESOURCE_EXHAUSTED that outlived the retries
    assert len(results) == 6 and all(r["state"] == pb.COMPLETED and r["frames"] == 24 for r in results)
    by_worker = intervals_do_not_overlap(results)  # never two live sessions on one worker
    assert sorted(by_worker) == ["w0", "w1", "w2"] and all(len(v) == 2 for v in by_worker.values())
    waits = sorted(r["opened"] - r["asked"] for r in results)
    first_end = min(r["ended"] for r in results)
    late = sorted(results, key=lambda r: r["opened"])[3:]
    assert all(r["opened"] >= first_end - 0.05 for r in late)  # the extra three waited for a worker to free
    print(f"\n6 clients on 3 workers: {wall:.2f} s; waits for a worker {[round(x, 2) for x in waits]} s; "
          f"refusals (retried) {[refusals(w) for w in workers]}; underruns {[r['underruns'] for r in results]}")


def test_sigterm_drains_a_worker_mid_session(workers):
    target = ",".join(w.address for w in workers)
    by_id = {f"w{i}": w for i, w in enumerate(workers)}
    with CharacterClient(target) as c:
        conv = c.conversation(image=png(), playout=PlayoutClock(24, prebuffer_frames=8))
        rec = Recorder(conv)
        rec.wait(lambda: len(rec.chunks) >= 2)
        draining = by_id[conv.session.worker_id]
        rec.send_speech(speech(2.0, seed=9), block=False)
        rec.wait_event(pb.SpeechEvent.SPEAKING_STARTED, 1)
        t_term = time.monotonic()
        draining.proc.send_signal(signal.SIGTERM)
        poll(lambda: draining.serving() == "NOT_SERVING", timeout=1.0)
        results, errors = [], []
        threads = [threading.Thread(target=run_clip, args=(target, 20 + i, 1.0, results, errors)) for i in range(3)]
        for t in threads:
            t.start()
        rec.wait_event(pb.SpeechEvent.PLAYBACK_FINISHED, 1, timeout=10)
        conv.end_audio()
        rec.join()
        for t in threads:
            t.join(60)
    assert conv.final.state == pb.COMPLETED and conv.final.end_reason == pb.END_OF_AUDIO  # the live session finished
    assert draining.proc.wait(30) == 0 and time.monotonic() - t_term < 30
    assert errors == [] and len(results) == 3 and all(r["state"] == pb.COMPLETED for r in results)
    assert draining.state()["worker_id"] not in {r["worker"] for r in results}  # nothing new landed there
    intervals_do_not_overlap(results)
