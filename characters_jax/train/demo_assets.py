"""The demo's inputs and its lip-sync line: a held-out portrait and speech, and the mouth
tracks to score the demo's video against.

`write_demo_assets` writes, for held-out clip `DemoClip.index` at the config's video size:
  heldout-NNNNN-portrait.png, heldout-NNNNN-speech.wav   (the data package's demo assets)
  heldout-NNNNN-tracks.npz   own [T, 2]: the clip's ground-truth mouth track (jaw, width);
                             shuffled [T, 2]: another held-out clip's (the next index)
`demo_sync` scores frames against both (no espeak-ng needed: the tracks are stored).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class DemoClip:
    """The held-out clip of `train demo-assets` (the `demo_clip` table)."""

    index: int = 1000  # held-out clip index (past the evaluation's)
    seconds: float = 8.0
    seed: int = 0


def write_demo_assets(cfg, out_dir, clip: DemoClip = DemoClip()) -> list[str]:
    from characters_jax.data.clips import ClipSpec, plan_clip
    from characters_jax.data.clips import write_demo_assets as write_assets

    v = cfg.video
    index, seed = clip.index, clip.seed
    spec = ClipSpec(seconds=clip.seconds, height=v.height, width=v.width, fps=v.fps, chunk_frames=v.frames_per_step)
    out = pathlib.Path(out_dir)
    png, wav = write_assets(out, index=index, seed=seed, spec=spec, split="heldout")
    own = plan_clip("heldout", index, spec, seed).track
    other = plan_clip("heldout", index + 1, spec, seed).track
    tracks = out / f"heldout-{index:05d}-tracks.npz"
    np.savez(tracks, own=own, shuffled=other)
    return [png, wav, str(tracks)]


def demo_sync(frames: np.ndarray, tracks_path) -> dict:
    """{"lipsync": score against the clip's own track, "shuffled": against another clip's}
    of frames uint8 [T', H, W, 3] (T' >= T: the video's first T frames are scored)."""
    from characters_jax.lipsync.score import score

    with np.load(tracks_path) as z:
        own, other = z["own"], z["shuffled"]
    video = np.asarray(frames)[: len(own)]
    out = {}
    for name, track in (("lipsync", own), ("shuffled", other)):
        s = score(video, track)
        out[name] = {"peak": round(s.peak, 4), "confidence": round(s.confidence, 4), "lag": s.lag}
    return out
