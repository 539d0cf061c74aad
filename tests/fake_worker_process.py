"""A worker process for the serving stress tests (run as a script by them).

--servicer worker: a FakeWorker (demo/fakes.py: the real WorkerServer over the fake
generator and decoder), with the RpcLimits given on the command line. --servicer stock:
the negative control, grpc_health's stock HealthServicer alone on a bare grpc server.

--flip-ms N flips the health status every N ms: for the worker through its session table
(a session reserved, then cancelled: what sessions starting and ending do, down to
SessionTable.transition -> WorkerHealth.refresh), for the stock server with set().
SIGTERM drains and stops the worker as `serve` does (the same hard deadline on shutdown)
and exits 0. Writes {"port", "pid", "threads_file"} to --state-file once serving; SIGUSR1
writes the names of the process's Python threads (JSON list) to threads_file.
"""

import argparse
import json
import os
import pathlib
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from characters_jax.wire.service import SERVICE_NAME

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def worker_server(args):
    """(port, flip(), shutdown()) of a FakeWorker with the RpcLimits of the command line."""
    from characters_jax.demo.fakes import FakeWorker
    from characters_jax.serving.admission import RpcLimits
    from characters_jax.serving.conversation import Limits
    from characters_jax.serving.session import SlotBusy
    from characters_jax.serving.shutdown import SLACK_S, exit_after
    from characters_jax.serving.worker import WorkerOptions

    limits = RpcLimits(first_request_timeout_s=args.first_request_timeout, reflection_idle_timeout_s=args.reflection_idle_timeout)
    options = WorkerOptions(drain_timeout_s=args.drain_timeout, worker_id=args.worker_id)
    worker = FakeWorker("tiny", options, port=args.port, limits=limits)
    table = worker.server.table
    held = []

    def flip():
        if held:
            table.transition(held.pop(), "CANCELLED", grpc.StatusCode.CANCELLED, "flip", "CLOSED")
        else:
            try:
                held.append(table.reserve(1, 0, Limits(60.0, 60.0)))
            except SlotBusy:  # a client's session holds the slot
                pass

    def shutdown():
        exit_after(options.drain_timeout_s + SLACK_S)
        worker.close(drain_timeout_s=None, grace_s=3.0)

    return worker.server.port, flip, shutdown


def stock_server(_args):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", SERVING)
    servicer.set(SERVICE_NAME, SERVING)
    state = [SERVING]

    def flip():
        state[0] = NOT_SERVING if state[0] == SERVING else SERVING
        servicer.set(SERVICE_NAME, state[0])

    return port, flip, lambda: server.stop(grace=3.0).wait()


def write_json(path: pathlib.Path, value) -> None:
    """Writes `value` to `path` whole (a reader sees the old file or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servicer", choices=("worker", "stock"), required=True)
    p.add_argument("--state-file", required=True)
    p.add_argument("--flip-ms", type=float, default=0.0, help="flip the health status this often (0: never)")
    p.add_argument("--first-request-timeout", type=float, default=10.0)
    p.add_argument("--reflection-idle-timeout", type=float, default=30.0)
    p.add_argument("--drain-timeout", type=float, default=2.0)
    p.add_argument("--port", type=int, default=0, help="the worker's port (0: any free port)")
    p.add_argument("--worker-id", default="", help="the worker's Session.worker_id (default: host name:port)")
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads_file = pathlib.Path(args.state_file).with_suffix(".threads.json")
    signal.signal(signal.SIGUSR1, lambda *_: write_json(threads_file, [t.name for t in threading.enumerate()]))
    port, flip, shutdown = (worker_server if args.servicer == "worker" else stock_server)(args)
    write_json(pathlib.Path(args.state_file), {"port": port, "pid": os.getpid(), "threads_file": str(threads_file)})
    period = args.flip_ms / 1e3 if args.flip_ms > 0 else None
    while not stop.wait(period):
        flip()
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
