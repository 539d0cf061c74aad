"""Writes clips into npz shards with worker processes, and reads them back.

A data directory holds `manifest.json` and shards `shard-NNNNN.npz`, each with the arrays
  frames    uint8   [n, T, H, W, 3]
  audio     int16   [n, N]            (N = floor(T * 16000 / 24))
  track     float32 [n, T, 2]         (jaw, width)
  params    float32 [n, T, 6]         (jaw, width, blink, dx, dy, tilt)
  identity  float32 [n, IDENTITY_SIZE]
  index     int64   [n]               (the clip's index in its split)
  meta      str     [n]               (JSON: voice, texts, phonemes, speech spans, settings)
The clips' plans (speech, tracks, identities) are made in worker processes (spawned, so
each starts clean; espeak-ng runs in each); the main process renders them with the jax
renderer (GPU when present) and writes the shards. Output bytes depend on (split, seed,
spec, clip indices) only, not on the number of workers.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np

from characters_jax.data.clips import Clip, ClipPlan, ClipSpec, plan_clip, render_plans
from characters_jax.data.identity import COLOURS, SHAPES
from characters_jax.data.speech import EspeakVoice, Phoneme

FORMAT = "characters-jax-clips/1"
MANIFEST = "manifest.json"


# A worker process's own espeak-ng (forking from the worker itself, which has no other
# threads at work); set by the pool's initializer, one per worker process.
_worker_voice: EspeakVoice | None = None


def _init_worker() -> None:
    global _worker_voice
    _worker_voice = EspeakVoice(mode="fork")


def _plan_task(args) -> ClipPlan:
    split, index, spec, seed = args
    return plan_clip(split, index, spec, seed, _worker_voice)


class Progress:
    """A compact progress line on a stream: '\\r'-updated on a terminal, a line every few seconds otherwise."""

    def __init__(self, label: str, total: int, stream=None, every_s: float | None = None):
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 5.0)
        self.t0 = time.monotonic()
        self.last = -1e9

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        rate = done / dt
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        line = (f"{self.label}: {done}/{self.total} clips {100 * done / max(self.total, 1):5.1f}% "
                f"{rate:6.1f} clips/s " + (f"{dt:.1f} s" if final else f"eta {eta:.0f} s"))
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


def _meta_json(plan: ClipPlan) -> str:
    phonemes = [[p.symbol, round(p.start, 5), round(p.end, 5)] for p in plan.phonemes]
    return json.dumps({**plan.meta, "split": plan.split, "index": plan.index, "seed": plan.seed,
                       "phonemes": phonemes}, ensure_ascii=False, sort_keys=True)


def _write_shard(path: pathlib.Path, clips: list[Clip]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, frames=np.stack([c.frames for c in clips]), audio=np.stack([c.plan.audio for c in clips]),
             track=np.stack([c.plan.track for c in clips]), params=np.stack([c.plan.params for c in clips]),
             identity=np.stack([c.plan.identity for c in clips]),
             index=np.asarray([c.plan.index for c in clips], np.int64),
             meta=np.asarray([_meta_json(c.plan) for c in clips]))
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """How `data` renders and writes its clips (the `data` table: `--set data.seconds=8`); the
    clip's size (seconds, height, width, fps, ...) is ClipSpec's."""

    clip: ClipSpec = ClipSpec()
    seed: int = 0
    first_index: int = 0  # index of the first clip in its split (with demo: the clip written)
    workers: int = 0  # planning processes (0: cores - 1, at most 16)
    shard_size: int = 64  # clips per shard
    render_batch: int = 8  # clips rendered per call of the jax renderer
    quiet: bool = False  # no progress line
    demo: bool = False  # instead of shards: clip first_index's portrait (PNG) and speech (WAV) into the output directory


def default_workers() -> int:
    """Worker processes for the plans: the cores less one for rendering and writing, at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def write_shards(out_dir, split: str, num_clips: int, spec: ClipSpec, seed: int = 0, workers: int | None = None,
                 shard_size: int = 64, first_index: int = 0, render_batch: int = 8, progress: bool = True) -> dict:
    """Writes clips first_index .. first_index + num_clips - 1 of `split`; returns the manifest."""
    if num_clips < 1 or shard_size < 1 or render_batch < 1:
        raise ValueError("num_clips, shard_size and render_batch must be at least 1")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = default_workers() if workers is None else max(1, int(workers))
    tasks = [(split, first_index + i, spec, seed) for i in range(num_clips)]
    bar = Progress(f"data {split}", num_clips) if progress else None
    shards, pending, plans, done = [], [], [], 0

    def flush_plans():
        nonlocal plans
        batch = plans + [plans[-1]] * (render_batch - len(plans))  # one batch shape: one compiled program
        pending.extend(render_plans(batch, spec.height, spec.width)[:len(plans)])
        plans = []

    def flush_shard(final=False):
        nonlocal pending
        while len(pending) >= shard_size or (final and pending):
            chunk, pending = pending[:shard_size], pending[shard_size:]
            name = f"shard-{len(shards):05d}.npz"
            _write_shard(out / name, chunk)
            shards.append({"file": name, "clips": len(chunk), "first_index": chunk[0].plan.index})

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker) as pool:
        for plan in pool.imap(_plan_task, tasks, chunksize=1):
            plans.append(plan)
            if len(plans) == render_batch:
                flush_plans()
                flush_shard()
            done += 1
            if bar:
                bar.update(done)
    if plans:
        flush_plans()
    flush_shard(final=True)
    if bar:
        bar.update(done, final=True)
    manifest = {"format": FORMAT, "split": split, "seed": int(seed), "spec": dataclasses.asdict(spec),
                "clips": num_clips, "first_index": first_index, "num_frames": spec.num_frames,
                "num_samples": spec.num_samples, "identity_colours": list(COLOURS), "identity_shapes": list(SHAPES),
                "frame_params": ["jaw", "width", "blink", "dx", "dy", "tilt"], "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


class ShardReader:
    """Reads a data directory written by write_shards: len(), clip(i), iteration, whole shards."""

    def __init__(self, directory):
        self.dir = pathlib.Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST} in {self.dir} (not a data directory written by write_shards)")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.spec = ClipSpec(**self.manifest["spec"])
        self._starts = np.cumsum([0] + [s["clips"] for s in self.manifest["shards"]])

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    def shard(self, i: int) -> dict:
        """Shard i's arrays (see the module docstring), loaded into memory."""
        with np.load(self.dir / self.manifest["shards"][i]["file"]) as z:
            return {k: z[k] for k in z.files}

    def clip(self, i: int) -> Clip:
        if not 0 <= i < len(self):
            raise IndexError(f"clip {i} out of range 0..{len(self) - 1}")
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        return _clips_of(self.shard(s))[i - self._starts[s]]

    def __iter__(self):
        for s in range(self.num_shards):
            yield from _clips_of(self.shard(s))


def _clips_of(arrays: dict) -> list[Clip]:
    out = []
    for j in range(len(arrays["index"])):
        meta = json.loads(str(arrays["meta"][j]))
        phonemes = tuple(Phoneme(sym, float(a), float(b)) for sym, a, b in meta.pop("phonemes"))
        split, index, seed = meta.pop("split"), meta.pop("index"), meta.pop("seed")
        plan = ClipPlan(split, index, seed, arrays["audio"][j], phonemes, arrays["track"][j], arrays["identity"][j],
                        arrays["params"][j], meta)
        out.append(Clip(plan, arrays["frames"][j]))
    return out
