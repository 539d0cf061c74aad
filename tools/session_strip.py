"""A strip of one held-out session: the generated frames above the ground-truth renders of
the same clip, from frame 0 (the silent lead-in) through the speech onset and the middle
to the last second.

The session is the engine's and the decoder's, step by step as a worker serves it (`train
eval`'s drift sessions: the clip's reference image, its speech, the prompt, noise seed 0);
the ground truth is the project's renderer drawing the clip's own mouth track, blinks and
head motion (so the two rows agree on the mouth, not on the head's motion or the blinks).

    python3 tools/session_strip.py --out docs/session_strip.png       # held-out clip 51, 60 s

Columns: frame 0 and the lead-in, then 0.25 s apart from the speech onset, from the
middle, and over the last second (the last frame included); each labelled with its frame
number and time. Prints the frames chosen and where the speech starts.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRIDE = 6  # frames between columns inside a group (0.25 s at 24 fps)
PER_GROUP = 3  # columns after the lead-in
GAP = 14  # pixels between groups
LABEL_W = 118  # the rows' label column
HEAD_H = 40  # group title and frame labels


def choose_frames(total: int, onset: int, fps: int) -> list[tuple[str, list[int]]]:
    """[(group title, frame indices)]: the lead-in (frame 0, and its middle if it lasts 8
    frames or more), the onset, the middle and the last second (ending on the last frame)."""
    lead = [0] + ([onset // 2] if onset >= 8 else [])
    span = STRIDE * (PER_GROUP - 1)
    mid = total // 2
    last = [total - 1 - span + STRIDE * i for i in range(PER_GROUP)]
    groups = [("silent lead-in", lead),
              ("speech onset", [min(onset + STRIDE * i, total - 1) for i in range(PER_GROUP)]),
              ("middle", [mid + STRIDE * i for i in range(PER_GROUP)]),
              ("last second", last)]
    return [(title, [f for f in frames if 0 <= f < total]) for title, frames in groups]


def draw_strip(generated: np.ndarray, truth: np.ndarray, groups, fps: int, scale: int = 2):
    """A PIL image: a row of generated frames over a row of truth frames (uint8 [T, H, W,
    3] each), grouped as `groups`, upscaled `scale` times (nearest)."""
    from PIL import Image, ImageDraw, ImageFont

    h, w = generated.shape[1] * scale, generated.shape[2] * scale
    cols = sum(len(f) for _, f in groups)
    width = LABEL_W + cols * w + GAP * (len(groups) - 1)
    img = Image.new("RGB", (width, HEAD_H + 2 * h + 4), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    for row, label in enumerate(("generated", "ground truth")):
        draw.text((6, HEAD_H + row * (h + 4) + h // 2 - 8), label, fill="black", font=font)
    x = LABEL_W
    for title, frames in groups:
        draw.text((x + 2, 2), title, fill="black", font=font)
        for f in frames:
            draw.text((x + 2, 20), f"{f} ({f / fps:.2f} s)", fill="dimgray", font=font)
            for row, video in enumerate((generated, truth)):
                tile = Image.fromarray(video[f]).resize((w, h), Image.NEAREST)
                img.paste(tile, (x, HEAD_H + row * (h + 4)))
            x += w
        x += GAP
    return img


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=str(ROOT / "checkpoints" / "talking"), help="weights directory")
    p.add_argument("--index", type=int, default=51, help="held-out clip (51: the evaluation's first drift session)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0, help="the clip plan's seed and the engine's noise seed")
    p.add_argument("--out", default=str(ROOT / "docs" / "session_strip.png"))
    p.add_argument("--frames", help="also save the generated and truth frames here (.npz)")
    a = p.parse_args(argv)

    from characters_jax.config import load_config
    from characters_jax.data.clips import ClipSpec, plan_clip, reference_image
    from characters_jax.data.face import render_frames
    from characters_jax.decoder.runtime import VaeRuntime
    from characters_jax.lipsync.generate import generate, make_generator
    from characters_jax.weights.dit import dit_checkpoint

    cfg = load_config("talking")
    v = cfg.video
    plan = plan_clip("heldout", a.index, ClipSpec(seconds=a.seconds, height=v.height, width=v.width, fps=v.fps,
                                                  chunk_frames=v.frames_per_step), a.seed)
    truth = render_frames(plan.identity, plan.params, v.height, v.width)
    image = reference_image(plan.identity, plan.params, v.height, v.width)
    gen, _ = make_generator(cfg, lambda m: print(m, file=sys.stderr), checkpoint=dit_checkpoint(a.weights, cfg))
    vae = VaeRuntime(cfg, checkpoint=a.weights)
    video = generate(cfg, gen, vae, image, plan.audio, "a friendly character, talking", seed=a.seed,
                     frames=len(truth))
    onset = int(np.ceil(plan.meta["speech_spans_s"][0][0] * v.fps))
    groups = choose_frames(len(truth), onset, v.fps)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw_strip(video, truth, groups, v.fps).save(out, optimize=True)
    if a.frames:
        np.savez_compressed(a.frames, generated=video, truth=truth, image=image)
    print(f"held-out clip {a.index}: {len(truth)} frames ({len(truth) / v.fps:.1f} s), speech from frame {onset}; "
          + "; ".join(f"{t}: {f}" for t, f in groups) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
