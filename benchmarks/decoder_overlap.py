"""Step period with the VAE decoder sharing a GPU of the generator's mesh, vs each alone.

At tp=2 on two GPUs there is no third GPU for the decoder: in serving it runs in its own
process on one of the generator's GPUs and decodes one latent frame (one chunk, 4 video
frames) per step. This script measures what that costs, in one call:

  1. the generator (this process, GPUs 0..tp-1) and a decoder worker (a subprocess pinned
     to GPU `--decoder-device`, its own XLA client, memory not preallocated) start and
     compile side by side;
  2. decoder alone: the worker times `--chunks` chunks while the generator idles;
  3. step alone: the generator times `--steps` steps while the worker idles;
  4. paced: the worker decodes one chunk per step period (the step p50 of 3; how the
     serving decoder sees its input arrive) while the generator times `--steps` steps;
  5. back to back: the worker decodes continuously (the worst case) while the generator
     times `--steps` steps.
The pacing only sets when the decoder's input arrives; each step is timed on its own,
to completion, as in `characters-jax bench`.

    python3 benchmarks/decoder_overlap.py --config characters-57b --tp 2 --decoder-device 1
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 benchmarks/decoder_overlap.py --config tiny   # CPU check

Prints a table; writes JSON (default $OUT/decoder_overlap.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("alone", "paced", "back_to_back")


def _wait_for(path: pathlib.Path, timeout_s: float, proc=None) -> str:
    t0 = time.perf_counter()
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"decoder worker exited with {proc.returncode} (see its log)")
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"no {path.name} after {timeout_s:.0f} s")
        time.sleep(0.01)
    return path.read_text()


def _put(path: pathlib.Path, text: str) -> None:
    """Writes a signal file atomically (the other process polls for its existence)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {"p50": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


# ---- the decoder worker (subprocess) --------------------------------------------------------

def worker(args) -> int:
    """Waits for phase files in args.dir: 'alone' (time args.chunks chunks), then 'go' with a
    period in ms (0: back to back) until 'stop.<phase>'; writes 'done.<phase>' JSON each time."""
    import jax
    import numpy as np

    from characters_jax.config import load_config
    from characters_jax.decoder.runtime import VaeRuntime

    d = pathlib.Path(args.dir)
    cfg = load_config(args.config)
    dev = jax.devices()[0]
    vae = VaeRuntime(cfg, seed=0)
    rng = np.random.default_rng(0)
    latents = [jax.device_put(rng.standard_normal(vae.latent_shape).astype(np.float32), dev) for _ in range(4)]
    state = vae.initial_state()
    for i in range(4):  # compile + warm up
        frames, state = vae.decode(state, latents[i % 4])
    frames.block_until_ready()
    _put(d / "ready", str(dev))

    def decode_one(i):
        nonlocal state
        t0 = time.perf_counter()
        frames, state = vae.decode(state, latents[i % 4])
        frames.block_until_ready()
        return (time.perf_counter() - t0) * 1e3

    _wait_for(d / "alone", 3600)
    lat = [decode_one(i) for i in range(args.chunks)]
    _put(d / "done.alone", json.dumps({"latency_ms": _stats(lat)}))

    for phase in PHASES[1:]:
        period_ms = float(_wait_for(d / f"go.{phase}", 3600))
        lat, late, i = [], 0, 0
        t_next = time.perf_counter()
        while not (d / f"stop.{phase}").exists():
            if period_ms > 0:  # the next chunk arrives one step period after the last
                now = time.perf_counter()
                if now < t_next:
                    time.sleep(t_next - now)
                elif i:
                    late += 1
                t_next += period_ms / 1e3
            lat.append(decode_one(i))
            i += 1
        _put(d / f"done.{phase}", json.dumps({"latency_ms": _stats(lat), "chunks": i, "late_starts": late, "period_ms": period_ms}))
    return 0


# ---- the generator (main process) -----------------------------------------------------------

def main(argv=None) -> int:
    from characters_jax.config.arguments import add_set_argument

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="characters-57b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--decoder-device", type=int, default=1, help="GPU index the decoder shares (CUDA_VISIBLE_DEVICES of the worker)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunks", type=int, default=20, help="decoder chunks timed alone")
    add_set_argument(p)
    p.add_argument("--decoder-mem-fraction", default="0.06", help="XLA_PYTHON_CLIENT_MEM_FRACTION of the worker")
    p.add_argument("--json", default=None, help="output (default $OUT/decoder_overlap.json)")
    p.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker_dir:
        a.dir = a.worker_dir
        return worker(a)

    d = pathlib.Path(tempfile.mkdtemp(prefix="decoder_overlap_"))
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION=a.decoder_mem_fraction)
    if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["CUDA_VISIBLE_DEVICES"] = str(a.decoder_device)
    log_path = d / "worker.log"
    proc = subprocess.Popen([sys.executable, __file__, "--config", a.config, "--chunks", str(a.chunks), "--worker-dir", str(d)],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        result = _drive(a, d, proc)
    except BaseException:
        proc.kill()
        print(f"worker log ({log_path}):\n" + log_path.read_text()[-3000:], file=sys.stderr)
        raise
    proc.wait(timeout=60)
    print(format_table(result))
    out = pathlib.Path(a.json or pathlib.Path(os.environ.get("OUT", "out")) / "decoder_overlap.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def _drive(a, d: pathlib.Path, proc) -> dict:
    import jax
    import numpy as np

    from characters_jax.config import load_config
    from characters_jax.engine.generator import DiTGenerator

    cfg = load_config(a.config, a.set)
    gen = DiTGenerator(cfg, tp=a.tp)
    engine = gen.engine
    rng = np.random.default_rng(0)
    image = rng.standard_normal((cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)).astype(np.float32)
    audio = jax.device_put(rng.standard_normal((cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim)).astype(np.float32), engine.replicated)
    step_exe = engine.step.lower(gen.params, gen.state, audio).compile()
    gen.start_session(image, list(range(16)), seed=0)
    state = gen.state

    def steps(n: int) -> list[float]:
        nonlocal state
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            state, latent = step_exe(gen.params, state, audio)
            latent.block_until_ready()
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    steps(a.warmup)
    worker_device = _wait_for(d / "ready", 900, proc)
    _put(d / "alone", "")
    dec = {"alone": json.loads(_wait_for(d / "done.alone", 600, proc))}
    step = {"alone": _stats(steps(a.steps))}
    period = step["alone"]["p50"]
    for phase, per in (("paced", period), ("back_to_back", 0.0)):
        _put(d / f"go.{phase}", str(per))
        time.sleep(0.05 + 2 * per / 1e3)  # let the decoder reach its steady rhythm
        step[phase] = _stats(steps(a.steps))
        _put(d / f"stop.{phase}", "")
        dec[phase] = json.loads(_wait_for(d / f"done.{phase}", 600, proc))
    return {
        "config": cfg.name,
        "tp": a.tp,
        "generator_devices": [str(x) for x in gen.mesh.devices.flat],
        "decoder_device": worker_device,
        "engine": dataclasses.asdict(engine.options),
        "step_ms": step,
        "decoder_ms": dec,
        "step_ratio_paced": step["paced"]["p50"] / step["alone"]["p50"],
        "step_ratio_back_to_back": step["back_to_back"]["p50"] / step["alone"]["p50"],
        "budget_ms": 1e3 * cfg.video.step_seconds,
    }


def format_table(r: dict) -> str:
    lines = [f"decoder overlap: {r['config']} tp={r['tp']}, decoder on {r['decoder_device']}",
             f"{'phase':<13} {'step p50 ms':>11} {'step max':>9} {'x alone':>8} | {'decode p50 ms':>13} {'chunks':>6}"]
    for ph in PHASES:
        s, dd = r["step_ms"][ph], r["decoder_ms"][ph]
        ratio = s["p50"] / r["step_ms"]["alone"]["p50"]
        lines.append(f"{ph:<13} {s['p50']:11.2f} {s['max']:9.2f} {ratio:8.3f} | {dd['latency_ms'].get('p50', float('nan')):13.2f} "
                     f"{dd.get('chunks', dd['latency_ms'].get('n', 0)):6}")
    lines.append("alone: each measured while the other idles; paced: one chunk per step period; back_to_back: the decoder never idles")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
