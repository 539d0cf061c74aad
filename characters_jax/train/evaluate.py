"""Evaluation of a weights directory on held-out clips, through the service's own path.

For each held-out clip (held-out identity, voice and words): the portrait is encoded by
the decoder process's `VaeRuntime`, `DiTGenerator` prefills the sink with it and the
prompt, every step gets the audio tokens `AudioFrontEnd` cuts from the clip's speech, and
the decoder decodes each latent frame with its temporal state carried, as a session does.
The lip-sync measure (`characters_jax.lipsync`) scores the frames against the clip's
ground-truth mouth track; rows of the table:

  ground truth          the renderer's frames of the clip (the measure's ceiling)
  ground truth, shuffled   the same frames against another clip's track
  through the VAE       the ground truth encoded and decoded by the trained VAE (the
                        ceiling of what the generator's latents can show)
  generated             the trained model's frames
  generated, shuffled   the same frames against another clip's track
  random weights        the untrained model's frames (random DiT and VAE)

Identity: the generated clip is nearest to its own portrait among all held-out portraits
(the identity probe). Fidelity (`characters_jax.lipsync.fidelity`): per-region colour against
the truth and the portrait, sharpness and KID of the rows through the VAE, generated and
random weights, and their verdict (`fidelity_eval.evaluation_rows`). Drift: long sessions,
their first and last `window_s` seconds (lip-sync confidence beside the ground truth's,
identity distance to the portrait), averaged over the sessions: one 10 s window's
confidence varies with its speech by tens of per cent, so a single session cannot show a
change of 10%.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from characters_jax.config import Config
from characters_jax.data.clips import reference_image
from characters_jax.lipsync.generate import PROMPT, generate, make_generator, reconstruct


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    clips: int = 51
    window_s: float = 10.0
    seed: int = 0
    prompt: str = PROMPT
    random_baseline: bool = True


def _mean(values) -> float:
    return round(float(np.mean(values)), 4)


def _row(scores) -> dict:
    lags = np.asarray([s.lag for s in scores])
    return {"peak": _mean([s.peak for s in scores]), "confidence": _mean([s.confidence for s in scores]),
            "median_lag": float(np.median(lags)), "lag_within_1": _mean(np.abs(lags) <= 1)}


def _identity_probe():
    from characters_jax.lipsync.probe import load_probe

    try:
        return load_probe("identity")
    except FileNotFoundError:
        return None


def evaluate(cfg: Config, weights, plans, settings: EvalSettings, session=None, log=print,
             time_limit_s: float | None = None) -> dict:
    """Scores of `weights` (a weights directory) on `plans` (PlanSet of held-out clips) and,
    given `session` (a PlanSet of long held-out clips), the drift figures.

    time_limit_s: past it no more clips are generated (the table covers those done, at
    least 2; the random-weight row as many as time allows), and drift runs the sessions whose
    estimated time fits; the result says what was cut."""
    from characters_jax.data.face import render_frames
    from characters_jax.decoder.runtime import VaeRuntime
    from characters_jax.weights.dit import dit_checkpoint
    from characters_jax.lipsync.fidelity_eval import evaluation_rows
    from characters_jax.lipsync.identity import identify, identity_distance
    from characters_jax.lipsync.probe import load_probe
    from characters_jax.lipsync.score import score

    t0 = time.monotonic()
    h, w = cfg.video.height, cfg.video.width
    mouth, ident_probe = load_probe("mouth"), _identity_probe()
    n = len(plans)
    frames_n = plans.params.shape[1]
    portraits = [reference_image(plans.identity[i], plans.params[i], h, w) for i in range(n)]
    tracks = plans.track

    deadline = t0 + time_limit_s if time_limit_s is not None else float("inf")
    notes = []

    def sessions(gen, vae, label, count):
        out, t1 = [], time.monotonic()
        for i in range(count):
            if i >= 2 and time.monotonic() > deadline:
                notes.append(f"{label}: {i} of {count} clips (time limit)")
                break
            out.append(generate(cfg, gen, vae, portraits[i], plans.audio[i], settings.prompt, seed=settings.seed + i,
                                frames=frames_n))
        log(f"eval: {label}: {len(out)} clips generated in {time.monotonic() - t1:.0f} s")
        return out

    gen, engine_options = make_generator(cfg, log, checkpoint=dit_checkpoint(weights.path, cfg))
    vae = VaeRuntime(cfg, checkpoint=weights.path)
    t_gen = time.monotonic()
    made = sessions(gen, vae, "trained", n)
    step_s = (time.monotonic() - t_gen) / max(1, len(made) * frames_n // cfg.video.frames_per_step)
    n = len(made)
    other = [(i + 1) % n for i in range(n)]
    gt = [render_frames(plans.identity[i], plans.params[i], h, w) for i in range(n)]
    recon = [reconstruct(vae, gt[i]) for i in range(n)]
    rows = {
        "ground truth": [score(gt[i], tracks[i], mouth) for i in range(n)],
        "ground truth, shuffled": [score(gt[i], tracks[other[i]], mouth) for i in range(n)],
        "through the VAE": [score(recon[i], tracks[i], mouth) for i in range(n)],
        "generated": [score(made[i], tracks[i], mouth) for i in range(n)],
        "generated, shuffled": [score(made[i], tracks[other[i]], mouth) for i in range(n)],
    }
    if settings.random_baseline:
        rand = sessions(make_generator(cfg, log, seed=settings.seed)[0], VaeRuntime(cfg, seed=settings.seed),
                        "random weights", n)
        rows["random weights"] = [score(rand[i], tracks[i], mouth) for i in range(len(rand))]
    table = {k: _row(v) for k, v in rows.items()}
    looks = {"through the VAE": recon, "generated": made}
    if settings.random_baseline:
        looks["random weights"] = rand
    fidelity = evaluation_rows(plans.identity[:n], gt, portraits[:n], vae, looks)
    result = {"config": cfg.name, "clips": n, "frames": int(frames_n), "seconds": frames_n / cfg.video.fps,
              "backend": jax.default_backend(), "engine_options": engine_options or "defaults",
              "table": table, "per_clip": {k: [s.as_dict() for s in v] for k, v in rows.items()}}
    g, gs, t = table["generated"]["confidence"], table["generated, shuffled"]["confidence"], table["ground truth"]["confidence"]
    result["targets"] = {"confidence_vs_ground_truth": round(g / t, 3) if t else None,
                         "confidence_vs_shuffled": round(g / gs, 3) if gs > 0 else None,
                         "median_lag": table["generated"]["median_lag"]}
    result["fidelity"] = {"table": fidelity["table"], "kid_baseline": fidelity["kid_baseline"]}
    result["per_clip_fidelity"] = fidelity["per_clip"]
    if ident_probe is not None:
        refs = np.stack(portraits[:n])
        kept = [identify(made[i], refs, ident_probe).rank_of(i) == 0 for i in range(n)]
        result["identity"] = {"kept": _mean(kept), "clips": n,
                              "distance": _mean([identity_distance(made[i], portraits[i], ident_probe) for i in range(n)]),
                              "ground_truth_distance": _mean([identity_distance(gt[i], portraits[i], ident_probe)
                                                              for i in range(n)])}
    else:
        result["identity"] = "no identity probe weights (characters_jax/lipsync/weights/identity_probe.npz)"
    if session is not None and len(session):
        budget = deadline - time.monotonic()
        per = 1.3 * step_s * session.params.shape[1] / cfg.video.frames_per_step  # one session's estimated time
        count = len(session) if budget == float("inf") or per <= 0 else max(0, min(len(session), int(budget // per)))
        if count >= 1:
            result["drift"] = drift(cfg, gen, vae, session.take(slice(0, count)), settings, mouth, ident_probe)
            log(f"eval: drift: {count} sessions of {result['drift']['seconds']:.0f} s done ({time.monotonic() - t0:.0f} s)")
        if count < len(session):
            notes.append(f"drift: {count} of {len(session)} sessions (~{per:.0f} s each, time limit)")
    result["notes"] = notes
    result["seconds_taken"] = round(time.monotonic() - t0, 1)
    return result


def drift(cfg: Config, gen, vae, sessions, settings: EvalSettings, mouth, ident_probe) -> dict:
    """Lip sync and identity over the first and the last window_s seconds of long sessions
    (a PlanSet of held-out clips), averaged over the sessions; the ground-truth renders'
    scores over the same windows beside them (what the speech in each window allows)."""
    from characters_jax.data.face import render_frames
    from characters_jax.lipsync.identity import identity_distance
    from characters_jax.lipsync.score import score

    h, w = cfg.video.height, cfg.video.width
    frames_n = sessions.params.shape[1]
    win = int(round(settings.window_s * cfg.video.fps))
    windows = {"first": slice(0, win), "last": slice(frames_n - win, frames_n)}
    per_session = []
    for i in range(len(sessions)):
        image = reference_image(sessions.identity[i], sessions.params[i], h, w)
        video = generate(cfg, gen, vae, image, sessions.audio[i], settings.prompt, seed=settings.seed + i, frames=frames_n)
        truth = render_frames(sessions.identity[i], sessions.params[i], h, w)
        row = {}
        for name, sl in windows.items():
            track = sessions.track[i][sl]
            row[name] = {"confidence": round(score(video[sl], track, mouth).confidence, 4),
                         "ground_truth_confidence": round(score(truth[sl], track, mouth).confidence, 4)}
            if ident_probe is not None:
                row[name]["identity_distance"] = round(identity_distance(video[sl], image, ident_probe), 4)
        per_session.append(row)
    out = {"sessions": len(per_session), "seconds": frames_n / cfg.video.fps, "window_s": settings.window_s}
    keys = ["confidence", "ground_truth_confidence"] + (["identity_distance"] if ident_probe is not None else [])
    for name in windows:
        out[name] = {k: _mean([row[name][k] for row in per_session]) for k in keys}
    for k in keys:
        a, b = out["first"][k], out["last"][k]
        out[f"{k}_change"] = round((b - a) / a, 4) if a else None
    out["per_session"] = per_session
    return out


def markdown(result: dict) -> str:
    """The table of `evaluate`'s result, as markdown."""
    lines = [f"Held-out clips: {result['clips']} x {result['seconds']:.1f} s, config {result['config']}.", "",
             "| video | scored against the | peak corr. | confidence | median lag | lag within 1 frame |",
             "|---|---|---|---|---|---|"]
    for name, row in result["table"].items():
        video, _, against = name.partition(", ")
        lines.append(f"| {video} | {'another clip' if against else 'its own'} track | {row['peak']:.3f} | "
                     f"{row['confidence']:.3f} | {row['median_lag']:+.0f} | {100 * row['lag_within_1']:.0f}% |")
    t = result["targets"]
    lines += ["", f"Generated confidence: {t['confidence_vs_ground_truth']} x the ground truth's (target >= 0.7), "
              f"{t['confidence_vs_shuffled']} x shuffled audio's (target >= 3); median lag {t['median_lag']:+.0f} "
              "frames (target within 1)."]
    ident = result.get("identity")
    if isinstance(ident, dict):
        lines.append(f"Identity kept (nearest to its own portrait among {ident['clips']}): "
                     f"{100 * ident['kept']:.0f}% of clips (target >= 95%).")
    fid = result.get("fidelity")
    if fid:
        from characters_jax.lipsync.fidelity_eval import markdown as fidelity_markdown

        lines += ["", "Fidelity (colour per region against the ground truth's renders and the portrait, sharpness, "
                  "KID in the feature network's space):", "", fidelity_markdown(fid).rstrip(), ""]
    d = result.get("drift")
    if d:
        f, l = d["first"], d["last"]
        lines.append(f"Drift over {d['sessions']} sessions of {d['seconds']:.0f} s: confidence {f['confidence']:.3f} "
                     f"over the first {d['window_s']:.0f} s, {l['confidence']:.3f} over the last "
                     f"({100 * (d['confidence_change'] or 0):+.1f}%; target within 10%); the ground truth "
                     f"{f['ground_truth_confidence']:.3f} -> {l['ground_truth_confidence']:.3f} "
                     f"({100 * (d['ground_truth_confidence_change'] or 0):+.1f}%)"
                     + (f"; identity distance {f['identity_distance']:.3f} -> {l['identity_distance']:.3f} "
                        f"({100 * (d['identity_distance_change'] or 0):+.1f}%)." if "identity_distance" in f else "."))
    return "\n".join(lines) + "\n"
