"""A session that outlives two workers and a crash, on real worker processes over loopback
(a script: it takes minutes):

    python tools/migration_run.py [--config talking] [--checkpoint checkpoints/talking]
                                  [--seconds 60] [--interval 2] [--out FILE.json]

Five `characters-jax serve` workers (each with its decoder process) of the config and its
trained weights: `ref`, without a snapshot store, and w0..w3, sharing one store with periodic
snapshots every --interval seconds. The input is the weights' held-out demo clip: its
portrait, and its speech repeated to --seconds (its mouth track repeated alike); one speech
segment, the video beginning with it, no input jitter buffer, the speech sent at real-time
pace LEAD_S ahead (its first LEAD_S in the first message), so every run places the same
speech on the same steps. The client plays out on a 24 fps PlayoutClock (its default
prebuffer, the worker's default lead) that reports to the worker and counts underruns.

Three sessions, one after the other:
  reference  on `ref` alone: the uninterrupted run;
  migrated   behind the client's balancer over w0, w1, w2: SIGTERM on the serving worker at
             a third of the clip and on the next serving worker at two thirds (two drains,
             each a migration to an idle worker);
  crash      behind the balancer over w2 (the survivor) and w3: SIGKILL on the serving
             worker halfway, after a periodic snapshot; the client resumes from the last
             snapshot it heard of.
Each run's chunks are checked (steps, frame timestamps and audio samples contiguous, every
speech sample once and in order) and compared with the reference step for step (frames and
audio bytes); each run's whole video is scored for lip sync against the clip's mouth track
(lipsync.score, as `characters-jax demo` reports it) and against another clip's track (the
shuffled baseline). Step times are the worker's (diffusion, decode, step period: what the
chunks carry), reported as they are, with the steps over the real-time budget. Prints a
table and writes every figure as JSON to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from serving_harness import Recorder, Worker, timeline_of

from characters_jax.audio.pcm import read_wav
from characters_jax.audio.timeline import Timeline
from characters_jax.client.character_client import CharacterClient
from characters_jax.client.playout_clock import PlayoutClock
from characters_jax.config import load_config
from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.weights.directory import demo_clip

SEED = 1  # the session's seed (as `characters-jax demo`'s)
LEAD_S = 2.0  # how far ahead of real time the client sends the speech
K = pb.SpeechEvent


def clip_inputs(checkpoint: pathlib.Path, seconds: float, fps: int) -> dict:
    """The demo clip's portrait (PNG bytes), its speech repeated to `seconds` (int16 [n]) and
    its mouth tracks repeated alike ({"own", "shuffled"}: float [frames, 2])."""
    clip = demo_clip(checkpoint)
    if clip is None:
        raise SystemExit(f"{checkpoint}: no demo clip (demo/*-portrait.png, *-speech.wav, *-tracks.npz)")
    samples, fmt = read_wav(str(clip["speech"]))
    if fmt.sample_rate_hz != 16000 or fmt.channels != 1:
        raise SystemExit(f"{clip['speech']}: expected 16 kHz mono, got {fmt}")
    one = samples.reshape(-1).astype(np.int16)
    n = int(seconds * fmt.sample_rate_hz)
    reps = -(-n // len(one))
    with np.load(clip["tracks"]) as z:
        tracks = {k: np.concatenate([z[k]] * reps) for k in ("own", "shuffled")}
    clip_frames = len(one) * fps // fmt.sample_rate_hz
    if any(len(t) != reps * clip_frames for t in tracks.values()):
        raise SystemExit(f"{clip['tracks']}: a track is not {clip_frames} frames long (the clip's speech at {fps} fps)")
    tracks = {k: t[: n * fps // fmt.sample_rate_hz] for k, t in tracks.items()}  # the frames of the speech sent
    return {"image": clip["portrait"].read_bytes(), "pcm": np.tile(one, reps)[:n], "tracks": tracks,
            "clip": clip["speech"].name, "clip_s": len(one) / fmt.sample_rate_hz}


def send_ahead(conv, pcm: np.ndarray, lead_s: float, rate: int = 16000, piece_ms: int = 20) -> threading.Thread:
    """Sends pcm as one speech segment: its first lead_s in one message, then piece_ms pieces
    at real-time pace, lead_s ahead; then end_of_speech."""
    def run():
        t0 = time.monotonic()
        first = int(lead_s * rate)
        conv.send_audio(pcm[:first])
        step = rate * piece_ms // 1000
        for off in range(first, len(pcm), step):
            wait = t0 + off / rate - lead_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the speaker's pace
            conv.send_audio(pcm[off : off + step])
        conv.end_speech()

    t = threading.Thread(target=run, name="speech-sender", daemon=True)
    t.start()
    return t


def video_s(rec: Recorder, fps: int) -> float:
    return sum(len(c.frames) for c in rec.chunks) / fps


def resumed_count(rec: Recorder) -> int:
    return sum(isinstance(x, pb.SessionResumed) for x in list(rec.items))


def run_session(target: str, inputs: dict, fps: int, faults=None) -> dict:
    """One session of the clip on `target`; faults(rec, conv) runs meanwhile (from this
    thread). Returns the recorder, the stream, the playout clock and the worker ids."""
    clock = PlayoutClock(fps)
    with CharacterClient(target) as client:
        conv = client.conversation(image=inputs["image"], seed=SEED, playout=clock, begin_with_speech=True, jitter_buffer_s=0.0,
                                   open_timeout=300.0)
        rec = Recorder(conv)
        rec.wait(lambda: conv.session is not None, 300)
        t_open = time.monotonic()
        sender = send_ahead(conv, inputs["pcm"], LEAD_S)
        if faults is not None:
            faults(rec, conv)
        sender.join(len(inputs["pcm"]) / 16000 + 600)
        rec.wait_event(K.PLAYBACK_FINISHED, 1, timeout=600)
        conv.end_audio()
        rec.join(120)
    clock.wait_drained(30)
    return {"rec": rec, "conv": conv, "clock": clock, "wall_s": time.monotonic() - t_open}


def sigterm_twice(workers: dict[str, Worker], fps: int, seconds: float, log: list):
    """At a third and two thirds of the clip: SIGTERM on the worker serving the session."""
    def faults(rec, conv):
        for k in (1, 2):
            rec.wait(lambda k=k: video_s(rec, fps) >= k * seconds / 3, 600)
            name = conv.session.worker_id
            log.append({"signal": "SIGTERM", "worker": name, "video_s": round(video_s(rec, fps), 2), "step": rec.chunks[-1].step_index})
            workers[name].terminate()
            rec.wait(lambda k=k: resumed_count(rec) >= k, 300)
    return faults


def sigkill_halfway(workers: dict[str, Worker], fps: int, seconds: float, log: list):
    """Halfway, once a periodic snapshot is in and a chunk after it: SIGKILL on the serving worker."""
    def periodic(rec):
        return [x for x in list(rec.items) if isinstance(x, pb.SnapshotEvent) and x.kind == pb.SnapshotEvent.PERIODIC]

    def faults(rec, conv):
        rec.wait(lambda: video_s(rec, fps) >= seconds / 2 and periodic(rec) and rec.chunks[-1].step_index > periodic(rec)[-1].step, 600)
        name = conv.session.worker_id
        held = rec.chunks[-1].step_index
        decoder_pid = workers[name].state()["decoder_pid"]
        workers[name].proc.kill()
        log.append({"signal": "SIGKILL", "worker": name, "video_s": round(video_s(rec, fps), 2), "last_step_held": held,
                    "last_snapshot_step": periodic(rec)[-1].step, "exit": workers[name].proc.wait(30)})
        rec.wait(lambda: resumed_count(rec) >= 1, 300)
        log[-1]["its_decoder_gone_s"] = gone_within(decoder_pid, 60)
    return faults


def gone_within(pid: int, timeout: float) -> float | None:
    """Seconds until process `pid` (not a child of this one) is gone; None if it is still there
    after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None


def pct(vals, q) -> float | None:
    return round(float(np.percentile(vals, q)), 1) if len(vals) else None


def check_stream(chunks, pcm: np.ndarray, fps: int) -> dict:
    """Contiguity of steps, frame timestamps and audio samples; every speech sample once, in
    order, with no silence inside the segment."""
    steps = [c.step_index for c in chunks]
    ts = np.concatenate([c.frame_timestamps_s for c in chunks])
    samples_ok = all(b.audio_first_sample == a.audio_first_sample + len(a.audio_pcm) // 2 for a, b in itertools.pairwise(chunks))
    spans = [sp for c in chunks for sp in c.speech]
    speech_contiguous = (sum(sp.samples for sp in spans) == len(pcm) and spans[0].position_samples == 0
                         and all(b.position_samples == a.position_samples + a.samples and b.segment_offset_samples == a.segment_offset_samples + a.samples
                                 for a, b in itertools.pairwise(spans)))
    timeline_of(chunks, {1: pcm})  # raises unless every span holds the segment's samples and the rest is silence
    return {"steps_contiguous": steps == list(range(len(steps))),
            "timestamps_contiguous": bool(np.allclose(np.diff(ts), 1 / fps, atol=1e-9)),
            "samples_contiguous": samples_ok, "speech_exact_and_contiguous": speech_contiguous}


def step_times(chunks, step_ms: float) -> dict:
    diff = [c.diffusion_ms for c in chunks]
    dec = [c.decode_ms for c in chunks]
    period = [c.step_period_ms for c in chunks[1:]]
    return {"diffusion_ms_p50": pct(diff, 50), "diffusion_ms_p99": pct(diff, 99), "diffusion_ms_max": pct(diff, 100),
            "decode_ms_p50": pct(dec, 50), "decode_ms_p99": pct(dec, 99), "decode_ms_max": pct(dec, 100),
            "step_period_ms_p50": pct(period, 50), "step_period_ms_p99": pct(period, 99), "step_period_ms_max": pct(period, 100),
            "steps_over_budget": sum(d > step_ms or e > step_ms for d, e in zip(diff, dec)), "budget_ms": round(step_ms, 1)}


def compare(chunks, reference) -> dict:
    """Steps whose frames (or audio) differ from the reference's, byte for byte, over the steps
    both hold (the silent steps after the speech last until the client's end_of_audio)."""
    frames = [s.step_index for a, s in zip(reference, chunks) if list(a.frames) != list(s.frames)]
    audio = [s.step_index for a, s in zip(reference, chunks) if a.audio_pcm != s.audio_pcm or a.frame_timestamps_s != s.frame_timestamps_s]
    return {"steps_compared": min(len(chunks), len(reference)), "steps_frames_differ": len(frames), "first_frames_differ": frames[0] if frames else None,
            "steps_audio_differ": len(audio),
            "distinct_step_frames": len({bytes(c.frames[0]) for c in chunks})}  # the frames move: equality is not of constants


def frames_of(chunks) -> np.ndarray:
    return np.stack([np.frombuffer(f, np.uint8).reshape(c.height, c.width, 3) for c in chunks for f in c.frames])


def summarize(run: dict, pcm: np.ndarray, fps: int, step_ms: float, reference=None) -> dict:
    rec, conv, clock = run["rec"], run["conv"], run["clock"]
    chunks = rec.chunks
    frames = sum(len(c.frames) for c in chunks)
    span = rec.chunk_times()[-1] - rec.chunk_times()[0]
    snaps = [x for x in rec.items if isinstance(x, pb.SnapshotEvent)]
    resumes = [x for x in rec.items if isinstance(x, pb.SessionResumed)]
    out = {"final": pb.SessionState.Name(conv.final.state), "steps": len(chunks), "frames": frames, "wall_s": round(run["wall_s"], 1),
           "workers": [x.worker_id for x in rec.items if isinstance(x, pb.Session)],
           "sustained_fps": round((frames - len(chunks[0].frames)) / span, 2), "underruns": clock.underruns, "stall_s": round(clock.stall_s, 3),
           **check_stream(chunks, pcm, fps), **step_times(chunks, step_ms),
           "snapshots": {"count": len(snaps), "kinds": sorted({pb.SnapshotEvent.Kind.Name(s.kind) for s in snaps}),
                         "bytes_max": max((s.bytes for s in snaps), default=0),
                         "snapshot_ms_p50": pct([s.snapshot_ms for s in snaps], 50), "snapshot_ms_max": pct([s.snapshot_ms for s in snaps], 100)},
           "handovers": [{"kind": h["kind"], "code": h["code"], "snapshot_step": h["step"], "first_step": h.get("first_step"),
                          "gap_ms": round(1e3 * (h["first_chunk"] - h["ended"]), 1) if "first_chunk" in h else None,
                          "replayed_inputs": h.get("replayed"), "from_worker": r.from_worker_id, "regenerated_steps": r.regenerated_steps,
                          "regenerated_s": round(r.regenerated_steps * step_ms / 1e3, 3), "snapshot_age_s": round(r.snapshot_age_s, 3)}
                         for h, r in zip(conv.handovers, resumes)]}
    if reference is not None:
        out["vs_reference"] = compare(chunks, reference)
    return out


def lip_sync(chunks, tracks: dict) -> dict:
    from characters_jax.lipsync.score import score

    frames = frames_of(chunks)
    n = min(len(frames), *(len(t) for t in tracks.values()))
    out = {"frames": n}
    for k, track in tracks.items():
        s = score(frames[:n], track[:n])
        out[k] = {"peak": round(s.peak, 4), "lag": s.lag, "confidence": round(s.confidence, 4)}
    return out


def table(results: dict) -> str:
    rows = [("final", lambda r: r["final"]), ("workers", lambda r: "->".join(r["workers"])),
            ("steps / frames", lambda r: f"{r['steps']} / {r['frames']}"),
            ("contiguous (steps, ts, samples, speech)", lambda r: "yes" if all(r[k] for k in ("steps_contiguous", "timestamps_contiguous", "samples_contiguous", "speech_exact_and_contiguous")) else "NO"),
            ("steps differing from reference (frames/audio)", lambda r: f"{r['vs_reference']['steps_frames_differ']}/{r['vs_reference']['steps_audio_differ']} of {r['vs_reference']['steps_compared']}" if "vs_reference" in r else "-"),
            ("lip sync own: confidence @ lag", lambda r: f"{r['lip_sync']['own']['confidence']:.4f} @ {r['lip_sync']['own']['lag']:+d}"),
            ("lip sync shuffled: confidence", lambda r: f"{r['lip_sync']['shuffled']['confidence']:.4f}"),
            ("underruns (stall s)", lambda r: f"{r['underruns']} ({r['stall_s']})"),
            ("sustained fps", lambda r: f"{r['sustained_fps']}"),
            ("diffusion ms p50/p99/max", lambda r: f"{r['diffusion_ms_p50']}/{r['diffusion_ms_p99']}/{r['diffusion_ms_max']}"),
            ("decode ms p50/p99/max", lambda r: f"{r['decode_ms_p50']}/{r['decode_ms_p99']}/{r['decode_ms_max']}"),
            ("step period ms p50/p99/max", lambda r: f"{r['step_period_ms_p50']}/{r['step_period_ms_p99']}/{r['step_period_ms_max']}"),
            ("steps over budget", lambda r: f"{r['steps_over_budget']} (> {r['budget_ms']} ms)"),
            ("snapshots (count, max kB, ms p50/max)", lambda r: f"{r['snapshots']['count']}, {r['snapshots']['bytes_max'] / 1e3:.1f}, {r['snapshots']['snapshot_ms_p50']}/{r['snapshots']['snapshot_ms_max']}"),
            ("hand-over gap ms", lambda r: ", ".join(str(h["gap_ms"]) for h in r["handovers"]) or "-"),
            ("inputs replayed", lambda r: ", ".join(str(h["replayed_inputs"]) for h in r["handovers"]) or "-"),
            ("regenerated steps (s), snapshot age s", lambda r: ", ".join(f"{h['regenerated_steps']} ({h['regenerated_s']}), {h['snapshot_age_s']}" for h in r["handovers"]) or "-")]
    names = list(results)
    width = max(len(label) for label, _ in rows)
    cols = [[fmt(results[n]) for _, fmt in rows] for n in names]
    colw = [max(len(n), *(len(v) for v in col)) for n, col in zip(names, cols)]
    lines = [" " * width + " | " + " | ".join(n.ljust(w) for n, w in zip(names, colw))]
    for i, (label, _) in enumerate(rows):
        lines.append(label.ljust(width) + " | " + " | ".join(col[i].ljust(w) for col, w in zip(cols, colw)))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="talking")
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "talking"))
    p.add_argument("--seconds", type=float, default=60.0, help="the session's speech (the demo clip's, repeated)")
    p.add_argument("--interval", type=float, default=2.0, help="serve.snapshot_interval_s of the store's workers")
    p.add_argument("--out", default="", help="write every figure as JSON here")
    args = p.parse_args()
    cfg = load_config(args.config)
    fps = cfg.video.fps
    step_ms = 1e3 * cfg.video.frames_per_step / fps
    inputs = clip_inputs(pathlib.Path(args.checkpoint), args.seconds, fps)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="migration-run-"))
    weights = ("--checkpoint", str(pathlib.Path(args.checkpoint).resolve()))
    store = ("--set", f"serve.snapshot_dir={tmp / 'store'}", "--set", f"serve.snapshot_interval_s={args.interval}")
    names = {"ref": (), **{f"w{i}": store for i in range(4)}}
    workers = {n: Worker(tmp / n, args.config, (*weights, *extra, "--set", f"serve.worker_id={n}"), wait=False, ready_timeout=1200)
               for n, extra in names.items()}
    faults: list[dict] = []
    runs = {}
    t0 = time.monotonic()
    try:
        for w in workers.values():
            w.wait_ready()
        ready_s = round(time.monotonic() - t0, 1)
        print(f"{len(workers)} workers ready in {ready_s} s; {args.seconds:g} s of {inputs['clip']} (repeated)", flush=True)
        runs["reference"] = run_session(workers["ref"].address, inputs, fps)
        print(f"reference: {runs['reference']['wall_s']:.1f} s", flush=True)
        balanced = ",".join(workers[n].address for n in ("w0", "w1", "w2"))
        runs["migrated"] = run_session(balanced, inputs, fps, sigterm_twice(workers, fps, args.seconds, faults))
        print(f"migrated: {runs['migrated']['wall_s']:.1f} s", flush=True)
        survivor = next(n for n in ("w0", "w1", "w2") if workers[n].proc.poll() is None)
        runs["crash"] = run_session(f"{workers[survivor].address},{workers['w3'].address}", inputs, fps,
                                    sigkill_halfway(workers, fps, args.seconds, faults))
        print(f"crash: {runs['crash']['wall_s']:.1f} s", flush=True)
        exits = {}
        for f in faults:
            if f["signal"] == "SIGTERM":
                workers[f["worker"]].proc.wait(60)
                exits[f["worker"]] = workers[f["worker"]].proc.returncode
    finally:
        for w in workers.values():
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ref_chunks = runs["reference"]["rec"].chunks
    results = {name: summarize(run, inputs["pcm"], fps, step_ms, None if name == "reference" else ref_chunks) for name, run in runs.items()}
    for name, run in runs.items():
        results[name]["lip_sync"] = lip_sync(run["rec"].chunks, inputs["tracks"])
    expected = Timeline.from_config(cfg).steps_for(len(inputs["pcm"])) * cfg.video.frames_per_step
    crash = results["crash"]["handovers"][0] if results["crash"]["handovers"] else {}
    report = {"config": args.config, "checkpoint": args.checkpoint, "seconds": args.seconds, "interval_s": args.interval, "seed": SEED,
              "lead_s": LEAD_S, "workers_ready_s": ready_s, "expected_frames": expected, "faults": faults,
              "sigtermed_worker_exit_codes": exits, "crash_loss_within_interval": bool(crash) and crash["regenerated_s"] <= args.interval,
              "runs": results}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
