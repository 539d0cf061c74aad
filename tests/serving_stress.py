"""Helpers of the serving stress tests: a fake RPC context, tools/chaos.py as the module
`chaos` (its idle request stream among them), and a worker process (fake_worker_process.py)
started on a free port."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import time

from characters_jax.processes import child_env

SCRIPT = pathlib.Path(__file__).with_name("fake_worker_process.py")


def _load_chaos():
    if "chaos" not in sys.modules:
        spec = importlib.util.spec_from_file_location("chaos", pathlib.Path(__file__).parents[1] / "tools" / "chaos.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["chaos"] = module
        spec.loader.exec_module(module)
    return sys.modules["chaos"]


chaos = _load_chaos()
IdleRequests = chaos.IdleRequests


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
