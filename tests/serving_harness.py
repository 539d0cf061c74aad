"""A real worker process for end-to-end tests: started with `serve`, driven by the client
library, its health, state file and metrics read as a user's tooling would."""

import io
import json
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from characters_jax.serving.client import CharacterClient
from characters_jax.serving.server import SERVICE_NAME, child_env


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (np.sin(2 * np.pi * 180 * t) * 6000 * (1 + np.sin(2 * np.pi * 3 * t)) + rng.standard_normal(t.size) * 300).astype(np.int16)


def png(w=160, h=120, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


class Worker:
    """`characters-jax serve --config CONFIG ARGS...` on a free port; ready when its state
    file appears (within `ready_timeout` seconds)."""

    def __init__(self, tmp: pathlib.Path, config: str = "tiny", args: tuple[str, ...] = (), env: dict | None = None,
                 ready_timeout: float = 300.0):
        tmp.mkdir(parents=True, exist_ok=True)
        self.state_file = tmp / "worker.json"
        self.log_path = tmp / "worker.log"
        self.log = open(self.log_path, "w")
        argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", config, "--port", "0", "--metrics-port", "0",
                "--state-file", str(self.state_file), *args]
        self.proc = subprocess.Popen(argv, env=env if env is not None else child_env(1), stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while not self.state_file.exists() or "startup_s" not in self.state():
            assert self.proc.poll() is None, f"worker exited: {self.log_path.read_text()[-3000:]}"
            assert time.monotonic() - t0 < ready_timeout, f"worker not ready in {ready_timeout} s"
            time.sleep(0.1)
        self.startup_s = time.monotonic() - t0
        st = self.state()
        self.address = f"127.0.0.1:{st['port']}"
        self.client = CharacterClient(self.address)
        self.health = health_pb2_grpc.HealthStub(self.client.channel)

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def serving(self, service=SERVICE_NAME) -> str:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.state()['metrics_port']}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout=5.0) -> float:
        t0 = time.monotonic()
        while self.serving() != "SERVING":
            assert time.monotonic() - t0 < timeout, "worker did not become idle"
            time.sleep(0.01)
        return time.monotonic() - t0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.client.close()
        self.log.close()
