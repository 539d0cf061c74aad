"""Chaos: the service where it meets the world, through tools/chaos.py's engine.

1. Three worker processes (fake_worker_process.py: the real gRPC server, health, admission
   and session code over the fake generator; they start in seconds) behind the client
   library's balanced target (a comma list: round_robin + health checks), 20 clients: whole
   clips, streams cancelled and channels closed mid-stream or while waiting, damaged PNG and
   DDS images, odd audio byte counts and wrong audio formats (each kind in every phase);
   threads opening and cancelling Health.Watch on fresh channels; a SIGTERM to the worker of
   a live session (that session is cut CANCELLED, DRAIN_TIMEOUT; nothing new lands there; it
   exits 0, is started again on its port and takes sessions again).
2. One real `serve` worker (tiny config; started with the module, so that it compiles while
   1 runs: a real worker takes 35 s to start cold on the 2-core machine) with a few clients,
   its supervised decoder process SIGKILLed under a live session: that session fails
   UNAVAILABLE, the decoder is started again and the worker completes clips afterwards.

Every session ends as its kind expects with a documented code and a message (never UNKNOWN),
within its deadline; every worker answers health within 1 s at the end; each worker's
threads, open files and RSS end within chaos.Tolerance of their figures after the warm-up;
no traceback in the workers' logs; the real worker's metrics count no UNKNOWN or INTERNAL
and hold nothing admitted or live at the end. The schedule (each client's sessions, the
fault's time) derives from SEED, printed with the figures; the assertions are on outcomes:
each fault aims at the worker of an anchor session that opens first, so it always cuts a
live session.
"""

import pathlib
import random
import sys
import threading
import types

import grpc
import pytest
from serving_stress import SCRIPT, chaos

SEED = 20261207
DRAIN_TIMEOUT_S = 1.0


def fake_worker_command(worker_id: str):
    """fake_worker_process.py's command line for a chaos worker (port, state file) -> argv."""
    def command(port: int, state_file: pathlib.Path) -> list[str]:
        return [sys.executable, str(SCRIPT), "--servicer", "worker", "--state-file", str(state_file), "--port", str(port),
                "--worker-id", worker_id, "--drain-timeout", f"{DRAIN_TIMEOUT_S:g}"]
    return command


def serve_worker_command(worker_id: str):
    """`characters-jax serve`'s command line for a chaos worker (chaos.serve_command spells it)."""
    def command(port: int, state_file: pathlib.Path) -> list[str]:
        return chaos.serve_command("tiny", port=port, state_file=state_file, worker_id=worker_id, drain_timeout_s=DRAIN_TIMEOUT_S)
    return command


@pytest.fixture(scope="module")
def real_worker(tmp_path_factory):
    """A real `serve` worker, started (not waited for) when the module starts."""
    w = chaos.WorkerProcess("real", serve_worker_command("real"), tmp_path_factory.mktemp("real")).start(0)
    yield w
    w.stop()


@pytest.fixture
def fake_workers(tmp_path):
    ws = [chaos.WorkerProcess(f"w{i}", fake_worker_command(f"w{i}"), tmp_path / f"w{i}") for i in range(3)]
    try:
        for w in ws:
            w.start(0)
        for w in ws:
            w.wait_ready(120)
        yield ws
    finally:
        for w in ws:
            if w.proc is not None:
                w.stop()


def run(workers, options, faults):
    report = chaos.ChaosRun(workers, options, faults, log=print).run()
    chaos.print_report(report)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed, f"seed {SEED}: {failed}"
    return report


def test_balanced_workers_under_chaos(fake_workers, real_worker):
    """(real_worker starts here, to compile while this test runs.)"""
    options = chaos.ChaosOptions(clients=20, warmup_s=4.0, chaos_s=20.0, seed=SEED, churn_threads=4, open_timeout_s=60.0,
                                 session_budget_s=30.0, restart_timeout_s=60.0, settle_s=1.0, settle_max_s=15.0)
    faults = chaos.fault_schedule(random.Random(f"{SEED}/schedule"), options.chaos_s, ["drain"], lead_s=options.chaos_s)  # the anchor opens first
    report = run(fake_workers, options, faults)
    (drain,) = report["faults"]
    assert drain["anchor"]["code"] == "CANCELLED" and drain["anchor"]["end_reason"] == "DRAIN_TIMEOUT"
    assert drain["exit_code"] == 0 and drain["sessions_after_restart"] >= 1
    assert report["kinds_run"] == sorted(options.kinds)  # each client's first session of a phase: one kind each
    assert report["health_watches"] > 0


def test_decoder_sigkill_under_a_session(real_worker):
    real_worker.wait_ready(300)
    options = chaos.ChaosOptions(clients=4, warmup_s=3.0, chaos_s=8.0, seed=SEED, churn_threads=2, open_timeout_s=60.0,
                                 session_budget_s=30.0, settle_s=1.0, settle_max_s=15.0)
    faults = chaos.fault_schedule(random.Random(f"{SEED}/schedule"), options.chaos_s, ["decoder_kill"], lead_s=options.chaos_s)
    report = run([real_worker], options, faults)
    (kill,) = report["faults"]
    assert kill["anchor"]["code"] == "UNAVAILABLE" and "decoder" in kill["anchor"]["message"]
    assert kill["decoder_restarts"] == 1 and kill["clips_completed_after"] >= 1


def test_the_verdicts_can_fail():
    """What the chaos checks call a failure: an UNKNOWN, a status without a message, a
    traceback or a memory address in one, a session past its deadline, the wrong code for
    its kind, resources past the tolerance."""
    def outcome(kind="bad_png", **kw):
        return chaos.Outcome(0, kind, chaos.KINDS[kind][1], 0.0, **kw)

    assert outcome(code="INVALID_ARGUMENT", message="image: damaged").as_expected
    assert not outcome(code="UNKNOWN", message="Exception calling application: boom").clear
    assert not outcome(code="INVALID_ARGUMENT", message="").clear
    assert not outcome(code="INTERNAL", message="prefill failed").clear
    assert not outcome(code="INVALID_ARGUMENT", message="Traceback (most recent call last): ...").clear
    assert not outcome(code="INVALID_ARGUMENT", message="<object at 0x7f12f33964e0>").clear
    assert not outcome(code="CANCELLED", message="Channel closed!", hung=True).clear
    assert not outcome(code="RESOURCE_EXHAUSTED", message="busy").as_expected
    assert not outcome("clip", code="OK", state="CANCELLED", end_reason="CLIENT_GONE").as_expected
    assert outcome("clip", code="OK", state="COMPLETED", end_reason="END_OF_AUDIO").as_expected
    tol = chaos.Tolerance()
    assert tol.exceeded(chaos.ProcStats(tol.threads + 1, 0, 0)) and tol.exceeded(chaos.ProcStats(0, tol.fds + 1, 0))
    assert tol.exceeded(chaos.ProcStats(0, 0, int(tol.rss_mib * 1024) + 1)) and not tol.exceeded(chaos.ProcStats(-3, 0, -50_000))


class CancelledCall(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Locally cancelled by application!"


class LateRequestThreadCall:
    """A Decode call whose request thread (gRPC's consumer of the request iterator) has not
    yet asked for a request when the call is cancelled; the response stream ends CANCELLED
    once it is."""

    def __init__(self, requests):
        self.requests = requests
        self._cancelled = threading.Event()

    def cancel(self):
        self._cancelled.set()

    def cancelled(self):
        return self._cancelled.is_set()

    def __iter__(self):
        self._cancelled.wait()
        raise CancelledCall()


def test_a_cancelled_decoder_link_ends_its_request_iterator():
    """As its stream ends, the link's reader drains the request queue (to fail unanswered
    state requests), the None that cancel() queued for the request iterator included; the
    iterator must still end, or gRPC's request thread, when it asks after the drain, waits
    in it for ever (a thread per cancelled session). Here that thread asks only after the
    reader is done."""
    from characters_jax.serving.decoder_link import DecoderLink

    calls = []

    def decode(requests, wait_for_ready):
        calls.append(LateRequestThreadCall(requests))
        return calls[-1]

    client = types.SimpleNamespace(stub=types.SimpleNamespace(Decode=decode))
    ended, states = threading.Event(), []
    link = DecoderLink(client, "0" * 32, on_chunk=None, on_error=lambda m: pytest.fail(m), on_end=ended.set)
    link.start()
    link.request_state(0, lambda arrays, error: states.append(error))
    link.cancel()
    link.join(30)
    assert ended.is_set() and states == ["the decoder stream ended before the decoder's state came back"]
    request_thread = threading.Thread(target=lambda: list(calls[0].requests), daemon=True)
    request_thread.start()
    request_thread.join(30)
    assert not request_thread.is_alive(), "the request iterator still waits for a request after its stream ended"
