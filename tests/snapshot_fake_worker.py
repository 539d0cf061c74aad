"""A fake-model worker process with a snapshot store, for the snapshot tests (run as a
script): a FakeWorker (demo/fakes.py: the real WorkerServer over the fake generator and
an in-process fake decoder) with the [serve] snapshot keys of the command line. SIGTERM
drains it (a resumable session migrates) and it exits 0. Writes {"port", "pid"} to
--state-file once serving."""

import argparse
import json
import os
import pathlib
import signal
import threading


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--state-file", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--snapshot-dir", required=True)
    p.add_argument("--snapshot-interval", type=float, default=0.0)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from characters_jax.demo.fakes import FakeWorker
    from characters_jax.serving.worker import WorkerOptions

    options = WorkerOptions(drain_timeout_s=args.drain_timeout, worker_id=args.worker_id, snapshot_dir=args.snapshot_dir,
                            snapshot_interval_s=args.snapshot_interval)
    worker = FakeWorker("tiny", options)
    tmp = pathlib.Path(args.state_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": worker.server.port, "pid": os.getpid()}))
    os.replace(tmp, args.state_file)
    stop.wait()
    worker.close(drain_timeout_s=None, grace_s=3.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
