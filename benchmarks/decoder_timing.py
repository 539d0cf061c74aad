"""Time the VAE decoder of a config on one device: ms per chunk (one latent frame -> 4 frames).

Uses the serving decoder's own compiled program (`characters_jax.decoder.runtime.VaeRuntime`:
random weights, the config's dtype, bf16 for characters-57b, temporal state donated and carried
from chunk to chunk as in a session). After a warm-up, three numbers, medians over `--chunks`:

  latency     one decode call waited on (what one chunk costs when nothing else queues)
  pipelined   `--chunks` calls dispatched back to back, then waited on, divided by the count
  with_copy   latency plus the uint8 frames copied to the host (what the decoder service sends)

    python3 benchmarks/decoder_timing.py --config characters-57b --device 1    # GPU machine
    python3 benchmarks/decoder_timing.py --config tiny                         # CPU check

Prints a table and writes JSON (default $OUT/decoder_timing.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def time_decoder(config: str, device_index: int = 0, chunks: int = 20, warmup: int = 3, seed: int = 0) -> dict:
    """Returns {"latency_ms": {...}, "pipelined_ms": float, "with_copy_ms": {...}, ...} for one device."""
    import jax
    import numpy as np

    from characters_jax.config import load_config
    from characters_jax.decoder.runtime import VaeRuntime

    cfg = load_config(config)
    devices = jax.devices()
    dev = devices[min(device_index, len(devices) - 1)]
    with jax.default_device(dev):
        t0 = time.perf_counter()
        vae = VaeRuntime(cfg, seed=seed)
        init_s = time.perf_counter() - t0
        rng = np.random.default_rng(seed)
        latents = [jax.device_put(rng.standard_normal(vae.latent_shape).astype(np.float32), dev) for _ in range(4)]
        state = vae.initial_state()
        t0 = time.perf_counter()
        frames, state = vae.decode(state, latents[0])
        frames.block_until_ready()
        compile_s = time.perf_counter() - t0
        for i in range(warmup):
            frames, state = vae.decode(state, latents[i % 4])
        frames.block_until_ready()

        latency = []
        for i in range(chunks):
            t0 = time.perf_counter()
            frames, state = vae.decode(state, latents[i % 4])
            frames.block_until_ready()
            latency.append((time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        for i in range(chunks):
            frames, state = vae.decode(state, latents[i % 4])
        frames.block_until_ready()
        pipelined = (time.perf_counter() - t0) * 1e3 / chunks

        with_copy = []
        for i in range(max(3, chunks // 2)):
            t0 = time.perf_counter()
            frames, state = vae.decode(state, latents[i % 4])
            host = np.asarray(frames)
            with_copy.append((time.perf_counter() - t0) * 1e3)

    def stats(xs):
        return {"p50": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}

    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(vae._dec_params))
    return {
        "config": cfg.name,
        "device": f"{dev.platform}:{dev.id} ({dev.device_kind})",
        "decoder_dtype": cfg.decoder.dtype,
        "channels": list(cfg.decoder.channels),
        "latent_shape": list(vae.latent_shape),
        "frames_shape": list(host.shape),
        "decoder_params_million": params / 1e6,
        "init_s": init_s,
        "compile_s": compile_s,
        "latency_ms": stats(latency),
        "pipelined_ms": pipelined,
        "with_copy_ms": stats(with_copy),
        "budget_ms": 1e3 * cfg.video.step_seconds,
        "frames_finite": bool(np.isfinite(host.astype(np.float32)).all()),
    }


def format_table(r: dict) -> str:
    rows = [
        ("config / device", f"{r['config']} / {r['device']} ({r['decoder_dtype']}, channels {r['channels']})"),
        ("latent -> frames", f"{r['latent_shape']} -> {r['frames_shape']}"),
        ("compile", f"{r['compile_s']:.1f} s"),
        ("latency p50 (min / max)", f"{r['latency_ms']['p50']:.2f} ms  ({r['latency_ms']['min']:.2f} / {r['latency_ms']['max']:.2f})"),
        ("pipelined", f"{r['pipelined_ms']:.2f} ms per chunk"),
        ("with host copy p50", f"{r['with_copy_ms']['p50']:.2f} ms"),
        ("step budget", f"{r['budget_ms']:.1f} ms (target for characters-57b: <= 60 ms)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="characters-57b")
    p.add_argument("--device", type=int, default=0, help="index into jax.devices()")
    p.add_argument("--chunks", type=int, default=20, help="timed chunks")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="output path (default $OUT/decoder_timing.json)")
    a = p.parse_args(argv)
    r = time_decoder(a.config, a.device, a.chunks, a.warmup)
    print(format_table(r))
    out = pathlib.Path(a.json or pathlib.Path(os.environ.get("OUT", "out")) / "decoder_timing.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(f"wrote {out}")
    return 0 if r["frames_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
