"""The fidelity measure's figures on held-out clips, and rows of scores for the evaluations.

`fidelity_rows(references, rows)` scores each row's clips (uint8 [T, H, W, 3] per clip)
against the clips' `FidelityReference`s: per row the `summary` over clips, its `verdict`
(KID against 2x the baseline row's, when there is one) and the per-clip figures. The KID
baseline is the VAE round trip with each latent frame decoded on its own, from an empty
temporal history (`decode_chunks`): what the latent space can show, in the regime the
decoder is trained in, whatever its streamed state does (the shipped decoder's stream
drifts past its third chunk: BUILD_NOTES, Fidelity).
`validate_measure` is `characters-jax lipsync fidelity`: held-out clips (espeak-ng speech,
held-out identities) and the rows

  ground truth, other motion     the clip re-rendered with new blinks and head motion (the
                                 ceiling: what the generator is not asked to reproduce)
  colour shift / blur / hair smear   planted faults on that re-render (`fidelity_faults`)
  through the VAE                the truth encoded and decoded as a stream (the decoder's
                                 temporal state carried, as it serves)
  through the VAE, chunk by chunk    each latent frame decoded from an empty history
  generated / generated, chunk by chunk   a weights directory's sessions, decoded both ways
  generated, demo clip           the weights' demo clip (`demo/`), as served
  random weights                 a random DiT and VAE
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np

from characters_jax.lipsync.fidelity import SHARPNESS_SCALE, THRESHOLDS, FidelityReference, summary, verdict
from characters_jax.lipsync.generate import PROMPT

VAE_ROW = "through the VAE"
BASELINE_ROW = "through the VAE, chunk by chunk"
COLOUR_SHIFT = (12.0, 8.0, 6.0)  # /255, the planted colour fault
BLUR_SIGMA = 1.5  # pixels, the planted blur


def fidelity_rows(references: list[FidelityReference], rows: dict[str, list], baseline_row: str = BASELINE_ROW) -> dict:
    """{"table": {row: summary + verdict}, "kid_baseline": the baseline row's mean KID (None
    without one), "per_clip": {row: [FidelityScore.as_dict()]}}; rows {name: [frames per
    clip]} (a row may cover the first clips only)."""
    scores = {name: [references[i].score(f) for i, f in enumerate(frames)] for name, frames in rows.items() if frames}
    figures = {name: summary(s) for name, s in scores.items()}
    baseline = figures[baseline_row]["kid"] if baseline_row in figures else None
    table = {name: {**f, "verdict": verdict(f, baseline)} for name, f in figures.items()}
    return {"table": table, "kid_baseline": baseline,
            "per_clip": {name: [s.as_dict() for s in sc] for name, sc in scores.items()}}


def decode_chunks(vae, latents) -> np.ndarray:
    """uint8 [steps * frames_per_step, H, W, 3]: every latent frame decoded from an empty
    temporal history (VaeRuntime)."""
    return np.concatenate([np.asarray(vae.decode(vae.initial_state(), z)[0]) for z in latents])


def references(identities, truth, portraits, features="shipped") -> list[FidelityReference]:
    """The clips' FidelityReferences (features: a feature network, 'shipped', or None: no
    KID); without shipped feature weights, KID is left out (NaN)."""
    from characters_jax.lipsync.feature_net import load_features

    if isinstance(features, str):
        try:
            features = load_features()
        except FileNotFoundError:
            features = None
    return [FidelityReference.make(i, t, p, features) for i, t, p in zip(identities, truth, portraits)]


def evaluation_rows(identities, truth, portraits, vae, rows: dict[str, list]) -> dict:
    """`fidelity_rows` of an evaluation's rows ({name: [frames per clip]}, clips in the order
    of identities [n, IDENTITY_SIZE], truth [n] uint8 [T, H, W, 3] and portraits [n] uint8
    [H, W, 3]) with the KID baseline row added: the truth through `vae` (a VaeRuntime),
    chunk by chunk."""
    refs = references(identities, truth, portraits)
    baseline = [decode_chunks(vae, np.asarray(vae.encode_video(t)))[:len(t)] for t in truth]
    return fidelity_rows(refs, {BASELINE_ROW: baseline, **rows})


@dataclasses.dataclass(frozen=True)
class ValidationSettings:
    """weights: a weights directory ('auto': the config's bundled one; 'none': no VAE or
    generated rows); clips held-out clips of `seconds`; demo: the weights' demo clip too;
    random_weights: the random row."""

    weights: str = "auto"
    config: str = "talking"
    clips: int = 4
    seconds: float = 8.0
    seed: int = 0
    demo: bool = True
    random_weights: bool = True


def _demo_index(weights) -> int | None:
    from characters_jax.weights.directory import demo_clip

    clip = demo_clip(weights)
    m = re.search(r"heldout-(\d+)-", clip["tracks"].name) if clip else None
    return int(m.group(1)) if m else None


def validate_measure(settings: ValidationSettings, log=print) -> dict:
    """The rows of the module docstring on `settings.clips` held-out clips."""
    from characters_jax.config import load_config
    from characters_jax.data.clips import ClipSpec, plan_clip, reference_image
    from characters_jax.data.face import render_frames
    from characters_jax.data.speech import EspeakVoice
    from characters_jax.weights.directory import checkpoint_path
    from characters_jax.lipsync import fidelity_faults as faults
    from characters_jax.lipsync.feature_net import load_features
    from characters_jax.lipsync.generate import generate_latents

    t0 = time.monotonic()
    if settings.clips < 2:
        raise ValueError(f"--clips must be at least 2, got {settings.clips}")
    cfg = load_config(settings.config)
    h, w = cfg.video.height, cfg.video.width
    spec = ClipSpec(seconds=settings.seconds, height=h, width=w, fps=cfg.video.fps, chunk_frames=cfg.video.frames_per_step)
    weights = checkpoint_path(settings.weights, cfg.name)
    demo = _demo_index(weights) if weights and settings.demo else None
    voice = EspeakVoice()
    indices = list(range(settings.clips)) + ([demo] if demo is not None else [])
    plans = [plan_clip("heldout", i, spec, settings.seed, voice) for i in indices]
    truth = [render_frames(p.identity, p.params, h, w) for p in plans]
    portraits = [reference_image(p.identity, p.params, h, w) for p in plans]
    refs = references([p.identity for p in plans], truth, portraits, load_features())
    n = settings.clips
    other = [render_frames(p.identity, faults.other_motion(p.params, settings.seed + i), h, w)
             for i, p in enumerate(plans[:n])]
    rows = {"ground truth, other motion": other,
            f"colour shift {COLOUR_SHIFT}": [faults.colour_shift(f, COLOUR_SHIFT) for f in other],
            f"blur (sigma {BLUR_SIGMA} px)": [faults.blur(f, BLUR_SIGMA) for f in other],
            "hair smear": [faults.hair_smear(f, refs[i].masks["hair"]) for i, f in enumerate(other)]}
    log(f"fidelity: {n} held-out clips rendered, controls made ({time.monotonic() - t0:.0f} s)")
    if weights:
        from characters_jax.decoder.runtime import VaeRuntime
        from characters_jax.weights.dit import dit_checkpoint
        from characters_jax.lipsync.generate import make_generator

        vae = VaeRuntime(cfg, checkpoint=weights)
        latents = [np.asarray(vae.encode_video(t)) for t in truth[:n]]
        rows[VAE_ROW] = [vae.decode_stream(z) for z in latents]
        rows[BASELINE_ROW] = [decode_chunks(vae, z) for z in latents]
        gen, _ = make_generator(cfg, log, checkpoint=dit_checkpoint(weights, cfg))
        made = [np.asarray(generate_latents(cfg, gen, vae, portraits[i], plans[i].audio, PROMPT, seed=settings.seed + i))
                for i in range(len(plans))]
        frames = spec.num_frames
        rows["generated"] = [vae.decode_stream(z)[:frames] for z in made[:n]]
        rows["generated, chunk by chunk"] = [decode_chunks(vae, z)[:frames] for z in made[:n]]
        log(f"fidelity: generated {len(plans)} clips ({time.monotonic() - t0:.0f} s)")
        if settings.random_weights:
            rand_gen, _ = make_generator(cfg, log, seed=settings.seed)
            rand_vae = VaeRuntime(cfg, seed=settings.seed)
            rows["random weights"] = [rand_vae.decode_stream(generate_latents(
                cfg, rand_gen, rand_vae, portraits[i], plans[i].audio, PROMPT, seed=settings.seed + i))[:frames]
                for i in range(n)]
    result = fidelity_rows(refs[:n], rows)
    if weights and demo is not None:
        d = fidelity_rows([refs[-1]], {"generated, demo clip": [vae.decode_stream(made[-1])[:spec.num_frames]]},
                          baseline_row="")
        row = d["table"]["generated, demo clip"]
        row["verdict"] = verdict(row, result["kid_baseline"])
        result["table"]["generated, demo clip"] = row
        result["per_clip"]["generated, demo clip"] = d["per_clip"]["generated, demo clip"]
    result.update(config=cfg.name, weights=str(weights) if weights else None, clips=n,
                  seconds=spec.num_frames / spec.fps, seed=settings.seed, demo_index=demo,
                  seconds_taken=round(time.monotonic() - t0, 1))
    return result


def markdown(result: dict) -> str:
    """The table of `fidelity_rows` / `validate_measure`, as markdown."""
    lines = ["| frames | colour vs truth (worst region, /255) | vs reference | worst clip | "
             f"sharpness ({SHARPNESS_SCALE} px) | "
             "sharpness (1 px) | KID | verdict (colour / sharpness / KID) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["table"].items():
        v = r["verdict"]
        marks = " / ".join("-" if v[k] is None else ("ok" if v[k] else "FAIL") for k in ("colour", "sharpness", "kid"))
        worst = max((x for x in r["region_colour_error"].values() if x is not None), default=float("nan"))
        lines.append(f"| {name} | {worst:.1f} | {r['colour_error_reference']:.1f} | {r['colour_error_worst_clip']:.1f} | "
                     f"{r['sharpness']:.3f} | {r['sharpness_full']:.3f} | {r['kid']:.4f} | "
                     f"{'pass' if v['pass'] else 'FAIL'} ({marks}) |")
    base = result.get("kid_baseline")
    t = THRESHOLDS
    lines += ["", f"Limits: every region's mean colour (over clips) within {t.colour:g}/255 of the truth's, sharpness "
              f">= {t.sharpness:g} of the truth's (at {SHARPNESS_SCALE} px), KID <= {t.kid_factor:g}x the VAE round "
              "trip's (chunk by chunk)"
              + (f" ({t.kid_factor * max(base, 0.0):.4f})." if base is not None else " (no VAE row: not judged).")]
    return "\n".join(lines) + "\n"
