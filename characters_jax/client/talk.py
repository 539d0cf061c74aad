"""`characters-jax talk`: one session against a worker (or any of a set of workers), written
to an MP4 with a summary.

The session opens on its own Converse stream (so a balanced target works: the first idle
worker takes it), the WAV plays as one speech segment from the first frame, and the session
ends once it has played. Its options (`TalkOptions`) are the `talk` table of
`--set talk.KEY=VALUE`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import grpc

from characters_jax.audio.pcm import read_wav
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.credentials import ClientCredentials, load_client_credentials
from characters_jax.client.mp4 import write_mp4
from characters_jax.protos_gen import characters_pb2 as pb

_ENC = {"s16le": pb.AudioFormat.PCM_S16LE}


@dataclasses.dataclass(frozen=True)
class TalkOptions:
    """A session of `talk` (the `talk` table: `--set talk.fast=true`)."""

    seed: int = 0  # the session's seed (0: the worker draws one)
    fast: bool = False  # send the audio at once (bounded ahead of the video) instead of at real-time pace
    max_duration_s: float = 0.0  # ask for a shorter max_duration than the worker's (0: the worker's)
    idle_timeout_s: float = 0.0  # ask for a shorter idle_timeout than the worker's (0: the worker's)
    open_timeout_s: float = 300.0  # seconds to wait for an idle worker to take the session
    # retry a refused session (busy: RESOURCE_EXHAUSTED, draining: UNAVAILABLE) until open_timeout_s;
    # on for a list or DNS target whatever this says; for one address that is a balancing proxy (Envoy)
    wait_for_worker: bool = False

    def __post_init__(self):
        for name in ("max_duration_s", "idle_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: the worker's), got {getattr(self, name)}")
        if not self.open_timeout_s > 0:
            raise ValueError(f"open_timeout_s: must be > 0, got {self.open_timeout_s}")


def run_talk(target: str, image_path, audio_path, out_path, *, prompt: str = "", options: TalkOptions = TalkOptions(),
             progress=sys.stderr, credentials: ClientCredentials | None = None) -> dict:
    """Runs a session and writes `out_path`. Returns the summary dict. Raises grpc.RpcError.
    credentials: TLS and a bearer token (None: plaintext)."""
    image = pathlib.Path(image_path).read_bytes()
    samples, fmt = read_wav(str(audio_path))
    limits = pb.SessionLimits(max_duration_s=options.max_duration_s, idle_timeout_s=options.idle_timeout_s)
    with CharacterClient(target, reopen=options.wait_for_worker or None, credentials=credentials) as client:
        t0 = time.monotonic()
        opened = {}

        def on_chunk(c):
            opened.setdefault("first_chunk_s", time.monotonic() - t0)
            n = c.first_frame_index + len(c.frames)
            if progress and (n % 24 == 0):
                print(f"  {n / 24:5.1f} s of video  step {c.step_index:4d}  diffusion {c.diffusion_ms:6.1f} ms  decode {c.decode_ms:6.1f} ms", file=progress, flush=True)

        result = client.converse(None, samples.tobytes(), image=image, prompt=prompt, seed=options.seed, limits=limits,
                                 realtime=not options.fast,
                                 sample_rate=fmt.sample_rate_hz, channels=fmt.channels, encoding=_ENC.get(fmt.encoding, pb.AudioFormat.ENCODING_UNSPECIFIED),
                                 on_chunk=on_chunk, open_timeout=options.open_timeout_s)
    session = result.session
    fps = session.fps
    frames = result.frames
    if frames:
        write_mp4(out_path, frames, result.audio, fps=fps, sample_rate=fmt.sample_rate_hz)
    final = result.final_event
    return {"session_id": session.session_id, "worker_id": session.worker_id, "first_chunk_s": round(opened.get("first_chunk_s", float("nan")), 3),
            "audio_seconds": round(len(samples) / fmt.sample_rate_hz, 3), **result.summary(fps),
            "session_state": pb.SessionState.Name(final.state) if final else "UNKNOWN",
            "video": {"width": session.width, "height": session.height, "fps": fps}, "out": str(out_path)}


def print_summary(summary: dict, file=sys.stdout) -> None:
    keys = [("worker_id", "worker"), ("frames", "frames"), ("sustained_fps", "sustained fps"), ("playout_underruns", "playout underruns"),
            ("step_ms_p50", "step (diffusion) p50 ms"), ("step_ms_p99", "step (diffusion) p99 ms"), ("decode_ms_p50", "decode p50 ms"),
            ("period_ms_p50", "step period p50 ms"), ("audio_to_frame_latency_s_first", "audio -> first frame latency s"),
            ("audio_to_frame_latency_s_p50", "audio -> frame latency p50 s"), ("session_state", "session"), ("end_reason", "ended by")]
    for k, label in keys:
        if k in summary:
            print(f"  {label:34s} {summary[k]}", file=file)


def talk_command(args) -> int:
    from characters_jax.config.loader import with_sets

    try:
        options = with_sets(TalkOptions(), "talk", args.set)
        credentials = load_client_credentials(args.credentials) if args.credentials else None
        summary = run_talk(args.server, args.image, args.audio, args.out, prompt=args.prompt, options=options,
                           credentials=credentials)
    except grpc.RpcError as err:
        print(f"characters-jax talk: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"characters-jax talk: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    print_summary(summary)
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(summary, indent=2))
    return 0
