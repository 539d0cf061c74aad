"""`characters-jax talk`: one session against a worker, written to an MP4 with a summary."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import grpc

from characters_jax.audio.pcm import read_wav
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.serving.client import CharacterClient
from characters_jax.serving.mp4 import write_mp4

_ENC = {"s16le": pb.AudioFormat.PCM_S16LE}


def run_talk(address: str, image_path, audio_path, out_path, *, prompt: str = "", seed: int = 0, realtime: bool = True, progress=sys.stderr, connect_timeout: float = 60.0) -> dict:
    """Runs a session and writes `out_path`. Returns the summary dict. Raises grpc.RpcError."""
    image = pathlib.Path(image_path).read_bytes()
    samples, fmt = read_wav(str(audio_path))
    with CharacterClient(address) as client:
        client.wait_ready(connect_timeout)
        t0 = time.monotonic()
        session = client.create_session(image, prompt=prompt, seed=seed)
        create_s = time.monotonic() - t0
        fps = session.fps

        def on_chunk(c):
            n = c.first_frame_index + len(c.frames)
            if progress and (n % fps == 0):
                print(f"  {n / fps:5.1f} s of video  step {c.step_index:4d}  diffusion {c.diffusion_ms:6.1f} ms  decode {c.decode_ms:6.1f} ms", file=progress, flush=True)

        try:
            result = client.converse(session.session_id, samples.tobytes(), fps=fps, realtime=realtime, sample_rate=fmt.sample_rate_hz, channels=fmt.channels, encoding=_ENC.get(fmt.encoding, pb.AudioFormat.ENCODING_UNSPECIFIED), on_chunk=on_chunk)
        except grpc.RpcError:
            try:  # free the worker now rather than at its READY timeout
                client.close_session(session.session_id)
            except grpc.RpcError:
                pass
            raise
        final = client.get_session(session.session_id)
    frames = result.frames
    if frames:
        write_mp4(out_path, frames, result.audio, fps=fps, sample_rate=fmt.sample_rate_hz)
    summary = {"session_id": session.session_id, "create_session_s": round(create_s, 3), "audio_seconds": round(len(samples) / fmt.sample_rate_hz, 3), **result.summary(fps), "session_state": pb.SessionState.Name(final.state), "video": {"width": session.width, "height": session.height, "fps": fps}, "out": str(out_path)}
    return summary


def print_summary(summary: dict, file=sys.stdout) -> None:
    keys = [("frames", "frames"), ("sustained_fps", "sustained fps"), ("playout_underruns", "playout underruns"), ("step_ms_p50", "step (diffusion) p50 ms"), ("step_ms_p99", "step (diffusion) p99 ms"), ("decode_ms_p50", "decode p50 ms"), ("period_ms_p50", "step period p50 ms"), ("audio_to_frame_latency_s_first", "audio -> first frame latency s"), ("audio_to_frame_latency_s_p50", "audio -> frame latency p50 s"), ("session_state", "session")]
    for k, label in keys:
        if k in summary:
            print(f"  {label:34s} {summary[k]}", file=file)


def talk_command(args) -> int:
    try:
        summary = run_talk(args.server, args.image, args.audio, args.out, prompt=args.prompt, seed=args.seed, realtime=not args.fast)
    except grpc.RpcError as err:
        print(f"characters-jax talk: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    print_summary(summary)
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(summary, indent=2))
    return 0
