"""No number of idle streams starves a worker: admission limits, deadlines, pools of their own.

- RequestReader: a read with a deadline, in sync gRPC (one thread per stream, reading only
  when asked); first_request's statuses.
- Admission: a counter with a limit; a refused RPC's message names the limit.
- 100 idle Converse streams and 100 idle reflection streams against a worker process (the
  fake model; deadlines of 3 s): a health Check every 50 ms (HealthProbe) is never starved
  (every Check answered within the liveness deadline of 1 s) and its p95 is within 100 ms;
  every stream ends RESOURCE_EXHAUSTED (over its limit) or DEADLINE_EXCEEDED (admitted, idle
  past its deadline), each with a message; then a real session still runs.
  Negative control: stock health and reflection sharing one small pool, the same probe: it
  sees the starvation (a Check unanswered at the deadline).
- SIGTERM ends the worker within its drain timeout plus a few seconds, whatever its streams do.
"""

import statistics
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving_harness import png, speech
from serving_stress import Aborted, FakeContext, IdleRequests, start_worker_process

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.admission import Admission, RpcLimits
from characters_jax.client.character_client import CharacterClient, start_request
from characters_jax.serving.request_reader import RequestReader, first_request
from characters_jax.processes import terminate

IDLE_STREAMS = 100
DEADLINE_S = 3.0
HEALTH_P95_S = 0.100  # what a health Check typically takes under the streams (p95)
LIMITS = RpcLimits()


class Feed:
    """A request iterator fed by the test: put(item), end(), fail(error); next() blocks."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: list = []

    def put(self, item):
        with self._cond:
            self._items.append(("item", item))
            self._cond.notify_all()

    def end(self):
        with self._cond:
            self._items.append(("end", None))
            self._cond.notify_all()

    def fail(self, err):
        with self._cond:
            self._items.append(("error", err))
            self._cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self):
        with self._cond:
            self._cond.wait_for(lambda: self._items)
            kind, value = self._items.pop(0)
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise value
        return value


def test_a_read_with_a_deadline_times_out_and_keeps_its_read():
    feed = Feed()
    reader = RequestReader(feed)
    with pytest.raises(TimeoutError):
        reader.next_within(0.05)
    feed.put("a")
    assert reader.next_within(10) == "a"  # the read under way delivers it
    feed.put("b")
    assert next(reader) == "b"  # plain iteration reads directly once no read is under way
    reader.stop()
    feed.fail(ValueError("gone"))
    with pytest.raises(ValueError, match="gone"):
        reader.next_within(10)  # a new reader thread after stop()
    feed2 = Feed()
    feed2.end()
    with pytest.raises(StopIteration):
        RequestReader(feed2).next_within(10)


def test_first_request_statuses():
    feed = Feed()
    feed.put("start")
    assert first_request(RequestReader(feed, first_timeout_s=5), FakeContext()) == "start"
    with pytest.raises(Aborted) as e:
        first_request(RequestReader(Feed(), first_timeout_s=0.05), FakeContext())
    assert e.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "no first request within 0.05 s" in e.value.args[1]
    empty = Feed()
    empty.end()
    with pytest.raises(Aborted) as e:
        first_request(empty, FakeContext())
    assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "the stream was empty" in e.value.args[1]


def test_admission_counts_up_to_its_limit():
    a = Admission("CharacterService RPCs", 2, "RpcLimits.max_character_rpcs")
    assert a.enter() and a.enter() and not a.enter()
    a.leave()
    assert a.enter() and a.admitted == 2
    assert "at most 2 at once (RpcLimits.max_character_rpcs)" in a.refusal
    with pytest.raises(ValueError, match="max_character_rpcs"):
        RpcLimits(max_character_rpcs=0)


class HealthProbe:
    """A health Check of "" every 50 ms on a channel of its own, each with the liveness
    deadline (RpcLimits.liveness_timeout_s, what /healthz gives it): the latency of each one
    answered, and the Checks left unanswered at the deadline. Starved health is unanswered,
    not slow: the Check waits for a thread that an idle stream holds until its own end
    (seconds). A loaded machine only delays an answer, so it is judged by the p95."""

    def __init__(self, target: str):
        self.latencies: list[float] = []
        self.unanswered = 0
        self.errors: list[grpc.StatusCode] = []  # any other failure of a Check
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self._thread.start()
        assert self._connected.wait(30), "the probe could not reach the server"

    def _run(self, target: str) -> None:
        with grpc.insecure_channel(target) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            check(health_pb2.HealthCheckRequest(service=""), timeout=30)  # connected before the streams open
            self._connected.set()
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    check(health_pb2.HealthCheckRequest(service=""), timeout=LIMITS.liveness_timeout_s)
                    self.latencies.append(time.monotonic() - t)
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self.unanswered += 1
                    else:
                        self.errors.append(err.code())
                self._stop.wait(max(0.0, 0.05 - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()

    @property
    def p95(self) -> float:
        return statistics.quantiles(self.latencies, n=20)[-1]

    def summary(self) -> str:
        answered = f"p50 {statistics.median(self.latencies) * 1e3:.1f} ms, p95 {self.p95 * 1e3:.1f} ms, max {max(self.latencies) * 1e3:.1f} ms" if len(self.latencies) >= 2 else "-"
        return (f"{len(self.latencies)} Checks answered ({answered}), {self.unanswered} unanswered at {LIMITS.liveness_timeout_s:g} s"
                + (f", failed: {self.errors}" if self.errors else ""))


def test_idle_reflection_streams_starve_health_on_a_shared_pool():
    """Negative control: stock health and reflection sharing one pool of 4 threads (as the
    worker's 16 did): 4 idle reflection streams hold every thread and the probe's Checks go
    unanswered."""
    from concurrent import futures

    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((reflection.SERVICE_NAME,), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    release = threading.Event()
    probe = HealthProbe(f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo
            calls = [info(IdleRequests(release)) for _ in range(4)]
            t0 = time.monotonic()
            while probe.unanswered == 0 and time.monotonic() - t0 < 30:  # the first Check after the streams take the pool
                time.sleep(0.05)
            probe.stop()
            print(f"\nshared pool, 4 idle reflection streams: {probe.summary()}")
            assert probe.unanswered >= 1
            for c in calls:
                c.cancel()
    finally:
        probe.stop()
        release.set()
        server.stop(0).wait(5)


def outcome(call) -> tuple[grpc.StatusCode, str]:
    """How a streaming call ended (waits for it)."""
    return call.code(), call.details() or ""


def test_idle_streams_never_starve_health_and_are_refused_or_timed_out(tmp_path):
    proc, port, log_path = start_worker_process(tmp_path, "--servicer", "worker", "--first-request-timeout", str(DEADLINE_S),
                                                "--reflection-idle-timeout", str(DEADLINE_S))
    target = f"127.0.0.1:{port}"
    release = threading.Event()
    streams, reflections = grpc.insecure_channel(target), grpc.insecure_channel(target)
    probe = HealthProbe(target)
    try:
        converse = characters_pb2_grpc.CharacterServiceStub(streams).Converse
        info = reflection_pb2_grpc.ServerReflectionStub(reflections).ServerReflectionInfo
        t0 = time.monotonic()
        calls = [converse(IdleRequests(release)) for _ in range(IDLE_STREAMS)]
        calls += [info(IdleRequests(release)) for _ in range(IDLE_STREAMS)]
        outcomes = [outcome(c) for c in calls]  # every stream ends on its own, the idle ones at their deadline
        ended_s = time.monotonic() - t0
        probe.stop()
        release.set()
        converse_out, reflection_out = outcomes[:IDLE_STREAMS], outcomes[IDLE_STREAMS:]
        for outs, limit, knob, idle in ((converse_out, LIMITS.max_character_rpcs, "RpcLimits.max_character_rpcs", "no first request within"),
                                        (reflection_out, LIMITS.max_reflection_streams, "RpcLimits.max_reflection_streams", "server reflection: no request for")):
            codes = [c for c, _ in outs]
            assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}, set(codes)
            assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= limit and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
            for code, details in outs:
                needle = f"at most {limit} at once ({knob})" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else f"{idle} {DEADLINE_S:g} s"
                assert needle in details, (code, details)
        print(f"\n{IDLE_STREAMS} idle Converse + {IDLE_STREAMS} idle reflection streams, all ended in {ended_s:.2f} s: "
              f"health: {probe.summary()}; Converse "
              f"{sum(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c, _ in converse_out)} refused, "
              f"{sum(c == grpc.StatusCode.DEADLINE_EXCEEDED for c, _ in converse_out)} timed out; reflection "
              f"{sum(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c, _ in reflection_out)} refused, "
              f"{sum(c == grpc.StatusCode.DEADLINE_EXCEEDED for c, _ in reflection_out)} timed out")
        assert probe.unanswered == 0 and not probe.errors, probe.summary()  # never starved: the negative control's Checks go unanswered
        assert len(probe.latencies) >= 20 and probe.p95 < HEALTH_P95_S, probe.summary()

        listing = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        assert "characters.v1.CharacterService" in {s.name for r in listing for s in r.list_services_response.service}
        with CharacterClient(target) as client:
            res = client.converse(None, speech(1.0), image=png(), realtime=False, open_timeout=30)
        assert res.final_event.state == pb.COMPLETED and len(res.chunks) > 0
    finally:
        probe.stop()
        release.set()
        streams.close()
        reflections.close()
        assert terminate(proc, 20) == 0, log_path.read_text()[-3000:]


def test_sigterm_ends_the_worker_whatever_its_streams_do(tmp_path):
    """A live session whose client stopped reading (its sends wait for flow control), an
    idle Converse stream, an idle reflection stream and health watches: SIGTERM ends the
    worker (0) within its drain timeout plus a few seconds."""
    drain_s = 1.0
    proc, port, log_path = start_worker_process(tmp_path, "--servicer", "worker", "--drain-timeout", str(drain_s))
    target = f"127.0.0.1:{port}"
    release = threading.Event()

    def session_requests():
        yield start_request(image=png(), playout_reports=False)
        release.wait()

    ch = grpc.insecure_channel(target)
    try:
        stub = characters_pb2_grpc.CharacterServiceStub(ch)
        session = stub.Converse(session_requests())
        assert next(session).session.state == pb.RUNNING  # then never read again
        idle = [stub.Converse(IdleRequests(release)), reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(IdleRequests(release))]
        watches = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(3)]
        assert all(next(w).status == health_pb2.HealthCheckResponse.SERVING for w in watches)
        time.sleep(2.0)  # the unread chunks fill the stream's flow-control window: the worker's sends wait
        t_term = time.monotonic()
        proc.terminate()
        assert proc.wait(drain_s + 10) == 0, log_path.read_text()[-3000:]
        print(f"\nSIGTERM with a stalled session and idle streams: exited in {time.monotonic() - t_term:.2f} s (drain timeout {drain_s:g} s)")
        for call in [session, *idle, *watches]:
            call.cancel()
    finally:
        release.set()
        ch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
