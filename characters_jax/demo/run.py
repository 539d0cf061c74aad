"""`characters-jax demo`: the whole stack on localhost in one command.

Starts the generator worker (which starts and supervises its decoder process), waits until
it is ready, runs the client at real-time pace, writes out/demo.mp4 and out/demo_report.json,
prints the summary, and shuts the worker down with SIGTERM. With trained weights (the talking
demonstrator's, bundled) the inputs are the weights' held-out demo clip (a portrait and speech
of an identity and a voice never trained on) and the report scores the video's lip sync
against the clip's ground-truth mouth track, and against another clip's track (the shuffled
baseline); with random weights, a drawn portrait and a synthesized speech clip.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time

from characters_jax.demo import assets
from characters_jax.processes import child_env, terminate


def demo_command(args) -> int:
    from characters_jax.audio.pcm import read_wav
    from characters_jax.audio.timeline import Timeline
    from characters_jax.client.mp4 import probe_mp4
    from characters_jax.client.talk import TalkOptions, print_summary, run_talk
    from characters_jax.config.arguments import config_from_args, set_argv
    from characters_jax.weights.directory import checkpoint_path, demo_clip

    cfg = config_from_args(args)
    startup_timeout_s = cfg.serve.startup_timeout_s
    # the worker checks the weights against the config (a wrong one: it exits 2, its log says
    # why); this process starts no JAX backend while the worker holds the device
    checkpoint = checkpoint_path(args.checkpoint, cfg.name)
    if checkpoint is not None and not checkpoint.exists():
        print(f"characters-jax demo: --checkpoint: weights directory {checkpoint} does not exist", file=sys.stderr)
        return 2
    checkpoint = str(checkpoint.resolve()) if checkpoint else None
    clip = demo_clip(checkpoint)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    image = pathlib.Path(args.image or (clip and clip["portrait"]) or assets.PORTRAIT)
    audio = pathlib.Path(args.audio or (clip and clip["speech"]) or assets.SPEECH)
    tracks = clip["tracks"] if clip and not args.image and not args.audio else None
    mp4, report_path, log_path = out_dir / "demo.mp4", out_dir / "demo_report.json", out_dir / "worker.log"
    t0 = time.monotonic()
    weights = checkpoint or "random weights"
    print(f"demo: config {cfg.name}, {weights}; {image.name} + {audio.name}; worker log -> {log_path}", flush=True)
    with tempfile.TemporaryDirectory(prefix="characters-demo-") as tmp:
        state_file = pathlib.Path(tmp) / "worker.json"
        argv = [sys.executable, "-m", "characters_jax.cli", "serve", "--config", args.config, "--host", "127.0.0.1", "--port", "0", "--state-file", str(state_file), "--checkpoint", checkpoint or "none",
                "--set", "serve.metrics_port=0", *set_argv(args.set)]
        with open(log_path, "w") as log:
            worker = subprocess.Popen(argv, env=child_env(1), stdout=log, stderr=subprocess.STDOUT)
            try:
                print("demo: starting the worker and its decoder process (compiling)...", flush=True)
                while not state_file.exists():
                    if worker.poll() is not None:
                        lines = [s for s in log_path.read_text(errors="replace").splitlines() if s.strip()]
                        print(f"demo: the worker exited with code {worker.returncode}: {lines[-1] if lines else ''}; "
                              f"see {log_path}", file=sys.stderr)
                        return 1
                    if time.monotonic() - t0 > startup_timeout_s:
                        print(f"demo: the worker was not ready after {startup_timeout_s:g} s (serve.startup_timeout_s); "
                              f"see {log_path}", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
                state = json.loads(state_file.read_text())
                ready_s = time.monotonic() - t0
                print(f"demo: worker ready in {ready_s:.1f} s on port {state['port']} (metrics on {state['metrics_port']}); streaming {audio.name} at real-time pace", flush=True)
                summary = run_talk(f"127.0.0.1:{state['port']}", image, audio, mp4, prompt=args.prompt, options=TalkOptions(seed=1))
            finally:
                terminate(worker)
    samples, fmt = read_wav(str(audio))
    expected = Timeline.from_config(cfg).steps_for(len(samples)) * cfg.video.frames_per_step
    probe = probe_mp4(mp4)
    report = {"config": cfg.name, "weights": weights, "image": str(image), "audio": str(audio), "worker_ready_s": round(ready_s, 2), "total_s": round(time.monotonic() - t0, 2), "expected_frames": expected, "mp4": probe, "worker_exit_code": worker.returncode, **summary}
    if tracks is not None and probe["video_frames"] == expected:
        report["lip_sync"] = lip_sync(mp4, tracks)
    report_path.write_text(json.dumps(report, indent=2))
    print(f"demo: wrote {mp4} ({probe['video_frames']} frames of {probe['width']}x{probe['height']}, width x height; {probe['audio_seconds']:.2f} s audio) and {report_path}")
    print_summary(summary)
    if "lip_sync" in report:
        ls = report["lip_sync"]
        print(f"demo: lip sync (mouth probe vs the clip's ground-truth mouth track): confidence {ls['own']['confidence']:.3f} "
              f"at lag {ls['own']['lag']:+d} frames; against another clip's track (shuffled audio) {ls['shuffled']['confidence']:.3f}")
    ok = probe["video_frames"] == expected and probe["audio_streams"] == 1 and worker.returncode == 0 and summary.get("session_state") == "COMPLETED"
    print("demo: OK" if ok else "demo: FAILED (see the report)")
    return 0 if ok else 1


def lip_sync(mp4: pathlib.Path, tracks_path: pathlib.Path) -> dict:
    """Lip sync of the MP4's frames against the clip's own ground-truth mouth track and
    against another clip's ("own", "shuffled" in the tracks file: [T, 2] jaw, width)."""
    import av
    import numpy as np

    from characters_jax.lipsync.score import score

    with av.open(str(mp4)) as c:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    with np.load(tracks_path) as z:
        tracks = {k: z[k] for k in ("own", "shuffled")}
    n = min(len(frames), *(len(v) for v in tracks.values()))
    out = {}
    for k, track in tracks.items():
        s = score(frames[:n], track[:n])
        out[k] = {"peak": round(s.peak, 4), "lag": s.lag, "confidence": round(s.confidence, 4)}
    out["frames"] = n
    return out
