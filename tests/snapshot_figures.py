"""The figures of sessions that outlive a worker, on this machine (run as a script):

    python tests/snapshot_figures.py [--config talking] [--seconds 12] [--interval 2]

Two real worker processes (`characters-jax serve`, each with its decoder process) share a
snapshot store; a client behind the balancer speaks for --seconds at real-time pace with a
24 fps playout clock (the default lead); periodic snapshots every --interval seconds;
halfway, SIGTERM on the serving worker migrates the session to the other. Prints, as JSON:
each snapshot's bytes and time (boundary to commit), the step loop's share at a boundary,
the decode-and-denoise time of the steps right after a boundary against the others, the
migration's gap (the old stream's end to the first new chunk), the resume time, underruns.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from serving_harness import Recorder, Worker, png, speech  # noqa: E402

from characters_jax.client.character_client import CharacterClient  # noqa: E402
from characters_jax.client.playout_clock import PlayoutClock  # noqa: E402
from characters_jax.protos_gen import characters_pb2 as pb  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="talking")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--interval", type=float, default=2.0)
    args = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="snapshot-figures-"))
    common = ("--set", f"serve.snapshot_dir={tmp / 'store'}", "--set", f"serve.snapshot_interval_s={args.interval}")
    workers = [Worker(tmp / f"w{i}", args.config, (*common, "--set", f"serve.worker_id=w{i}"), wait=False) for i in range(2)]
    try:
        for w in workers:
            w.wait_ready()
        clock = PlayoutClock(24)
        with CharacterClient(",".join(w.address for w in workers)) as client:
            conv = client.conversation(image=png(), playout=clock)
            rec = Recorder(conv)
            rec.wait(lambda: conv.session is not None, 120)
            first = next(w for w in workers if w.state()["worker_id"] == conv.session.worker_id)
            second = next(w for w in workers if w is not first)
            sender = rec.send_speech(speech(args.seconds, seed=9), block=False)
            rec.wait(lambda: len(rec.chunks) * 4 / 24 >= args.seconds / 2, 120)
            first.terminate()
            rec.wait(lambda: any(isinstance(x, pb.SessionResumed) for x in rec.items), 120)
            sender.join(args.seconds + 30)
            rec.wait(lambda: any(isinstance(x, pb.SpeechEvent) and x.kind == pb.SpeechEvent.PLAYBACK_FINISHED for x in rec.items), 60)
            conv.end_audio()
            rec.join(60)
        first.wait_stopped()
        m = second.metrics()
    finally:
        for w in workers:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    snaps = [x for x in rec.items if isinstance(x, pb.SnapshotEvent)]
    after = {s.step for s in snaps}
    diffusion = {c.step_index: c.diffusion_ms for c in rec.chunks}
    at = [ms for s, ms in diffusion.items() if s in after]
    other = [ms for s, ms in diffusion.items() if s not in after]
    hand = conv.handovers[0]
    out = {
        "config": args.config, "chunks": len(rec.chunks), "final": pb.SessionState.Name(conv.final.state),
        "snapshots": [{"kind": pb.SnapshotEvent.Kind.Name(s.kind), "step": s.step, "bytes": s.bytes, "snapshot_ms": round(s.snapshot_ms, 1)} for s in snaps],
        "boundary_ms_mean_second_worker": round(1e3 * m["characters_snapshot_boundary_seconds_sum"] / max(1, m["characters_snapshot_boundary_seconds_count"]), 2),
        "step_ms_after_boundary_median": round(statistics.median(at), 1) if at else None,
        "step_ms_other_median": round(statistics.median(other), 1),
        "migration_gap_ms": round(1e3 * (hand["first_chunk"] - hand["ended"]), 1),
        "resume_s": m.get("characters_resume_seconds_sum"), "replayed_inputs": hand.get("replayed"),
        "underruns": clock.underruns, "stall_s": round(clock.stall_s, 3),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
