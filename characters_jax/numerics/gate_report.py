"""The lip-sync gate's outputs: a markdown table, a JSON record and a PNG of the differences."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from characters_jax.numerics.lipsync_gate import SCORES, GateResult, Row

LABELS = {"lipsync": "lip-sync confidence", "identity": "identity distance", "drift_lipsync": "drift of lip sync",
          "drift_identity": "drift of identity", "fidelity": "fidelity: colour error (/255)"}


def _f(x, spec: str = "+.4f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _mark(ok) -> str:
    return "" if ok is None else ("" if ok else " **x**")


def verdict_rule(result: GateResult) -> str:
    st = result.settings
    rule = ("max over the perturbed reference runs r of |d_r|" if st.rule == "max"
            else "sqrt(mean over the perturbed reference runs r of d_r^2)")
    return (f"Verdict: a variant passes when, for lip-sync confidence, identity distance, (if measured) their "
            f"drift and fidelity (the worst region's mean-colour difference from the ground truth), |D| <= max({st.factor:g} x V, {st.floor:g}), where D is the variant's mean per-clip difference "
            f"from the base reference run over the same {len(result.base.clips.confidence)} held-out clips, "
            f"d_r the same for reference run r, and V = {rule} (`--variation {st.rule}`, `--factor {st.factor:g}`). "
            f"Exit status 1 when a default-path variant ({', '.join(_default_rows(result)) or 'production'}) fails.")


def _default_rows(result: GateResult) -> list[str]:
    from characters_jax.numerics.lipsync_gate import DEFAULT_PATH

    return [r.name for r in result.rows if r.name.partition("@")[0] in DEFAULT_PATH]


def header(result: GateResult) -> str:
    st, m = result.settings, result.config.model
    drift = (f"; drift over {st.drift_clips} x {st.drift_seconds:g} s clips, last {st.drift_window_s:g} s vs first"
             if st.drift_clips else "; drift not measured")
    return (f"lip-sync gate: {result.config.name} ({m.num_blocks} blocks, d={m.d_model}, activations {m.dtype}), "
            f"weights {st.checkpoint}, tp={st.tp}, {len(result.base.clips.confidence)} held-out clips x "
            f"{st.seconds:g} s{drift}; {len(result.plan)} reference runs (launch {result.config.cache.dtype} cache, "
            f"reference attention, plain GEMMs, psum): {', '.join(r.label for r in result.plan)}")


def table(result: GateResult) -> str:
    """Markdown: the reference runs (their d_r), the variation, then one row per variant."""
    v = result.variations
    lines = ["| variant | lip-sync diff | run-to-run variation (allowed) | identity diff | variation (allowed) | "
             "drift diff: lip sync / identity | fidelity diff (allowed) | latent rel-L2 mean | latent verdict | "
             "lip-sync verdict | note |",
             "|" + "---|" * 11]

    def line(r: Row, ref: bool):
        lat = "-" if r.latent is None else _f(r.latent.latent_mean, ".2e")
        lat_ok = "(ref)" if ref else ("-" if r.latent is None else ("within" if r.latent.ok else "outside"))
        d, ok = r.diffs, r.ok
        tol = {s: "" if ref or r.status != "ran" else "+-" + _f(v[s].tolerance, ".4f")
               for s in ("lipsync", "identity", "fidelity")}
        lines.append(f"| {r.name} | {_f(d['lipsync'])}{_mark(None if ref else ok['lipsync'])} | {tol['lipsync']} | "
                     f"{_f(d['identity'])}{_mark(None if ref else ok['identity'])} | {tol['identity']} | "
                     f"{_f(d['drift_lipsync'])}{_mark(None if ref else ok['drift_lipsync'])} / "
                     f"{_f(d['drift_identity'])}{_mark(None if ref else ok['drift_identity'])} | "
                     f"{_f(d['fidelity'])}{_mark(None if ref else ok['fidelity'])} {tol['fidelity']} | {lat} | {lat_ok} | "
                     f"{'(ref)' if ref else r.verdict} | {r.note} |")

    for r in result.ref_rows:
        line(r, True)
    lines.append(f"| **reference variation** ({result.settings.rule}) | | {_f(v['lipsync'].value, '.4f')} "
                 f"({_f(v['lipsync'].tolerance, '.4f')}) | | {_f(v['identity'].value, '.4f')} "
                 f"({_f(v['identity'].tolerance, '.4f')}) | {_f(v['drift_lipsync'].tolerance, '.4f')} / "
                 f"{_f(v['drift_identity'].tolerance, '.4f')} allowed | {_f(v['fidelity'].value, '.4f')} "
                 f"({_f(v['fidelity'].tolerance, '.4f')}) | {result.latent_spread.latent_mean:.2e} | "
                 f"x{result.settings.factor:g} allowed | | |")
    for r in result.rows:
        line(r, False)
    return "\n".join(lines)


def markdown(result: GateResult) -> str:
    base = result.base.clips
    out = [header(result), "",
           f"Base reference run: mean lip-sync confidence {base.confidence.mean():.4f}, identity distance "
           f"{_f(float(base.identity.mean()), '.4f')}. Differences are variant - base (mean over clips); **x** marks "
           "a score outside the allowed variation.", "", table(result), "", verdict_rule(result)]
    for n in result.notes:
        out.append(f"- note: {n}")
    return "\n".join(out) + "\n"


def to_json(result: GateResult) -> dict:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else str(x)
        return x

    def row(r: Row) -> dict:
        return {"name": r.name, "status": r.status, "verdict": r.verdict, "note": r.note,
                "diffs": {k: clean(x) for k, x in r.diffs.items()}, "ok": r.ok,
                "latent": None if r.latent is None else {"mean": clean(r.latent.latent_mean),
                                                          "worst": clean(r.latent.latent_worst), "ok": r.latent.ok}}

    def per_clip(run) -> dict | None:
        if run.clips is None:
            return None
        d = {"confidence": [round(float(x), 6) for x in run.clips.confidence],
             "identity": [clean(round(float(x), 6)) for x in run.clips.identity],
             "lag": [int(x) for x in run.clips.lag]}
        if run.fidelity is not None:
            d["fidelity"] = [clean(round(float(x), 4)) for x in run.fidelity]
        if run.drift is not None:
            d["drift_confidence"] = [round(float(x), 6) for x in run.drift.confidence]
            d["drift_identity"] = [clean(round(float(x), 6)) for x in run.drift.identity]
        return d

    st = dataclasses.asdict(result.settings)
    st["config"] = result.settings.config.name
    return {
        "settings": st,
        "backend": _backend(),
        "header": header(result),
        "verdict_rule": verdict_rule(result),
        "reference_runs": [dataclasses.asdict(r) for r in result.plan],
        "variation": {s: {"rule": v.rule, "value": clean(v.value), "tolerance": clean(v.tolerance),
                          "diffs": [clean(x) for x in v.diffs]} for s, v in result.variations.items()},
        "latent_spread": {"mean": result.latent_spread.latent_mean, "worst": result.latent_spread.latent_worst},
        "reference": [row(r) for r in result.ref_rows],
        "variants": [row(r) for r in result.rows],
        "failed": result.failed,
        "failed_default_path": result.failed_default_path,
        "per_clip": {r.name: per_clip(r) for r in [result.base, *result.reference]},
        "notes": result.notes,
        "seconds": result.seconds,
    }


def _backend() -> str:
    import jax

    d = jax.devices()[0]
    return f"{jax.default_backend()} ({getattr(d, 'device_kind', d.platform)} x{len(jax.devices())}), jax {jax.__version__}"


def write(result: GateResult, out: str, plot_png: bool = True) -> list[pathlib.Path]:
    """OUT.md, OUT.json and (plot_png, matplotlib present) OUT.png; returns the paths written."""
    stem = pathlib.Path(out)
    if stem.suffix in (".md", ".json", ".png"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    paths[0].write_text(markdown(result))
    paths[1].write_text(json.dumps(to_json(result), indent=1))
    if plot_png:
        try:
            plot(result, stem.with_suffix(".png"))
            paths.append(stem.with_suffix(".png"))
        except ImportError:
            pass
    return paths


def plot(result: GateResult, path) -> None:
    """One panel per measured score: each run's mean difference from the base run, the
    allowed band (+-tolerance) shaded; reference runs grey, variants coloured by verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [s for s in SCORES if math.isfinite(result.variations[s].value)]
    rows = result.ref_rows + [r for r in result.rows if r.status == "ran"]
    fig, axes = plt.subplots(1, len(scores), figsize=(4.2 * len(scores), 0.32 * len(rows) + 1.8), squeeze=False)
    for ax, s in zip(axes[0], scores):
        tol = result.variations[s].tolerance
        ax.axvspan(-tol, tol, color="0.85", label=f"allowed (x{result.settings.factor:g} variation)")
        for i, r in enumerate(rows):
            ref = r in result.ref_rows
            color = "0.5" if ref else ("tab:green" if r.ok[s] else "tab:red")
            ax.plot([r.diffs[s]], [i], "o", color=color)
        ax.set_yticks(range(len(rows)), [r.name for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel(f"{LABELS[s]}: variant - base")
        ax.set_xscale("symlog", linthresh=max(tol / 10, 1e-9) if math.isfinite(tol) and tol > 0 else 1e-6)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(header(result), fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
