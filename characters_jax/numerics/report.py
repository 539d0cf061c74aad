"""The harness's outputs: a text table, a JSON record and a PNG of divergence against step."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from characters_jax.numerics.metrics import PSNR_CAP_DB, Verdict


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _yes(b: bool, skipped: bool) -> str:
    return "-" if skipped else ("yes" if b else "NO")


def table(report) -> str:
    """Markdown table: reference runs first (the spread), then the variants."""
    s = report.reference.spread
    head = ("| run | latent rel-L2 mean | worst | frame PSNR mean dB | worst dB | leaves band at step | "
            "within spread: mean | worst | note |")
    lines = [head, "|" + "---|" * 9]

    def row(v: Verdict, ref: bool):
        skipped = v.note.startswith("skipped")
        leave = "-" if v.leaves_band_at is None else str(v.leaves_band_at)
        mean_ok = "(ref)" if ref else _yes(v.mean_ok, skipped)
        worst_ok = "(ref)" if ref else _yes(v.worst_ok, skipped)
        lines.append(f"| {v.name} | {_fmt(v.latent_mean, '.2e')} | {_fmt(v.latent_worst, '.2e')} | "
                     f"{_fmt(v.psnr_mean, '.1f')} | {_fmt(v.psnr_worst, '.1f')} | {leave} | {mean_ok} | {worst_ok} | {v.note} |")

    for v in report.ref_rows:
        row(v, True)
    lines.append(f"| **reference spread** | {s.latent_mean:.2e} | {s.latent_worst:.2e} | {_fmt(s.psnr_mean, '.1f')} | "
                 f"{_fmt(s.psnr_worst, '.1f')} | | x{s.factor:g} allowed | | |")
    for v in report.rows:
        row(v, False)
    return "\n".join(lines)


def header(report) -> str:
    st, cfg = report.settings, report.config
    m = cfg.model
    return (f"numerics: {cfg.name} ({m.num_blocks} blocks, d={m.d_model}, {m.num_heads} heads x {m.head_dim}, "
            f"activations {m.dtype}, weights {m.weight_dtype}), tp={st.tp}, {st.steps} steps, "
            f"{len(report.reference.plan)} reference runs (launch {cfg.cache.dtype} cache, reference attention, "
            f"plain GEMMs, psum), band = x{st.factor:g} the reference's largest distance per step (floor {st.floor:g})")


def to_json(report) -> dict:
    def verdict(v: Verdict) -> dict:
        d = dataclasses.asdict(v)
        d["ok"] = v.ok
        return {k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in d.items()}

    st = dataclasses.asdict(report.settings)
    s = report.reference.spread
    return {
        "settings": st,
        "config": report.config.name,
        "model": dataclasses.asdict(report.config.model),
        "cache": dataclasses.asdict(report.config.cache),
        "backend": _backend(),
        "reference_runs": [dataclasses.asdict(r) for r in report.reference.plan],
        "spread": {"latent_mean": s.latent_mean, "latent_worst": s.latent_worst, "psnr_mean": s.psnr_mean,
                   "psnr_worst": s.psnr_worst, "factor": s.factor, "band": [float(x) for x in s.band]},
        "reference": [verdict(v) for v in report.ref_rows],
        "variants": [verdict(v) for v in report.rows],
        "flagged": report.flagged,
        "curves": report.curves,
        "psnr_cap_db": PSNR_CAP_DB,
        "notes": report.notes,
        "seconds": report.seconds,
    }


def _backend() -> str:
    import jax

    d = jax.devices()[0]
    return f"{jax.default_backend()} ({getattr(d, 'device_kind', d.platform)} x{len(jax.devices())}), jax {jax.__version__}"


def write_json(report, path: str) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(to_json(report), indent=1))


def plot(report, path: str) -> None:
    """Two panels against step: latent relative L2 to the base run (log scale) with the
    band, and frame PSNR (dB). Reference runs grey, variants in colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_psnr = any(c.get("psnr") for c in report.curves.values())
    fig, axes = plt.subplots(1, 2 if has_psnr else 1, figsize=(13 if has_psnr else 7, 4.5), squeeze=False)
    ax_l = axes[0][0]
    ref_names = {v.name for v in report.ref_rows}
    steps = range(report.settings.steps)
    low = report.settings.floor / 10  # zero distances (bit-identical steps) are drawn here
    for name, c in report.curves.items():
        style = dict(color="0.6", lw=1, ls="--") if name in ref_names else dict(lw=1.6)
        label = name + (" (ref)" if name in ref_names else "")
        ax_l.plot(steps, [max(x, low) for x in c["latent"]], label=label, **style)
        if has_psnr and c.get("psnr"):
            axes[0][1].plot(steps, c["psnr"], label=label, **style)
    ax_l.plot(steps, report.reference.spread.band, color="k", lw=1, ls=":", label="band")
    ax_l.set_yscale("log")
    ax_l.set_ylim(bottom=low / 2)
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("latent relative L2 vs base reference run")
    ax_l.legend(fontsize=7)
    if has_psnr:
        axes[0][1].set_xlabel("step")
        axes[0][1].set_ylabel("decoded frames PSNR vs base run (dB)")
    fig.suptitle(header(report), fontsize=7, wrap=True)
    fig.tight_layout()
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
