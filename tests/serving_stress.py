"""Helpers of the serving stress tests: a fake RPC context, an idle request stream, and a
worker process (fake_worker_process.py) started on a free port."""

import json
import pathlib
import subprocess
import sys
import threading
import time

from characters_jax.processes import child_env

SCRIPT = pathlib.Path(__file__).with_name("fake_worker_process.py")


class Aborted(Exception):
    pass


class FakeContext:
    """What a servicer sees of an RPC: callbacks run when it ends (`end()`, as gRPC's event
    thread does), abort raises."""

    def __init__(self):
        self.callbacks = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        for callback in self.callbacks:
            callback()

    def abort(self, code, details):
        raise Aborted(code, details)


class IdleRequests:
    """A request iterator that sends nothing until released (an idle client)."""

    def __init__(self, release: threading.Event):
        self._release = release

    def __iter__(self):
        return self

    def __next__(self):
        self._release.wait()
        raise StopIteration


def start_worker_process(tmp_path: pathlib.Path, *args: str, ready_timeout: float = 60.0):
    """fake_worker_process.py with args; returns (process, port, log path)."""
    state = tmp_path / "state.json"
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--state-file", str(state), *args], env=child_env(1), stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while not state.exists():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() - t0 < ready_timeout, "the worker process did not start"
        time.sleep(0.05)
    return proc, json.loads(state.read_text())["port"], log_path
