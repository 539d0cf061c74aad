"""The gate's outputs: a markdown table, a JSON record and a PNG, each metric's columns and
panels side by side (`harness.GateResult`)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib


def header(result) -> str:
    st, cfg = result.settings, result.config
    m = cfg.model
    beside = [x.name for x in result.metrics if x.name not in result.judging]
    return (f"gate ({', '.join(result.judging)}{'; beside: ' + ', '.join(beside) if beside else ''}): {cfg.name} "
            f"({m.num_blocks} blocks, d={m.d_model}, {m.num_heads} heads x {m.head_dim}, activations {m.dtype}, "
            f"weights {m.weight_dtype}), tp={st.tp}, {result.workload.describe()}; "
            + "; ".join(x.describe() for x in result.metrics)
            + f"; {len(result.plan)} reference runs (launch {cfg.cache.dtype} cache, reference attention, plain GEMMs, "
              f"psum): {', '.join(r.label for r in result.plan)}")


def verdict_rule(result) -> str:
    rules = [m.rule() for m in result.metrics if m.name in result.judging]
    beside = [m.name for m in result.metrics if m.name not in result.judging]
    return ("Verdict: a variant passes when every metric that judges passes. " + " ".join(f"{r}." for r in rules)
            + (f" Beside the verdict, not in it: {', '.join(beside)}." if beside else "")
            + " Exit status 1 when a default-path variant (production) fails.")


def table(result) -> str:
    """Markdown: the perturbed reference runs, the reference's variation, then one row per variant."""
    heads = [h for m in result.metrics for h in m.headers()]
    lines = ["| run | " + " | ".join(heads) + " | verdict | note |", "|" + "---|" * (len(heads) + 3)]

    def line(r, ref: bool):
        cells = [c for m in result.metrics
                 for c in m.cells(r.judgements.get(m.name), ref, result.bands[m.name])]
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {'(ref)' if ref else r.verdict} | {r.note} |")

    for r in result.ref_rows:
        line(r, True)
    band = [c for m in result.metrics for c in m.band_cells(result.bands[m.name])]
    lines.append(f"| **reference variation** (x{result.settings.gate.factor:g} allowed) | " + " | ".join(band) + " | | |")
    for r in result.rows:
        line(r, False)
    return "\n".join(lines)


def markdown(result) -> str:
    summaries = [s for m in result.metrics if (s := m.summary(result.base.evaluations[m.name]))]
    out = [header(result), ""] + summaries + (["", "Differences are variant - base (mean over clips); **x** marks a "
                                               "score outside the allowed variation."] if summaries else [])
    out += ["", table(result), "", verdict_rule(result)]
    out += [f"- note: {n}" for n in result.notes]
    return "\n".join(out) + "\n"


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    return x


def to_json(result) -> dict:
    def row(r) -> dict:
        return {"name": r.name, "status": r.status, "verdict": r.verdict, "note": r.note,
                "figures": {k: _clean(v) for k, v in r.figures.items()}, "ok": r.ok,
                "metrics": {m.name: m.judgement_json(r.judgements[m.name]) for m in result.metrics
                            if m.name in r.judgements}}

    st = dataclasses.asdict(result.settings)
    st["config"] = result.settings.config.name
    return {
        "settings": st,
        "backend": _backend(),
        "header": header(result),
        "verdict_rule": verdict_rule(result),
        "metrics": [m.name for m in result.metrics],
        "judging": list(result.judging),
        "reference_runs": [dataclasses.asdict(r) for r in result.plan],
        "bands": {m.name: m.band_json(result.bands[m.name]) for m in result.metrics},
        "reference": [row(r) for r in result.ref_rows],
        "variants": [row(r) for r in result.rows],
        "failed": result.failed,
        "failed_default_path": result.failed_default_path,
        "per_run": {r.name: {m.name: m.evaluation_json(r.evaluations[m.name]) for m in result.metrics}
                    for r in [result.base, *result.reference]},
        "notes": result.notes,
        "seconds": result.seconds,
    }


def _backend() -> str:
    import jax

    d = jax.devices()[0]
    return f"{jax.default_backend()} ({getattr(d, 'device_kind', d.platform)} x{len(jax.devices())}), jax {jax.__version__}"


def write(result, out: str, plot_png: bool = True) -> list[pathlib.Path]:
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
            if plot(result, stem.with_suffix(".png")):
                paths.append(stem.with_suffix(".png"))
        except ImportError:
            pass
    return paths


def plot(result, path) -> bool:
    """The judging metrics' panels in a row; False (nothing written) when none has one."""
    panels = [p for m in result.metrics if m.name in result.judging for p in m.panels(result)]
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(result.ref_rows) + len(result.rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), max(4.5, 0.32 * rows + 1.8)), squeeze=False)
    for ax, draw in zip(axes[0], panels):
        draw(ax)
    fig.suptitle(header(result), fontsize=7, wrap=True)
    fig.tight_layout()
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return True
