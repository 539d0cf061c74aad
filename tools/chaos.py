#!/usr/bin/env python3
"""A chaos run of the service: workers behind the client library's balanced target while the
world misbehaves around them, and what each side shows at the end.

    .venv/bin/python tools/chaos.py --workers 3 --clients 20 --minutes 3 --seed 1
    .venv/bin/python tools/chaos.py --workers 3 --clients 6 --minutes 1 --seed 1 --tls

It starts N `characters-jax serve` workers (the first alone: it fills the compilation cache;
--tls: a CA, the workers' certificate and a bearer token made on the fly) and M clients, each
a loop of sessions through the comma list of the workers (CharacterClient's balanced target:
round_robin with health checks). Drawn from --seed:
  - each client's sessions: whole clips (at real time, and as fast as the worker goes),
    drops (the stream cancelled, or the channel closed, after k chunks; a cancel while the
    session may still wait for a worker), bad images (a malformed PNG, a DDS file), bad
    audio (an odd byte count; a wrong format in `start`) and, with --tls, a wrong token;
  - health-watch churn: threads opening Health.Watch on fresh channels and cancelling it;
  - faults, each aimed at the worker of an anchor (a long listening session opened for it):
    a decoder SIGKILL (the anchor fails UNAVAILABLE, the supervisor starts the decoder
    again) and a worker SIGTERM (it drains: the anchor is cut CANCELLED, DRAIN_TIMEOUT; the
    worker exits 0 and is started again on its port). One fault at a time, each waiting for
    its anchor and for its worker's recovery, so the chaos lasts --minutes or until the last
    fault's recovery, whichever is later.
The run has a warm-up (the same traffic, no faults), after which each worker's threads, open
files and RSS are read (/proc/PID/status, /proc/PID/fd; its RPC pools filled first, see
fill_pools), then the chaos, then a settle and the same reading.

Checks (printed, and in --report JSON; exit status 0 when all hold): every session ended as
its kind expects, with a documented code and a message, never UNKNOWN, none past its
deadline; each fault's anchor ended as the fault expects; no session opened on a draining
worker; a killed decoder came back and its worker completed a session after it; every worker
answers health within 1 s; threads, open files and RSS ended within `Tolerance` of the
warm-up's; no traceback in the workers' logs and (real workers, from their metrics) no
UNKNOWN or INTERNAL in `characters_rpc_errors_total`, nothing admitted, no busy pool thread
and no live session once every client has gone.

The same engine runs in the suite (tests/test_serving_chaos.py), on fake-model workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import ipaddress
import json
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from characters_jax.client.character_client import CharacterClient
from characters_jax.client.credentials import ClientCredentials
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.client.targets import open_channel, parse_target
from characters_jax.config import RpcLimits
from characters_jax.processes import child_env
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.metrics_http import scrape
from characters_jax.wire.service import PCM_FORMAT, SERVICE_NAME

# The codes the service documents (README "Serving", "Security"; docs/deploy.md): a session
# ends with one of them and a message.
DOCUMENTED_CODES = frozenset({"OK", "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                              "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAUTHENTICATED"})
HEALTH_DEADLINE_S = 1.0
FPS = 24


# -- a process's resources ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProcStats:
    """Threads and RSS (/proc/PID/status) and open file descriptors (/proc/PID/fd)."""

    threads: int
    fds: int
    rss_kib: int

    def minus(self, other: ProcStats) -> ProcStats:
        return ProcStats(self.threads - other.threads, self.fds - other.fds, self.rss_kib - other.rss_kib)


def thread_names(pid: int) -> dict[str, int]:
    """The process's threads by name (/proc/PID/task/*/comm): gRPC's and XLA's name theirs,
    Python's threads carry the process's name."""
    names: dict[str, int] = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def python_thread_kinds(names: Sequence[str]) -> dict[str, int]:
    """Python thread names counted by kind: a session's id or a pool's thread number
    replaced by * (stepper-1a2b3c4d -> stepper-*, ThreadPoolExecutor-3_7 -> ThreadPoolExecutor-3_*)."""
    kinds: dict[str, int] = {}
    for name in names:
        kind = re.sub(r"-[0-9a-f]{8}$", "-*", re.sub(r"_\d+$", "_*", name))
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def proc_stats(pid: int) -> ProcStats:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    field = {k: v.split()[0] for k, _, v in (line.partition(":") for line in status.splitlines()) if v.strip()}
    return ProcStats(int(field["Threads"]), len(os.listdir(f"/proc/{pid}/fd")), int(field["VmRSS"]))


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far above its figures after the warm-up a worker may end. Both readings follow
    fill_pools, so the RPC pools are at about their bounds in both; threads: what filling
    may leave short of a bound (the spare threads of the CharacterService pool), gRPC's
    event-engine threads (it adds and retires them with load) and, in a fake worker, its
    in-process decoder server's pool; fds: a connection still closing; RSS: what the
    allocators keep. A leak per session outgrows these within a few dozen sessions."""

    threads: int = 6
    fds: int = 4
    rss_mib: float = 24.0

    def exceeded(self, delta: ProcStats) -> list[str]:
        out = []
        if delta.threads > self.threads:
            out.append(f"threads +{delta.threads} (tolerance +{self.threads})")
        if delta.fds > self.fds:
            out.append(f"open files +{delta.fds} (tolerance +{self.fds})")
        if delta.rss_kib > self.rss_mib * 1024:
            out.append(f"RSS +{delta.rss_kib / 1024:.1f} MiB (tolerance +{self.rss_mib:g} MiB)")
        return out


# -- TLS and tokens, made on the fly -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """A CA, the workers' certificate (for 127.0.0.1 and localhost), its key, the workers'
    token file and the client's credentials (the CA and the token)."""

    ca: str
    cert: str
    key: str
    tokens: str
    credentials: ClientCredentials
    wrong_token: ClientCredentials  # a token the workers do not know


def make_tls(directory: pathlib.Path) -> TlsFiles:
    """Writes a CA, a worker certificate and a token file under `directory`. Needs the
    cryptography package (the project's view extra brings it)."""
    import secrets

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(cn, issuer, ca=False, san=()):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        signer_name, signer_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
        b = (x509.CertificateBuilder().subject_name(name).issuer_name(signer_name).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=1)).add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = (b.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        return b.sign(signer_key, hashes.SHA256()), key

    def write(name, cert, key):
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption()))
        os.chmod(directory / f"{name}.key", 0o600)
        return str(directory / f"{name}.pem"), str(directory / f"{name}.key")

    directory.mkdir(parents=True, exist_ok=True)
    ca = issue("chaos ca", None, ca=True)
    ca_pem, _ = write("ca", *ca)
    cert, key = write("worker", *issue("worker", ca, san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    token = secrets.token_urlsafe(24)
    tokens = directory / "tokens"
    tokens.write_text(f"# bearer tokens of the chaos run\n{token}\n")
    roots = pathlib.Path(ca_pem).read_bytes()
    return TlsFiles(ca_pem, cert, key, str(tokens), ClientCredentials(root_certificates=roots, token=token),
                    ClientCredentials(root_certificates=roots, token=secrets.token_urlsafe(24)))


# -- worker processes --------------------------------------------------------------------------
def serve_command(config: str, *, port: int, state_file: pathlib.Path, worker_id: str, drain_timeout_s: float,
                  tls: TlsFiles | None = None) -> list[str]:
    """`characters-jax serve`'s command line for a chaos worker: the one place its flags and
    [serve] keys are spelled (metrics on any free port, the state file, the worker's id, the
    drain timeout, TLS and tokens)."""
    settings = {"metrics_port": 0, "worker_id": worker_id, "drain_timeout_s": drain_timeout_s}
    if tls is not None:
        settings.update(tls_cert=tls.cert, tls_key=tls.key, auth_tokens=tls.tokens)
    argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", config, "--port", str(port), "--state-file", str(state_file)]
    for key, value in settings.items():
        argv += ["--set", f"serve.{key}={json.dumps(value)}"]  # TOML: a JSON string or number is one
    return argv


class WorkerProcess:
    """A worker process started from `command(port, state_file)`; ready once its state file
    (JSON with "port" and "pid"; a real worker adds "metrics_port", "decoder_pid",
    "decoder_restarts") names a port. Started again on the same port after it exits."""

    def __init__(self, name: str, command: Callable[[int, pathlib.Path], list[str]], directory: pathlib.Path,
                 credentials: ClientCredentials | None = None, env: dict | None = None):
        self.name, self.command, self.directory, self.credentials = name, command, directory, credentials
        self.env = env if env is not None else child_env(1)
        directory.mkdir(parents=True, exist_ok=True)
        self.state_file = directory / "state.json"
        self.log_path = directory / "worker.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self._started_at = 0.0
        self.ready_s = 0.0

    def start(self, port: int | None = None) -> WorkerProcess:
        """Starts the process (on `port`, default: the port it had, else any free one)."""
        port = self.port if port is None else port
        self.state_file.unlink(missing_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"--- start {self.starts} on port {port}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(port, self.state_file), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        self._started_at = time.monotonic()
        return self

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_ready(self, timeout: float) -> WorkerProcess:
        """Raises RuntimeError when the process exits or is not ready within `timeout`."""
        while not self.state().get("port"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            if time.monotonic() - self._started_at > timeout:
                raise RuntimeError(f"worker {self.name} not ready within {timeout:g} s: {self.log_tail()}")
            time.sleep(0.05)
        self.port = int(self.state()["port"])
        self.ready_s = time.monotonic() - self._started_at
        return self

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> ProcStats:
        return proc_stats(self.pid)

    def python_threads(self, timeout: float = 5.0) -> dict[str, int] | None:
        """The process's Python threads by kind (python_thread_kinds), where its state names a
        "threads_file" that SIGUSR1 fills (fake workers); else None."""
        path = self.state().get("threads_file")
        if not path:
            return None
        path = pathlib.Path(path)
        path.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        limit = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > limit:
                return None
            time.sleep(0.02)
        return python_thread_kinds(json.loads(path.read_text()))

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if still running after `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`."""
        self.terminate()
        if self.wait(timeout) is None:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode

    def kill_decoder(self) -> int:
        """SIGKILLs the worker's supervised decoder process; returns its pid."""
        pid = int(self.state()["decoder_pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    def health(self, service: str = "", timeout: float = HEALTH_DEADLINE_S) -> tuple[str, float]:
        """(status name, seconds) of one Check on a fresh channel (connection included).
        Raises grpc.RpcError (DEADLINE_EXCEEDED past `timeout`)."""
        channel = open_channel(parse_target(self.address), self.credentials)
        try:
            t0 = time.monotonic()
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), time.monotonic() - t0
        finally:
            channel.close()

    def metrics(self) -> dict[str, float]:
        """The worker's Prometheus metrics ({} for a worker without a metrics port)."""
        port = self.state().get("metrics_port")
        return scrape("127.0.0.1", port, timeout=5) if port else {}

    def tracebacks(self) -> int:
        """Tracebacks in the worker's log (an exception logged, or one a handler let through)."""
        return self.log_path.read_text(errors="replace").count("Traceback (most recent call last)")


class IdleRequests:
    """A request stream that sends nothing until released."""

    def __init__(self, release: threading.Event):
        self._release = release

    def __iter__(self):
        return self

    def __next__(self):
        self._release.wait()
        raise StopIteration


def fill_pools(worker: WorkerProcess, limits: RpcLimits | None = None, timeout: float = 30.0) -> None:
    """Takes the worker's RPC thread pools to their bounds and lets go: as many idle Converse
    and reflection streams as admission takes plus the spare threads' worth more (refused),
    and a burst of concurrent health Checks. A pool keeps its threads, so a count of threads
    read after this holds the pools at (about) their full size, and what grows later is not
    pool growth. limits: the worker's (default: RpcLimits())."""
    limits = limits or RpcLimits()
    channel = open_channel(parse_target(worker.address), worker.credentials)
    release = threading.Event()
    try:
        converse = characters_pb2_grpc.CharacterServiceStub(channel).Converse
        info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        calls = [converse(IdleRequests(release), timeout=timeout) for _ in range(limits.max_character_rpcs + limits.spare_threads)]
        calls += [info(IdleRequests(release), timeout=timeout) for _ in range(limits.max_reflection_streams + limits.spare_threads)]
        check = health_pb2_grpc.HealthStub(channel).Check
        barrier = threading.Barrier(4 * limits.health_threads)

        def probe():
            barrier.wait()
            check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)

        probes = [threading.Thread(target=probe, daemon=True) for _ in range(barrier.parties)]
        for t in probes:
            t.start()
        for t in probes:
            t.join(timeout)
        refused = lambda: sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls)
        limit = time.monotonic() + timeout
        while refused() < 2 * limits.spare_threads and time.monotonic() < limit:
            time.sleep(0.05)
        for c in calls:
            c.cancel()
    finally:
        release.set()
        channel.close()


def start_workers(workers: Sequence[WorkerProcess], timeout: float) -> None:
    """The first alone (it fills the compilation cache), then the others together."""
    workers[0].start(0).wait_ready(timeout)
    for w in workers[1:]:
        w.start(0)
    for w in workers[1:]:
        w.wait_ready(timeout)


# -- sessions ----------------------------------------------------------------------------------
KINDS = {  # kind -> (weight, the status it ends with)
    "clip": (4, "OK"),  # speech at real time, played at real time, COMPLETED
    "fast_clip": (4, "OK"),  # speech and playout as fast as the worker goes
    "cancel": (2, "CANCELLED"),  # the stream cancelled after k chunks
    "close": (2, "CANCELLED"),  # the client's channel closed after k chunks
    "cancel_waiting": (1, "CANCELLED"),  # cancelled soon after asking (maybe before a worker took it)
    "bad_png": (1, "INVALID_ARGUMENT"),  # a damaged PNG
    "bad_dds": (1, "INVALID_ARGUMENT"),  # a DDS file (not an accepted format)
    "bad_format": (1, "INVALID_ARGUMENT"),  # a wrong audio format in start
    "odd_audio": (1, "INVALID_ARGUMENT"),  # an audio chunk of an odd byte count
    "wrong_token": (1, "UNAUTHENTICATED"),  # with TLS and tokens only
}
FAULT_ANCHOR = {"drain": ("CANCELLED", "DRAIN_TIMEOUT"), "decoder_kill": ("UNAVAILABLE", "ERROR")}


def speech(seconds: float, seed: int) -> np.ndarray:
    """A voice-like int16 signal (16 kHz)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (np.sin(2 * np.pi * 180 * t) * 6000 * (1 + np.sin(2 * np.pi * 3 * t)) + rng.standard_normal(t.size) * 300).astype(np.int16)


def png(seed: int, w: int = 96, h: int = 96) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def damaged_png(rng: random.Random) -> bytes:
    """A PNG cut short, or one whose bytes after the signature are noise."""
    good = png(rng.randrange(1 << 30))
    if rng.random() < 0.5:
        return good[: rng.randrange(16, len(good) // 2)]
    return good[:8] + rng.randbytes(rng.randrange(16, 400))


def dds(rng: random.Random) -> bytes:
    """A DDS file: its magic, a 124-byte header (DXT1, 64x64) and noise."""
    header = bytearray(124)
    for offset, value in ((0, 124), (4, 0x1007), (8, 64), (12, 64), (72, 32), (76, 4)):
        header[offset : offset + 4] = value.to_bytes(4, "little")
    header[80:84] = b"DXT1"
    return b"DDS " + bytes(header) + rng.randbytes(2048)


def wrong_format(rng: random.Random) -> pb.AudioFormat:
    return rng.choice([pb.AudioFormat(sample_rate_hz=8000, channels=1, encoding=pb.AudioFormat.PCM_S16LE),
                       pb.AudioFormat(sample_rate_hz=16000, channels=2, encoding=pb.AudioFormat.PCM_S16LE),
                       pb.AudioFormat(sample_rate_hz=16000, channels=1, encoding=pb.AudioFormat.PCM_F32LE),
                       pb.AudioFormat(sample_rate_hz=44100, channels=1)])


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """One session a client runs: what it sends and how it leaves."""

    kind: str
    image: bytes
    audio: bytes = b""  # s16le sent in 20 ms pieces
    audio_format: pb.AudioFormat | None = None  # None: 16 kHz mono s16le, as the worker wants
    realtime: bool = True  # speech sent and played at real time (else as fast as the worker goes)
    end_audio: bool = True  # the stream ends its audio (the session completes once it has played)
    drop: str = ""  # "cancel" | "close": the stream cancelled, or the channel closed ...
    drop_after_chunks: int | None = None  # ... after this many chunks
    drop_after_s: float | None = None  # ... this long after asking
    wrong_token: bool = False
    limits: pb.SessionLimits | None = None

    @property
    def expected(self) -> str:
        return KINDS[self.kind][1] if self.kind in KINDS else FAULT_ANCHOR[self.kind][0]


def plan_session(kind: str, rng: random.Random, image: bytes) -> SessionPlan:
    seed = rng.randrange(1 << 30)
    clip = speech(rng.uniform(0.4, 1.2), seed).tobytes()
    if kind in ("clip", "fast_clip"):
        return SessionPlan(kind, image, clip, realtime=kind == "clip")
    if kind in ("cancel", "close"):
        return SessionPlan(kind, image, speech(3.0, seed).tobytes(), end_audio=False, drop=kind, drop_after_chunks=rng.randrange(0, 9))
    if kind == "cancel_waiting":
        return SessionPlan(kind, image, clip, drop="cancel", drop_after_s=rng.uniform(0.0, 1.0))
    if kind == "bad_png":
        return SessionPlan(kind, damaged_png(rng), clip)
    if kind == "bad_dds":
        return SessionPlan(kind, dds(rng), clip)
    if kind == "bad_format":
        return SessionPlan(kind, image, clip, audio_format=wrong_format(rng))
    if kind == "odd_audio":
        return SessionPlan(kind, image, clip[: 640 * rng.randrange(1, 6)] + b"\x01", realtime=False)
    if kind == "wrong_token":
        return SessionPlan(kind, image, clip, wrong_token=True)
    if kind in FAULT_ANCHOR:  # a listening session (played at real time) that lasts until the fault ends it
        return SessionPlan(kind, image, end_audio=False)
    raise ValueError(f"unknown session kind {kind!r}")


def session_plans(seed: int, phase: str, client: int, kinds: Sequence[str]) -> Iterator[SessionPlan]:
    """The sessions a client runs in a phase, one after another, drawn from the seed: the
    first of kind `kinds[client % len(kinds)]` (so that with as many clients as kinds, each
    kind runs in every phase), then kinds by their weights."""
    rng = random.Random(f"{seed}/{phase}/client{client}")
    weights = [KINDS[k][0] for k in kinds]
    image = png(rng.randrange(1 << 30))
    yield plan_session(kinds[client % len(kinds)], rng, image)
    while True:
        yield plan_session(rng.choices(list(kinds), weights)[0], rng, image)


@dataclasses.dataclass
class Outcome:
    """How one session went, as its client saw it (times: time.monotonic())."""

    client: int
    kind: str
    expected: str
    asked: float
    code: str = ""
    message: str = ""
    state: str = ""  # the SessionEvent's state ("" without one)
    end_reason: str = ""
    worker: str = ""  # Session.worker_id ("" if no worker took it)
    opened: float | None = None
    first_chunk: float | None = None
    ended: float | None = None
    chunks: int = 0
    hung: bool = False  # still running at its deadline: the watchdog closed its channel

    @property
    def clear(self) -> bool:
        """A documented code; a message unless OK; no traceback or memory address in it."""
        if self.code not in DOCUMENTED_CODES or self.hung:
            return False
        if self.code != "OK" and not self.message.strip():
            return False
        return "Traceback" not in self.message and not re.search(r"0x[0-9a-f]{6,}", self.message)

    @property
    def as_expected(self) -> bool:
        if not self.clear or self.code != self.expected:
            return False
        if self.kind in ("clip", "fast_clip"):
            return self.state == "COMPLETED" and self.end_reason == "END_OF_AUDIO"
        if self.kind in FAULT_ANCHOR:
            return self.end_reason == FAULT_ANCHOR[self.kind][1]
        return True

    def summary(self) -> dict:
        out = dataclasses.asdict(self)
        for k in ("opened", "first_chunk", "ended"):
            out[k] = None if out[k] is None else round(out[k] - self.asked, 3)
        return out


class SessionRunner:
    """Runs one SessionPlan on a client's channel and fills its Outcome. A session still
    running at its deadline is hung: the channel is closed (the stream ends) and the outcome
    says so."""

    def __init__(self, target: str, credentials: ClientCredentials | None, wrong_credentials: ClientCredentials | None,
                 open_timeout_s: float, session_budget_s: float):
        self.target, self.credentials, self.wrong_credentials = target, credentials, wrong_credentials
        self.open_timeout_s, self.session_budget_s = open_timeout_s, session_budget_s

    def client(self, wrong_token: bool = False) -> CharacterClient:
        """A client (a channel of its own) of the target; wrong_token: with a token the workers do not know."""
        return CharacterClient(self.target, balanced=True, credentials=self.wrong_credentials if wrong_token else self.credentials)

    def run(self, client: CharacterClient, plan: SessionPlan, out: Outcome, on_open: Callable[[Outcome], None] | None = None) -> None:
        """Runs the session to its end on `client` (whose channel it may close: plan.drop
        "close", or at the deadline)."""
        deadline = threading.Timer(self.open_timeout_s + self.session_budget_s, self._hung, args=(client, out))
        deadline.daemon = True
        deadline.start()
        try:
            self._converse(client, plan, out, on_open)
        except Exception as err:  # noqa: BLE001 - the client library failing is an outcome too (not a clear status)
            out.code, out.message = f"client raised {type(err).__name__}", str(err)
        finally:
            deadline.cancel()
            out.ended = time.monotonic()

    @staticmethod
    def _hung(client: CharacterClient, out: Outcome) -> None:
        out.hung = True
        client.close()

    def _converse(self, client: CharacterClient, plan: SessionPlan, out: Outcome, on_open) -> None:
        clock = PlayoutClock(FPS, prebuffer_frames=8, realtime=plan.realtime)
        conv = client.conversation(image=plan.image, playout=clock, audio_format=plan.audio_format or PCM_FORMAT, limits=plan.limits,
                                   begin_with_speech=bool(plan.audio), open_timeout=self.open_timeout_s)
        stop = threading.Event()
        dropper = None
        if plan.drop_after_s is not None:
            dropper = threading.Timer(plan.drop_after_s, self._drop, args=(plan.drop, conv, client))
            dropper.daemon = True
            dropper.start()
        try:
            session = conv.wait_open()
            out.opened, out.worker = time.monotonic(), session.worker_id
            if on_open is not None:
                on_open(out)
            if plan.drop_after_chunks == 0:
                self._drop(plan.drop, conv, client)
            threading.Thread(target=self._send, args=(conv, plan, stop), name="chaos-send", daemon=True).start()
            for item in conv:
                if isinstance(item, pb.VideoChunk):
                    out.chunks += 1
                    if out.first_chunk is None:
                        out.first_chunk = time.monotonic()
                    if plan.drop_after_chunks is not None and out.chunks == plan.drop_after_chunks:
                        self._drop(plan.drop, conv, client)
                elif isinstance(item, pb.SessionEvent):
                    out.state, out.end_reason = pb.SessionState.Name(item.state), pb.EndReason.Name(item.end_reason)
            out.code = "OK"
        except grpc.RpcError as err:
            out.code, out.message = err.code().name, err.details() or ""
            final = conv.final
            if final is not None:
                out.state, out.end_reason = pb.SessionState.Name(final.state), pb.EndReason.Name(final.end_reason)
        finally:
            stop.set()
            if dropper is not None:
                dropper.cancel()
            conv.close()

    @staticmethod
    def _drop(how: str, conv, client: CharacterClient) -> None:
        if how == "close":
            client.close()
        else:
            conv.cancel()

    @staticmethod
    def _send(conv, plan: SessionPlan, stop: threading.Event) -> None:
        piece = 640  # 20 ms
        t0 = time.monotonic()
        for i, off in enumerate(range(0, len(plan.audio), piece)):
            if plan.realtime and stop.wait(max(0.0, t0 + i * 0.02 - time.monotonic())):
                return
            if stop.is_set():
                return
            conv.send_audio(plan.audio[off : off + piece])
        if plan.end_audio and not stop.is_set():
            conv.end_audio()


# -- the run -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fault:
    """At `at_s` into the chaos phase, `kind` ("drain" | "decoder_kill") hits the worker of an
    anchor session that opens `lead_s` before (at the phase's start at the earliest)."""

    kind: str
    at_s: float
    lead_s: float = 3.0

    @property
    def opens_at_s(self) -> float:
        return max(0.0, self.at_s - self.lead_s)


@dataclasses.dataclass(frozen=True)
class ChaosOptions:
    """The traffic (clients, health-watch churn threads, kinds of session), the phases'
    lengths, the deadlines and the resource tolerance of a chaos run; `seed` draws it all."""

    clients: int = 20
    warmup_s: float = 10.0
    chaos_s: float = 180.0
    seed: int = 1
    churn_threads: int = 4
    open_timeout_s: float = 300.0  # how long a client waits for a free worker
    session_budget_s: float = 60.0  # beyond the open timeout: a session's deadline
    restart_timeout_s: float = 300.0  # a drained worker's exit and its new start
    settle_s: float = 2.0  # after the last session, before reading the workers' resources ...
    settle_max_s: float = 20.0  # ... read again until within the tolerance or this long
    kinds: tuple[str, ...] = tuple(k for k in KINDS if k != "wrong_token")
    tolerance: Tolerance = Tolerance()


def fault_schedule(rng: random.Random, chaos_s: float, kinds: Sequence[str], lead_s: float = 3.0) -> list[Fault]:
    """The faults in slots spread over the chaos phase (each at a random point of the middle
    half of its slot), in a seed-shuffled order; each anchor opens lead_s before its fault."""
    kinds = list(kinds)
    rng.shuffle(kinds)
    slot = chaos_s / (len(kinds) + 1)
    return [Fault(kind, slot * (i + 0.75) + rng.uniform(0, slot * 0.5), lead_s) for i, kind in enumerate(kinds)]


class ChaosRun:
    """Clients, health-watch churn and faults against `workers` through one balanced target."""

    def __init__(self, workers: Sequence[WorkerProcess], options: ChaosOptions, faults: Sequence[Fault] = (),
                 tls: TlsFiles | None = None, log: Callable[[str], None] = print):
        self.workers, self.options, self.faults, self.tls, self.log = list(workers), options, list(faults), tls, log
        self.by_id: dict[str, WorkerProcess] = {}
        self.target = ",".join(w.address for w in self.workers)
        creds = tls.credentials if tls else None
        self.runner = SessionRunner(self.target, creds, tls.wrong_token if tls else None, options.open_timeout_s, options.session_budget_s)
        self.outcomes: list[Outcome] = []
        self._gate = threading.Event()  # clients start new sessions while it is set (an anchor waiting to open clears it)
        self._gate.set()
        self.opens: list[tuple[str, float]] = []  # (worker, when) of every session a worker took
        self._events = threading.Condition()  # notified when a session opens or ends
        self.anchors: list[dict] = []
        self.watches = 0
        self.watch_errors: dict[str, int] = {}
        self.baseline: dict[str, ProcStats] = {}
        self.end_stats: dict[str, ProcStats] = {}
        self.baseline_threads: dict[str, dict[str, int]] = {}
        self.end_threads: dict[str, dict[str, int]] = {}

    # -- clients and churn ----------------------------------------------------------------------
    def _client_loop(self, index: int, stop: threading.Event, phase: str) -> None:
        """Sessions one after another until `stop`: on one channel, except those that close
        theirs or present a wrong token (a channel of their own); a hung session's channel
        is replaced."""
        plans = session_plans(self.options.seed, phase, index, self.options.kinds)
        client = None
        while not stop.is_set():
            if not self._gate.wait(0.1):
                continue
            plan = next(plans)
            own_channel = plan.drop == "close" or plan.wrong_token
            if client is None:
                client = self.runner.client()
            channel = self.runner.client(plan.wrong_token) if own_channel else client
            out = Outcome(index, plan.kind, plan.expected, time.monotonic())
            self.runner.run(channel, plan, out, self._opened)
            with self._events:
                self.outcomes.append(out)
                self._events.notify_all()
            if own_channel:
                channel.close()
            elif out.hung:
                client = None
        if client is not None:
            client.close()

    def _opened(self, out: Outcome) -> None:
        with self._events:
            self.opens.append((out.worker, out.opened))
            self._events.notify_all()

    def _wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._events:
            return self._events.wait_for(predicate, timeout)

    def _churn_loop(self, index: int, stop: threading.Event) -> None:
        rng = random.Random(f"{self.options.seed}/churn{index}")
        creds = self.tls.credentials if self.tls else None
        while not stop.is_set():
            w = rng.choice(self.workers)
            channel = open_channel(parse_target(w.address), creds)
            try:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=rng.choice(["", SERVICE_NAME])), timeout=10)
                next(call)  # the current status, then the watch is cancelled
                call.cancel()
                with self._events:
                    self.watches += 1
            except grpc.RpcError as err:  # a worker restarting: UNAVAILABLE
                with self._events:
                    self.watch_errors[err.code().name] = self.watch_errors.get(err.code().name, 0) + 1
            finally:
                channel.close()
            stop.wait(rng.uniform(0.0, 0.05))

    def _traffic(self, phase: str, seconds: float, faults: bool = False) -> None:
        """Clients and churn for `seconds` (with the faults: and until the last one's
        recovery), then waits for every client's session in flight to end."""
        stop = threading.Event()
        threads = [threading.Thread(target=self._client_loop, args=(i, stop, phase), name=f"chaos-client{i}", daemon=True)
                   for i in range(self.options.clients)]
        threads += [threading.Thread(target=self._churn_loop, args=(i, stop), name=f"chaos-churn{i}", daemon=True)
                    for i in range(self.options.churn_threads)]
        t0 = time.monotonic()
        armed, failure = threading.Event(), []
        faulter = threading.Thread(target=self._run_faults, args=(t0, armed, failure), name="chaos-faults", daemon=True)
        if faults:
            faulter.start()
            armed.wait()  # an anchor that opens at the start has closed the gate: it goes first
        for t in threads:
            t.start()
        try:
            if faults:
                faulter.join()
                if failure:
                    raise failure[0]
            stop.wait(max(0.0, t0 + seconds - time.monotonic()))
        finally:
            stop.set()
            limit = time.monotonic() + self.options.open_timeout_s + self.options.session_budget_s + 10
            for t in threads:
                t.join(max(0.0, limit - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"threads still running past every deadline: {alive}")

    # -- faults ---------------------------------------------------------------------------------
    def _run_faults(self, t0: float, armed: threading.Event, failure: list) -> None:
        """The faults one after another; `armed` is set once the first anchor is under way
        or later than now; an exception lands in `failure`."""
        rng = random.Random(f"{self.options.seed}/faults")
        try:
            for fault in self.faults:
                if t0 + fault.opens_at_s > time.monotonic():
                    armed.set()
                    self._sleep_until(t0 + fault.opens_at_s)
                self._gate.clear()  # no new client session until the anchor has its worker
                armed.set()
                try:
                    self.anchors.append(self._fault(fault, t0, rng))
                finally:
                    self._gate.set()
        except Exception as err:  # noqa: BLE001 (raised again by _traffic, on its thread)
            failure.append(err)
        finally:
            armed.set()

    @staticmethod
    def _sleep_until(t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _fault(self, fault: Fault, t0: float, rng: random.Random) -> dict:
        """Opens an anchor session, hits its worker with the fault, waits for the anchor's end
        (and for a drained worker: its exit and its new start)."""
        plan = plan_session(fault.kind, rng, png(rng.randrange(1 << 30)))
        out = Outcome(-1, plan.kind, plan.expected, time.monotonic())
        opened = threading.Event()
        client = self.runner.client()

        def on_open(o: Outcome) -> None:
            self._opened(o)
            opened.set()

        anchor = threading.Thread(target=self.runner.run, args=(client, plan, out, on_open), name="chaos-anchor", daemon=True)
        anchor.start()
        report: dict = {"fault": fault.kind, "scheduled_s": round(fault.at_s, 2)}
        opened.wait(self.options.open_timeout_s)
        self._gate.set()
        if not opened.is_set():
            anchor.join(self.options.session_budget_s + 10)
            client.close()
            report["error"] = "the anchor session never opened"
            report["anchor"] = out.summary()
            return report
        self._sleep_until(t0 + fault.at_s)
        worker = self.by_id[out.worker]
        report.update(worker=out.worker, at_s=round(time.monotonic() - t0, 2))
        if fault.kind == "decoder_kill":
            before = int(worker.state().get("decoder_restarts", 0))
            report["decoder_pid"] = worker.kill_decoder()
            report["decoder_restarts_before"] = before
        else:
            worker.terminate()
        report["hit"] = time.monotonic()
        anchor.join(self.options.session_budget_s + self.options.open_timeout_s + 10)
        client.close()
        report["anchor"] = out.summary()
        report["anchor_as_expected"] = out.as_expected
        if fault.kind == "decoder_kill":  # the worker recovers: it completes a clip
            self._wait_for(lambda: any(o.worker == out.worker and o.kind in ("clip", "fast_clip") and o.as_expected and o.opened > report["hit"]
                                       for o in self.outcomes), self.options.open_timeout_s)
            report["decoder_restarts"] = int(worker.state().get("decoder_restarts", 0)) - report["decoder_restarts_before"]
        else:
            rc = worker.wait(self.options.restart_timeout_s)
            report["exit_code"] = rc
            report["exited"] = time.monotonic()
            report["exit_s"] = round(report["exited"] - report["hit"], 2)
            if rc is not None:
                worker.start(worker.port)
                try:
                    worker.wait_ready(self.options.restart_timeout_s)
                    report["restarted"] = time.monotonic()
                    report["restart_ready_s"] = round(worker.ready_s, 2)
                    self._wait_for(lambda: any(w == out.worker and t > report["restarted"] for w, t in self.opens), self.options.open_timeout_s)
                except RuntimeError as err:
                    report["error"] = str(err)
        return report

    # -- phases ---------------------------------------------------------------------------------
    def run(self) -> dict:
        self.by_id = {self._worker_id(w): w for w in self.workers}
        self.log(f"chaos: seed {self.options.seed}; {len(self.workers)} workers ({self.target}), {self.options.clients} clients, "
                 f"{self.options.churn_threads} churn threads; warm-up {self.options.warmup_s:g} s, chaos {self.options.chaos_s:g} s; "
                 f"faults {[(f.kind, round(f.at_s, 1)) for f in self.faults]}")
        self._traffic("warmup", self.options.warmup_s)
        self.baseline = self._settled(None)
        self.baseline_threads = {name: self._threads(w) for name, w in self.by_id.items()}
        warm = len(self.outcomes)
        self.log(f"warm-up: {warm} sessions; baseline {[(k, dataclasses.astuple(v)) for k, v in self.baseline.items()]}")
        t_chaos = time.monotonic()
        self._traffic("chaos", self.options.chaos_s, faults=True)
        chaos_wall = time.monotonic() - t_chaos
        self.end_stats = self._settled(self.baseline)
        self.end_threads = {name: self._threads(w) for name, w in self.by_id.items()}
        return self.report(warm, chaos_wall)

    @staticmethod
    def _threads(w: WorkerProcess) -> dict:
        """The worker's threads by OS name and, where it tells them, its Python threads by kind."""
        return {"os": thread_names(w.pid), "python": w.python_threads()}

    def _worker_id(self, w: WorkerProcess) -> str:
        return w.state().get("worker_id") or w.name

    def _settled(self, baseline: dict[str, ProcStats] | None) -> dict[str, ProcStats]:
        """Every worker idle (SERVING) with its pools at their bounds (fill_pools), then
        `settle_s`, then its resources, read again until within the tolerance of `baseline`
        or `settle_max_s`."""
        limit = time.monotonic() + self.options.settle_max_s + 30
        for w in self.workers:
            fill_pools(w)
            while True:
                try:
                    if w.health(SERVICE_NAME, timeout=5.0)[0] == "SERVING":
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > limit:
                    raise RuntimeError(f"worker {w.name} did not become idle")
                time.sleep(0.1)
        time.sleep(self.options.settle_s)
        until = time.monotonic() + self.options.settle_max_s
        while True:
            stats = {name: w.stats() for name, w in self.by_id.items()}
            if baseline is None or time.monotonic() > until or not any(
                    self.options.tolerance.exceeded(stats[n].minus(baseline[n])) for n in stats):
                return stats
            time.sleep(0.5)

    # -- the report -------------------------------------------------------------------------------
    def report(self, warm: int, chaos_wall: float) -> dict:
        chaos = self.outcomes[warm:]
        everything = self.outcomes
        checks: list[tuple[str, bool, str]] = []

        def check(name: str, ok: bool, detail: object = "") -> None:
            checks.append((name, bool(ok), str(detail)))

        by_code: dict[str, int] = {}
        by_kind: dict[str, dict[str, int]] = {}
        for o in chaos:
            key = o.code if o.code != "OK" else f"OK/{o.state or '-'}"
            by_code[key] = by_code.get(key, 0) + 1
            by_kind.setdefault(o.kind, {})[key] = by_kind.setdefault(o.kind, {}).get(key, 0) + 1
        messages: dict[str, dict[str, int]] = {}  # code -> message (ids and numbers masked) -> sessions
        for o in everything:
            if o.code != "OK":
                text = re.sub(r"\b[0-9a-f]{32}\b", "<id>", o.message)[:160]
                messages.setdefault(o.code, {})[text] = messages.setdefault(o.code, {}).get(text, 0) + 1
        unclear = [o.summary() for o in everything if not o.clear]
        unexpected = [o.summary() for o in everything if o.clear and not o.as_expected]
        hung = [o.summary() for o in everything if o.hung]
        check("every session ended with a documented code and a message", not unclear, unclear[:5])
        check("every session ended as its kind expects", not unexpected, unexpected[:5])
        check("no client hung past its deadline", not hung, hung[:5])
        check("sessions completed during the chaos", sum(o.kind in ("clip", "fast_clip") and o.as_expected for o in chaos) > 0)

        for a in self.anchors:
            name = f"{a['fault']} on {a.get('worker', '?')}"
            check(f"{name}: the anchor session ended as the fault expects", a.get("anchor_as_expected") and "error" not in a, a)
            if a["fault"] == "drain" and "hit" in a:
                check(f"{name}: the worker exited 0", a.get("exit_code") == 0, a.get("exit_code"))
                end = a.get("exited", float("inf"))
                landed = [o.summary() for o in self.outcomes if o.worker == a["worker"] and o.opened is not None and a["hit"] < o.opened < end]
                check(f"{name}: no session opened on the draining worker", not landed, landed[:3])
                after = [o for o in self.outcomes if o.worker == a["worker"] and o.opened is not None and o.opened > a.get("restarted", float("inf"))]
                a["sessions_after_restart"] = len(after)
                check(f"{name}: sessions opened on the worker after its restart", after)
            if a["fault"] == "decoder_kill" and "hit" in a:
                check(f"{name}: the decoder was started again", a["decoder_restarts"] >= 1, a["decoder_restarts"])
                after = [o for o in self.outcomes if o.worker == a["worker"] and o.kind in ("clip", "fast_clip") and o.as_expected and o.opened > a["hit"]]
                a["clips_completed_after"] = len(after)
                check(f"{name}: the worker completed a clip after it", after)

        health = {}
        for name, w in self.by_id.items():
            try:
                worst = max(w.health(service)[1] for service in ("", SERVICE_NAME) for _ in range(3))
                health[name] = round(worst * 1e3, 1)
            except grpc.RpcError as err:
                health[name] = f"{err.code().name}: {err.details()}"
        check(f"every worker answers health within {HEALTH_DEADLINE_S:g} s", all(isinstance(v, float) for v in health.values()), health)

        resources = {}
        for name in self.by_id:
            start, end = self.baseline[name], self.end_stats[name]
            delta = end.minus(start)
            resources[name] = {"start": dataclasses.asdict(start), "end": dataclasses.asdict(end), "delta": dataclasses.asdict(delta),
                               "process_starts": self.by_id[name].starts,
                               "threads_by_name": {"start": self.baseline_threads[name], "end": self.end_threads[name]}}
            over = self.options.tolerance.exceeded(delta)
            check(f"{name}: threads, open files and RSS within the tolerance", not over, over)

        logs = {}
        for name, w in self.by_id.items():
            metrics = w.metrics()
            errors = {k: v for k, v in metrics.items() if k.startswith("characters_rpc_errors_total") and ('code="UNKNOWN"' in k or 'code="INTERNAL"' in k)}
            logs[name] = {"tracebacks": w.tracebacks(), "unknown_or_internal": errors}
            check(f"{name}: no traceback in its log, no UNKNOWN or INTERNAL counted", not logs[name]["tracebacks"] and not errors, logs[name])
            if metrics:  # a real worker: nothing left admitted or live once every client has gone
                held = {k: v for k, v in metrics.items() if v and re.match(
                    r'characters_rpc_admitted|characters_rpc_pool_busy|characters_sessions\{state="(NOT_READY|READY|RUNNING)"\}', k)}
                logs[name]["held_at_end"] = held
                check(f"{name}: no RPC admitted, no pool thread busy, no live session at the end", not held, held)

        firsts = [o.first_chunk - o.opened for o in chaos if o.first_chunk is not None and o.opened is not None]
        waits = [o.opened - o.asked for o in chaos if o.opened is not None]
        report = {
            "seed": self.options.seed, "workers": len(self.workers), "clients": self.options.clients, "tls": self.tls is not None,
            "warmup_sessions": warm, "chaos_s": round(chaos_wall, 1), "sessions": len(chaos), "by_code": by_code, "by_kind": by_kind,
            "kinds_run": sorted({o.kind for o in everything}),
            "messages": messages, "first_chunk_s": _percentiles(firsts), "wait_for_worker_s": _percentiles(waits), "health_watches": self.watches,
            "health_watch_errors": self.watch_errors, "faults": [{k: v for k, v in a.items() if k not in ("hit", "exited", "restarted")} for a in self.anchors],
            "health_at_end_ms": health, "resources": resources, "tolerance": dataclasses.asdict(self.options.tolerance), "logs": logs,
            "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks], "ok": all(ok for _, ok, _ in checks),
        }
        return report


def _percentiles(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(statistics.median(values), 3), "p99": round(float(np.percentile(values, 99)), 3),
            "max": round(max(values), 3)}


def print_report(report: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)
    p(f"seed {report['seed']}: {report['workers']} workers, {report['clients']} clients{' (TLS + tokens)' if report['tls'] else ''}; "
      f"{report['sessions']} sessions in {report['chaos_s']} s of chaos (after {report['warmup_sessions']} in the warm-up)")
    p(f"  by code: {json.dumps(report['by_code'], sort_keys=True)}")
    for kind, codes in sorted(report["by_kind"].items()):
        p(f"    {kind}: {json.dumps(codes, sort_keys=True)}")
    for code, texts in sorted(report["messages"].items()):
        for text, n in sorted(texts.items(), key=lambda kv: -kv[1])[:6]:
            p(f"    {code} x{n}: {text!r}")
    p(f"  first chunk after the Session: {report['first_chunk_s']}; wait for a worker: {report['wait_for_worker_s']}")
    p(f"  health watches opened and cancelled: {report['health_watches']} (errors {report['health_watch_errors']})")
    for f in report["faults"]:
        a = f.get("anchor", {})
        extra = {k: f[k] for k in ("exit_code", "exit_s", "restart_ready_s", "sessions_after_restart", "decoder_restarts", "clips_completed_after") if k in f}
        p(f"  {f['fault']} at {f.get('at_s', '?')} s on {f.get('worker', '?')}: anchor {a.get('code')} {a.get('state')} {a.get('end_reason')} "
          f"({a.get('message', '')[:90]!r}) {extra}")
    p(f"  health at the end (worst of 6 Checks, ms): {report['health_at_end_ms']}")
    for name, r in report["resources"].items():
        p(f"  {name}: threads/fds/RSS KiB {r['start']} -> {r['end']} (delta {r['delta']}), process starts {r['process_starts']}")
        start, end = r["threads_by_name"]["start"], r["threads_by_name"]["end"]
        p(f"      threads by name {start['os']} -> {end['os']}")
        if start["python"] is not None and end["python"] is not None:
            grew = {k: end["python"].get(k, 0) - start["python"].get(k, 0) for k in sorted(set(start["python"]) | set(end["python"]))}
            p(f"      Python threads by kind {end['python']}; changed {({k: d for k, d in grew.items() if d})}")
    for c in report["checks"]:
        p(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}" + ("" if c["ok"] else f": {c['detail'][:400]}"))
    p("ALL CHECKS HOLD" if report["ok"] else "SOME CHECKS FAILED")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--minutes", type=float, default=3.0, help="length of the chaos phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tls", action="store_true", help="TLS and bearer tokens (a CA, a certificate and a token made for the run)")
    ap.add_argument("--config", default="tiny", help="the workers' config (default: tiny)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of traffic before the baseline is read")
    ap.add_argument("--drain-timeout", type=float, default=2.0, help="the workers' serve.drain_timeout_s (seconds)")
    ap.add_argument("--churn-threads", type=int, default=4)
    ap.add_argument("--decoder-kills", type=int, default=None, help="default: one a minute (at least one)")
    ap.add_argument("--drains", type=int, default=None, help="default: one every two minutes (at least one)")
    ap.add_argument("--workdir", default=None, help="logs and state files (default: a temporary directory, kept)")
    ap.add_argument("--report", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers: at least 2 (a drained worker's sessions go to the others)")
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="characters-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{args.seed}/schedule")
    chaos_s = args.minutes * 60
    kills = max(1, round(args.minutes)) if args.decoder_kills is None else args.decoder_kills
    drains = max(1, round(args.minutes / 2)) if args.drains is None else args.drains
    faults = fault_schedule(rng, chaos_s, ["decoder_kill"] * kills + ["drain"] * drains)
    tls = make_tls(workdir / "tls") if args.tls else None
    kinds = tuple(k for k in KINDS if tls is not None or k != "wrong_token")
    options = ChaosOptions(clients=args.clients, warmup_s=args.warmup, chaos_s=chaos_s, seed=args.seed, churn_threads=args.churn_threads, kinds=kinds)
    workers = []
    for i in range(args.workers):
        def command(port, state_file, i=i):
            return serve_command(args.config, port=port, state_file=state_file, worker_id=f"w{i}", drain_timeout_s=args.drain_timeout, tls=tls)
        workers.append(WorkerProcess(f"w{i}", command, workdir / f"w{i}", tls.credentials if tls else None))
    print(f"logs and state files in {workdir}", flush=True)
    try:
        start_workers(workers, timeout=600)
        print(f"workers ready in {[round(w.ready_s, 1) for w in workers]} s", flush=True)
        report = ChaosRun(workers, options, faults, tls, log=lambda s: print(s, flush=True)).run()
    finally:
        codes = [w.stop() for w in workers]
    report["stop_exit_codes"] = codes
    report["workdir"] = str(workdir)
    print_report(report)
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
