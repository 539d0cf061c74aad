"""A live session ends once: its step loop makes the one terminal transition, whoever asks.

In-process over the fake generator and decoder (demo/fakes.py), the worker's servicer driven
directly: the Converse handler on a thread of its own, the requests fed by the test. The
step loop is held inside step 0 (the generator waits there, holding the worker's generator
lock) while the ends are asked for: one first, then the others from threads of their own
at once (the client going away, CloseSession, the drain timeout, a bad request, a decoder
failure), with the session's max_duration already past when the step is let go. Exactly one
terminal transition follows, with the end asked for first; one SessionEvent ends the stream;
every caller that waits for the end (CloseSession, the drain) returns.

The step loop's own ends (max_duration here) become the end once the session's last chunk
has gone out: asked for after that, the other ends change nothing.
"""

import queue
import threading
import time

import grpc
import pytest

from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeGenerator, FakeWorker
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.request_reader import RequestReader
from characters_jax.serving.worker import WorkerOptions
from serving_harness import png
from serving_stress import Aborted, FakeContext

CFG = load_config("tiny")
SEED = 1  # the session's noise seed
DEADLINE_S = 30.0  # generous bound of every "eventually" under load
ENDS = ("CLIENT_GONE", "CLOSED", "DRAIN_TIMEOUT", "BAD_REQUEST", "DECODER_FAILED")
# The end each request asks for: (state, status code, EndReason).
EXPECTED = {
    "CLIENT_GONE": ("CANCELLED", grpc.StatusCode.CANCELLED, "CLIENT_GONE"),
    "CLOSED": ("CANCELLED", grpc.StatusCode.CANCELLED, "CLOSED"),
    "DRAIN_TIMEOUT": ("CANCELLED", grpc.StatusCode.CANCELLED, "DRAIN_TIMEOUT"),
    "BAD_REQUEST": ("FAILED", grpc.StatusCode.INVALID_ARGUMENT, "ERROR"),
    "DECODER_FAILED": ("FAILED", grpc.StatusCode.UNAVAILABLE, "ERROR"),
    "MAX_DURATION": ("COMPLETED", grpc.StatusCode.OK, "MAX_DURATION"),
}


class HeldGenerator(FakeGenerator):
    """A FakeGenerator whose steps, after `hold()`, wait inside the step (the worker holds
    its generator lock meanwhile) until `release()`; `inside` is set once one waits."""

    def __init__(self, config):
        super().__init__(config)
        self.inside = threading.Event()
        self._go = threading.Event()
        self._go.set()

    def hold(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def step(self, audio_tokens):
        if not self._go.is_set():
            self.inside.set()
            self._go.wait(DEADLINE_S)
        return super().step(audio_tokens)


class Context(FakeContext):
    def is_active(self) -> bool:
        return True


class Requests:
    """The client's requests, fed by the test."""

    def __init__(self, first):
        self._q = queue.Queue()
        self._q.put(first)

    def put(self, request) -> None:
        self._q.put(request)

    def __iter__(self):
        return self

    def __next__(self):
        return self._q.get()


class Session:
    """A session opened on `worker` by a Converse stream run on a thread; `items` collects
    what the stream yields, `status` how it ended (OK or the code it aborted with)."""

    def __init__(self, worker: FakeWorker, max_duration_s: float):
        start = pb.ConverseRequest.Start(audio_format=pb.AudioFormat(sample_rate_hz=16000, channels=1, encoding=pb.AudioFormat.PCM_S16LE),
                                         playout_reports=False)
        start.create.CopyFrom(pb.CreateSessionRequest(image=png(), prompt="hi", seed=SEED, limits=pb.SessionLimits(max_duration_s=max_duration_s)))
        self.worker, self.context = worker, Context()
        self.requests = Requests(pb.ConverseRequest(start=start))
        self.items, self.status = [], None
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.opened.wait(DEADLINE_S), "the session did not open"
        self.live = worker.server.servicer.live

    def _run(self):
        try:
            for item in self.worker.server.servicer.Converse(RequestReader(self.requests, 5.0), self.context):
                self.items.append(item)
                self.opened.set()
            self.status = grpc.StatusCode.OK
        except Aborted as err:
            self.status = err.args[0]

    @property
    def session(self) -> pb.Session:
        return self.items[0].session

    def ask(self, kind: str) -> None:
        """Asks for the end `kind` the way it comes in a worker (blocks where that waits)."""
        servicer = self.worker.server.servicer
        if kind == "CLIENT_GONE":
            self.context.end()  # gRPC runs the RPC's callbacks
        elif kind == "CLOSED":
            servicer.CloseSession(pb.CloseSessionRequest(session_id=self.session.session_id, session_token=self.session.session_token), FakeContext())
        elif kind == "DRAIN_TIMEOUT":
            servicer.drain(0.0)
        elif kind == "BAD_REQUEST":
            self.requests.put(pb.ConverseRequest())  # no event set
        elif kind == "DECODER_FAILED":
            self.worker.decoder_server.stop(grace=0)
        else:
            raise ValueError(kind)


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def ask_all(session: Session, kinds) -> list[threading.Thread]:
    """Asks for every end of `kinds` from threads of their own, released together."""
    barrier = threading.Barrier(len(kinds))

    def one(kind):
        barrier.wait()
        session.ask(kind)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in kinds]
    for t in threads:
        t.start()
    return threads


def ended_by_reason(worker: FakeWorker) -> dict[str, float]:
    counts = {}
    for metric in worker.server.ctx.metrics.sessions_ended_by_reason.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                counts[sample.labels["reason"]] = sample.value
    return counts


def check_one_end(worker: FakeWorker, session: Session, expected: str) -> None:
    state, code, reason = EXPECTED[expected]
    session.thread.join(DEADLINE_S)
    assert not session.thread.is_alive(), "the stream did not end"
    events = [i for i in session.items if i.WhichOneof("event") == "session_event"]
    assert len(events) == 1 and session.items[-1] is events[0]
    ev = events[0].session_event
    assert (pb.SessionState.Name(ev.state), pb.EndReason.Name(ev.end_reason)) == (state, reason), ev
    assert session.status == code
    rec = worker.server.table.get(session.session.session_id)
    assert (rec.state, rec.end_reason, rec.status_code) == (state, reason, code)
    assert ended_by_reason(worker) == {reason: 1.0}  # one terminal transition
    assert session.live.ended and session.live.requested_end.reason == reason


@pytest.fixture
def held():
    generator = HeldGenerator(CFG)
    worker = FakeWorker(CFG, WorkerOptions(), generator=generator)
    yield worker, generator
    generator.release()
    worker.close()


@pytest.mark.parametrize("first", ENDS)
def test_concurrent_ends_make_one_transition_with_the_first(held, first):
    worker, generator = held
    generator.hold()
    session = Session(worker, max_duration_s=0.2)
    assert generator.inside.wait(DEADLINE_S), "step 0 never ran"
    waiting = ask_all(session, [first])  # CloseSession and the drain wait for the end
    wait_for(lambda: session.live.requested_end is not None, f"{first} was not asked for")
    assert session.live.requested_end.reason == EXPECTED[first][2] and not session.live.ended
    others = ask_all(session, [k for k in ENDS if k != first])
    wait_for(lambda: time.monotonic() > session.live.conv.deadline, "max_duration did not pass")
    generator.release()
    check_one_end(worker, session, first)
    for t in waiting + others:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a caller waiting for the end did not return"


def test_the_loops_own_end_stands_against_later_ends(held):
    worker, generator = held
    session = Session(worker, max_duration_s=0.2)
    session.thread.join(DEADLINE_S)
    threads = ask_all(session, ENDS)
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a caller asking a finished session to end did not return"
    check_one_end(worker, session, "MAX_DURATION")
