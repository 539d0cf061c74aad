"""Clip plans (speech, mouth tracks, identities, frame parameters: no pixels) made by worker
processes and kept in npz shards, so a rerun finds the ones already made.

A plan directory holds `<split>-NNNNN.npz` shards of `shard_size` clips each, arrays
  audio int16 [n, N]; track float32 [n, T, 2]; params float32 [n, T, 6];
  identity float32 [n, IDENTITY_SIZE]; index int64 [n]
(the data package's `plan_clip`, deterministic from (split, index, seed, spec)). Shards
are written whole (tmp + rename); `PlanMaker` runs the workers in the background (spawned
processes: espeak-ng in each, no jax) while the caller trains, and `load_plans` reads
whichever shards exist.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pathlib
import threading

import numpy as np

from characters_jax.data.clips import ClipSpec


@dataclasses.dataclass(frozen=True)
class PlanSet:
    """Plans of one split, stacked: audio [n, N] int16, track [n, T, 2], params [n, T, 6],
    identity [n, I], index [n]."""

    audio: np.ndarray
    track: np.ndarray
    params: np.ndarray
    identity: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def take(self, idx) -> "PlanSet":
        return PlanSet(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


class _Worker:
    """A planning process's espeak-ng voice (forked synthesis: the worker runs no threads),
    made once by the pool's initializer and made again after a failed synthesis."""

    voice = None

    @classmethod
    def start(cls) -> None:
        from characters_jax.data.speech import EspeakVoice

        cls.voice = EspeakVoice(mode="fork")


def _plan(args):
    from characters_jax.data.clips import plan_clip
    from characters_jax.data.speech import EspeakError

    split, index, spec, seed = args
    try:
        p = plan_clip(split, index, spec, seed, _Worker.voice)
    except EspeakError:  # once more from a fresh library
        _Worker.start()
        p = plan_clip(split, index, spec, seed, _Worker.voice)
    return p.audio, p.track, p.params, p.identity, index


def _shard_path(directory: pathlib.Path, split: str, shard: int) -> pathlib.Path:
    return directory / f"{split}-{shard:05d}.npz"


def _write(path: pathlib.Path, rows) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    cols = list(zip(*rows))
    np.savez(tmp, audio=np.stack(cols[0]), track=np.stack(cols[1]), params=np.stack(cols[2]),
             identity=np.stack(cols[3]), index=np.asarray(cols[4], np.int64))
    os.replace(tmp, path)


class PlanMaker:
    """Makes plans [first, first + count) of `split` into `directory` in the background.

    start() returns at once; done() says whether every shard is written; wait() joins;
    available() counts the clips in finished shards. Shards already present are skipped.
    """

    def __init__(self, directory, split: str, count: int, spec: ClipSpec, seed: int = 0, workers: int | None = None,
                 shard_size: int = 64, first: int = 0):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.split, self.count, self.spec, self.seed = split, count, spec, seed
        self.workers = max(1, workers if workers is not None else (os.cpu_count() or 2) - 1)
        self.shard_size, self.first = shard_size, first
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"plans-{split}")
        self.error: BaseException | None = None
        self._stop = threading.Event()

    @property
    def num_shards(self) -> int:
        return -(-self.count // self.shard_size)

    def _missing(self) -> list[int]:
        return [s for s in range(self.num_shards) if not _shard_path(self.dir, self.split, s).is_file()]

    def _run(self):
        try:
            missing = self._missing()
            if not missing:
                return
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(min(self.workers, len(missing) * self.shard_size), initializer=_Worker.start) as pool:
                for s in missing:
                    if self._stop.is_set():
                        return
                    lo = self.first + s * self.shard_size
                    hi = min(self.first + self.count, lo + self.shard_size)
                    tasks = [(self.split, i, self.spec, self.seed) for i in range(lo, hi)]
                    _write(_shard_path(self.dir, self.split, s), pool.map(_plan, tasks, chunksize=1))
        except BaseException as err:  # reported by wait()
            self.error = err

    def start(self) -> "PlanMaker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> bool:
        return not self._missing()

    def available(self) -> int:
        return sum(min(self.shard_size, self.count - s * self.shard_size) for s in range(self.num_shards)
                   if _shard_path(self.dir, self.split, s).is_file())

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error


def load_plans(directory, split: str, limit: int | None = None) -> PlanSet:
    """The plans of `split` in finished shards, in index order (at most `limit`)."""
    paths = sorted(pathlib.Path(directory).glob(f"{split}-[0-9][0-9][0-9][0-9][0-9].npz"))
    parts = []
    for p in paths:
        with np.load(p) as z:
            parts.append({k: z[k] for k in ("audio", "track", "params", "identity", "index")})
    if not parts:
        raise FileNotFoundError(f"no {split} plans in {directory}")
    out = PlanSet(**{k: np.concatenate([q[k] for q in parts]) for k in parts[0]})
    order = np.argsort(out.index, kind="stable")
    return out.take(order[:limit] if limit is not None else order)
