"""The worker's health service cannot wedge, and a wedged server fails liveness.

- The deadlock's mechanism, without a network: a status update whose send waits (as a send
  waits for gRPC's event thread) while the event thread closes a watch. The stock
  grpc_health servicer's close callback waits for the lock the send holds; ours returns.
  Ours also coalesces a watcher's updates to the latest status.
- Watch holds no thread; Check and Watch run on the health pool.
- Churn over processes: threads open and close Health.Watch streams on fresh channels while
  the status flips every 50 ms (through the session table, as sessions do). The stock
  servicer on a bare server wedges (Check unanswered; the port still accepts TCP, which is
  why a TCP liveness probe never restarted it; our /healthz probe fails); our worker stays
  responsive for a minute and exits 0 on SIGTERM.
- /healthz: 200 while the gRPC server answers, 503 once it does not.
"""

import signal
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from serving_stress import Aborted, FakeContext, start_worker_process

from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeWorker
from characters_jax.serving.health import HealthService
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.serving.liveness import GrpcLiveness
from characters_jax.serving.metrics_http import MetricsHttpServer
from characters_jax.serving.rpc_handlers import register
from characters_jax.serving.rpc_pool import RpcPool

R = health_pb2.HealthCheckResponse
SERVING, NOT_SERVING, UNKNOWN = R.SERVING, R.NOT_SERVING, R.SERVICE_UNKNOWN
CHURN_THREADS = 6
PROBE_EVERY_S = 0.25
CHECK_DEADLINE_S = 2.0  # "responsive": every Check answered within this


class Sends:
    """A watcher's send callback: records each response; `hold` makes sends from the
    `hold_from`-th on wait until `release()` (a send waits for gRPC's event thread)."""

    def __init__(self, hold_from: int | None = None):
        self.statuses: list[int] = []
        self.hold_from = hold_from
        self.holding = threading.Event()
        self._released = threading.Event()
        self._cond = threading.Condition()

    def __call__(self, response):
        if self.hold_from is not None and len(self.statuses) + 1 >= self.hold_from:
            self.holding.set()
            self._released.wait()
        with self._cond:
            self.statuses.append(None if response is None else response.status)
            self._cond.notify_all()

    def release(self):
        self.hold_from = None
        self._released.set()

    def wait_for(self, n: int, timeout=10.0):
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.statuses) >= n, timeout), self.statuses


def run_in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_watch_closing_never_waits_for_a_status_send():
    """A status update's send to watcher A waits; meanwhile A's watch ends (its close
    callback, on gRPC's event thread). Ours: the callback and further updates return at
    once. The stock servicer: the callback waits for the send (which, for real, waits for
    that event thread: the deadlock)."""
    req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)

    ours = HealthService()
    ours.set(SERVICE_NAME, SERVING)
    sends, ctx = Sends(hold_from=2), FakeContext()
    ours.Watch(req, ctx, sends)
    sends.wait_for(1)
    setter = run_in_thread(lambda: ours.set(SERVICE_NAME, NOT_SERVING))
    assert sends.holding.wait(10)  # the notifier is inside the send
    setter.join(5)
    assert not setter.is_alive(), "set() waited for a send"
    closer = run_in_thread(ctx.end)
    closer.join(5)
    assert not closer.is_alive(), "the close callback waited for a send"
    assert ours.watchers == 0
    ours.set(SERVICE_NAME, SERVING)  # returns at once too
    sends.release()
    ours.close()

    stock = health.HealthServicer()
    stock.set(SERVICE_NAME, SERVING)
    sends, ctx = Sends(hold_from=2), FakeContext()
    stock.Watch(req, ctx, sends)
    setter = run_in_thread(lambda: stock.set(SERVICE_NAME, NOT_SERVING))
    assert sends.holding.wait(10)
    closer = run_in_thread(ctx.end)
    closer.join(0.5)
    assert closer.is_alive(), "the stock close callback did not wait for the send"
    sends.release()
    closer.join(5)
    setter.join(5)
    assert not closer.is_alive() and not setter.is_alive()


def test_watch_updates_coalesce_to_the_latest_status():
    """While a watcher's send is under way, eleven flips: it then gets the latest only."""
    svc = HealthService()
    svc.set(SERVICE_NAME, SERVING)
    sends = Sends(hold_from=1)
    svc.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), FakeContext(), sends)
    assert sends.holding.wait(10)
    for i in range(11):
        svc.set(SERVICE_NAME, NOT_SERVING if i % 2 == 0 else SERVING)
    sends.release()
    sends.wait_for(2)
    svc.close()
    assert sends.statuses == [SERVING, NOT_SERVING]


def test_check_and_watch_of_an_unknown_service():
    svc = HealthService()
    svc.set("", SERVING)
    with pytest.raises(Aborted) as e:
        svc.Check(health_pb2.HealthCheckRequest(service="nope"), FakeContext())
    assert e.value.args[0] == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.args[1]
    assert svc.Check(health_pb2.HealthCheckRequest(service=""), FakeContext()).status == SERVING
    sends = Sends()
    svc.Watch(health_pb2.HealthCheckRequest(service="nope"), FakeContext(), sends)
    sends.wait_for(1)
    svc.set("nope", SERVING)
    sends.wait_for(2)
    svc.close()
    assert sends.statuses == [UNKNOWN, SERVING]


def test_watches_hold_no_thread_of_the_health_pool():
    """Ten watches on a health pool of one thread: every watch gets its status, the pool
    is idle again, and Check still answers."""
    pool = RpcPool("health", 1)
    svc = HealthService(pool)
    svc.set(SERVICE_NAME, SERVING)
    server = grpc.server(RpcPool("rpc", 1))
    register(server, "grpc.health.v1.Health", svc.handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            calls = [stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30) for _ in range(10)]
            assert [next(c).status for c in calls] == [SERVING] * 10
            assert svc.watchers == 10 and pool.busy == 0
            assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == SERVING
            svc.set(SERVICE_NAME, NOT_SERVING)
            assert [next(c).status for c in calls] == [NOT_SERVING] * 10
            for c in calls:
                c.cancel()
    finally:
        server.stop(0).wait(5)
        svc.close()
        pool.shutdown(wait=False)


# -- churn over processes ----------------------------------------------------------------------
class WatchChurn:
    """Threads that each, until stopped: open a fresh channel, Watch the service, read its
    first status, cancel, close the channel."""

    def __init__(self, target: str, threads: int = CHURN_THREADS):
        self.target = target
        self.stop = threading.Event()
        self.opened = 0
        self.statuses: set[int] = set()
        self._lock = threading.Lock()
        self._threads = [run_in_thread(self._run) for _ in range(threads)]

    def _run(self):
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while not self.stop.is_set():
            ch = grpc.insecure_channel(self.target)
            call = health_pb2_grpc.HealthStub(ch).Watch(req, timeout=3)
            try:
                status = next(call).status
                with self._lock:
                    self.opened += 1
                    self.statuses.add(status)
            except grpc.RpcError:
                pass
            finally:
                call.cancel()
                ch.close()

    def close(self):
        self.stop.set()
        for t in self._threads:
            t.join(10)


def check_once(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def probe_checks(target: str, seconds: float, stop_at_failure: bool) -> tuple[list[float], float | None]:
    """Checks "" every PROBE_EVERY_S for `seconds` (deadline CHECK_DEADLINE_S). Returns
    (latencies of the answered ones, seconds into the run of the first unanswered one)."""
    latencies, failed_at = [], None
    with grpc.insecure_channel(target) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            t = time.monotonic()
            try:
                check(health_pb2.HealthCheckRequest(service=""), timeout=CHECK_DEADLINE_S)
                latencies.append(time.monotonic() - t)
            except grpc.RpcError:
                failed_at = failed_at if failed_at is not None else t - t0
                if stop_at_failure:
                    break
            time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - t)))
    return latencies, failed_at


def test_the_stock_health_servicer_wedges_under_watch_churn(tmp_path):
    """Negative control: grpc_health's HealthServicer alone on a bare server, the status
    flipping every 50 ms, watches opened and closed: within 20 s a Check goes unanswered
    for good, while the port still accepts TCP connections; the liveness probe says so."""
    proc, port, _log = start_worker_process(tmp_path, "--servicer", "stock", "--flip-ms", "50")
    target = f"127.0.0.1:{port}"
    assert check_once(target) == SERVING  # it answers before the churn
    churn = WatchChurn(target)
    try:
        _, failed_at = probe_checks(target, 20.0, stop_at_failure=True)
        assert failed_at is not None, "the stock servicer did not wedge within 20 s"
        churn.close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # what a TCP liveness probe sees: alive
        probe = GrpcLiveness(target, timeout_s=1.0)
        alive, message = probe()
        probe.close()
        assert not alive and "no health answer" in message
        print(f"\nstock servicer: wedged {failed_at:.1f} s into the churn; /healthz probe: {message}")
    finally:
        churn.close()
        proc.kill()
        proc.wait(10)


def test_the_worker_stays_responsive_under_watch_churn_and_exits_on_sigterm(tmp_path):
    """The same churn against the worker (the status flipping through its session table) for
    a minute: every Check is answered within CHECK_DEADLINE_S; then SIGTERM ends it (0)
    within its drain timeout plus a few seconds."""
    proc, port, log_path = start_worker_process(tmp_path, "--servicer", "worker", "--flip-ms", "50", "--drain-timeout", "2")
    target = f"127.0.0.1:{port}"
    assert check_once(target) == SERVING  # it answers before the churn
    churn = WatchChurn(target)
    try:
        latencies, failed_at = probe_checks(target, 60.0, stop_at_failure=False)
        churn.close()
        assert failed_at is None, f"a Check went unanswered {failed_at:.1f} s into the churn"
        assert churn.opened > 100 and churn.statuses == {SERVING, NOT_SERVING}, (churn.opened, churn.statuses)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(2 + 8) == 0, log_path.read_text()[-3000:]
        stop_s = time.monotonic() - t_term
        p50, worst = statistics.median(latencies), max(latencies)
        print(f"\nworker: {len(latencies)} Checks in 60 s under churn: p50 {p50 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms; "
              f"{churn.opened} watches opened and closed; SIGTERM to exit {stop_s:.2f} s")
    finally:
        churn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- liveness ------------------------------------------------------------------------------------
def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_healthz_is_200_while_grpc_answers_and_503_once_it_does_not():
    w = FakeWorker(load_config("tiny"))
    probe = GrpcLiveness(w.server.probe_target, timeout_s=1.0)
    http = MetricsHttpServer(w.server.ctx.metrics.registry, "127.0.0.1", 0, probe)
    try:
        url = f"http://127.0.0.1:{http.port}"
        status, body = get(url + "/healthz")
        assert status == 200 and "SERVING" in body, body
        w.server.drain(0)  # a draining worker is NOT_SERVING and alive
        status, body = get(url + "/healthz")
        assert status == 200 and "NOT_SERVING" in body, body
        assert get(url + "/metrics")[0] == 200
        w.server.stop(grace=0)
        status, body = get(url + "/healthz")
        assert status == 503 and "no health answer" in body, body
    finally:
        http.close()
        probe.close()
        w.close()


def test_healthz_probes_a_tls_worker_over_its_private_socket(tmp_path):
    """Under mutual TLS with bearer tokens the probe still answers: it reaches the server
    over its private Unix socket (health needs no token there either), and nothing else
    gets through that socket without a token."""
    pytest.importorskip("cryptography.x509", reason="making test certificates needs the cryptography package (the view extra brings it)")
    import os
    import stat

    from test_serving_auth import Pki, secure_worker

    from characters_jax.protos_gen import characters_pb2 as pb
    from characters_jax.protos_gen import characters_pb2_grpc

    w = secure_worker(Pki(tmp_path))
    probe = GrpcLiveness(w.server.probe_target, timeout_s=1.0)
    try:
        alive, message = probe()
        assert alive and "SERVING" in message, message
        socket_dir = os.path.dirname(w.server.probe_target.removeprefix("unix:"))
        assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
        with grpc.insecure_channel(w.server.probe_target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                characters_pb2_grpc.CharacterServiceStub(ch).GetSession(pb.GetSessionRequest(session_id="x"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        probe.close()
        w.close()
