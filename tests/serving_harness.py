"""Serving test helpers: a real worker process (`serve`, its health, state file and metrics
read as a user's tooling would), a recorder of a conversation's stream, speech and images."""

import io
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.client.character_client import CharacterClient
from characters_jax.processes import child_env
from characters_jax.wire.service import SERVICE_NAME
from characters_jax.processes import terminate
from characters_jax.serving.metrics_http import scrape


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
                 ready_timeout: float = 300.0, wait: bool = True):
        """wait=False: returns once the process is started; call wait_ready()."""
        tmp.mkdir(parents=True, exist_ok=True)
        self.state_file = tmp / "worker.json"
        self.log_path = tmp / "worker.log"
        self.log = open(self.log_path, "w")
        argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", config, "--port", "0", "--set", "serve.metrics_port=0",
                "--state-file", str(self.state_file), *args]
        self.proc = subprocess.Popen(argv, env=env if env is not None else child_env(1), stdout=self.log, stderr=subprocess.STDOUT)
        self._t0, self.ready_timeout = time.monotonic(), ready_timeout
        self.client = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "Worker":
        while not self.state_file.exists() or "startup_s" not in self.state():
            assert self.proc.poll() is None, f"worker exited: {self.log_path.read_text()[-3000:]}"
            assert time.monotonic() - self._t0 < self.ready_timeout, f"worker not ready in {self.ready_timeout} s"
            time.sleep(0.1)
        self.startup_s = time.monotonic() - self._t0
        st = self.state()
        self.address = f"127.0.0.1:{st['port']}"
        self.client = CharacterClient(self.address)
        self.health = health_pb2_grpc.HealthStub(self.client.channel)
        return self

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def serving(self, service=SERVICE_NAME) -> str:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

    def metrics(self) -> dict[str, float]:
        return scrape("127.0.0.1", self.state()["metrics_port"], timeout=5)

    def wait_idle(self, timeout=5.0) -> float:
        t0 = time.monotonic()
        while self.serving() != "SERVING":
            assert time.monotonic() - t0 < timeout, "worker did not become idle"
            time.sleep(0.01)
        return time.monotonic() - t0

    def stop(self):
        self.terminate()
        self.wait_stopped()

    def terminate(self):
        """SIGTERM (the worker drains and stops); wait_stopped() waits for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self):
        terminate(self.proc, 20)  # SIGTERM was sent: this waits, then kills a worker still running
        if self.client is not None:
            self.client.close()
        self.log.close()


class Recorder:
    """Reads a ConversationStream in a thread: every item with its arrival time, in order."""

    def __init__(self, conv):
        self.conv = conv
        self.items: list = []
        self.times: list[float] = []
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for item in self.conv:
                with self._cond:
                    self.items.append(item)
                    self.times.append(time.monotonic())
                    self._cond.notify_all()
        except Exception as err:  # surfaced by join()
            self.error = err
        with self._cond:
            self._cond.notify_all()

    @property
    def chunks(self) -> list:
        return [x for x in list(self.items) if isinstance(x, pb.VideoChunk)]

    @property
    def events(self) -> list:
        return [x for x in list(self.items) if isinstance(x, pb.SpeechEvent)]

    def chunk_times(self) -> list[float]:
        return [t for x, t in zip(list(self.items), list(self.times)) if isinstance(x, pb.VideoChunk)]

    def index(self, item) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def chunks_after(self, item) -> list:
        return [x for x in self.items[self.index(item) + 1 :] if isinstance(x, pb.VideoChunk)]

    def wait(self, predicate, timeout: float = 10.0):
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate() or not self._thread.is_alive(), timeout)
        assert ok and predicate(), f"not reached within {timeout} s (stream error: {self.error})"

    def wait_event(self, kind, segment=None, timeout: float = 10.0):
        def find():
            return next((e for e in self.events if e.kind == kind and (segment is None or e.segment == segment)), None)

        self.wait(lambda: find() is not None, timeout)
        return find()

    def send_speech(self, pcm: np.ndarray, speed: float = 1.0, end: bool = True, block: bool = True, piece_ms: int = 20,
                    stop: threading.Event | None = None):
        """Sends pcm in piece_ms pieces at `speed` times real time (until `stop` is set), then
        end_of_speech."""
        stop = stop or threading.Event()

        def run():
            step = 16 * piece_ms
            t0 = time.monotonic()
            for off in range(0, len(pcm), step):
                wait = t0 + off / 16000 / speed - time.monotonic()
                if wait > 0 and stop.wait(wait):  # the microphone's (or the agent's) pace, not the worker's
                    return
                if stop.is_set():
                    return
                self.conv.send_audio(pcm[off : off + step])
            if end:
                self.conv.end_speech()

        if block:
            run()
            return None
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def join(self, timeout: float = 30.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error


def timeline_of(chunks, segments: dict) -> np.ndarray:
    """The session's timeline from its chunks (zeros where none was received), after checking
    that every speech span holds exactly the segment's samples (segments: number -> the
    int16 samples sent) and that every other sample is silence."""
    end = max(c.audio_first_sample + len(c.audio_pcm) // 2 for c in chunks)
    timeline = np.zeros(end, np.int16)
    for c in chunks:
        audio = np.frombuffer(c.audio_pcm, "<i2")
        speech_mask = np.zeros(len(audio), bool)
        for sp in c.speech:
            a = sp.position_samples - c.audio_first_sample
            assert 0 <= a and a + sp.samples <= len(audio), (c.step_index, sp)
            if sp.segment in segments:
                expected = segments[sp.segment][sp.segment_offset_samples : sp.segment_offset_samples + sp.samples]
                np.testing.assert_array_equal(audio[a : a + sp.samples], expected, err_msg=f"step {c.step_index} segment {sp.segment}")
            speech_mask[a : a + sp.samples] = True
        assert not audio[~speech_mask].any(), f"step {c.step_index}: inserted silence is not zeros"
        timeline[c.audio_first_sample : c.audio_first_sample + len(audio)] = audio
    return timeline


def poll(predicate, timeout: float = 10.0, every: float = 0.005) -> None:
    """Waits until predicate() holds (for state that notifies no one, e.g. a PlayoutClock)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not reached within {timeout} s"
        time.sleep(every)


def report_writer(env_var: str):
    """(reports, fixture): a dict the tests fill, and a module fixture (autouse) that writes
    it as JSON to the file $env_var names, when set, after the module's tests."""
    import os

    import pytest

    reports: dict = {}

    @pytest.fixture(scope="module", autouse=True)
    def write_reports():
        yield
        path = os.environ.get(env_var)
        if path and reports:
            pathlib.Path(path).write_text(json.dumps(reports, indent=2))

    return reports, write_reports
