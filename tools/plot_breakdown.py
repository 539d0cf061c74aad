"""Stacked bars of the step's device-time breakdown, one bar per bench variant.

Reads `characters-jax bench --set bench.profile_dir=DIR ... --json FILE` results (those with a "breakdown") and
draws, per variant, the components' kernel time per step (cache upkeep, attention, GEMMs,
fused GEMM + all-reduce, collectives, other) stacked, a diamond at the device-busy time
(union of kernels: below the stack when the NCCL stream overlaps compute), a bar-wide tick at the
bench's step p50 (wall), and the real-time budget as a dashed line.

    python3 tools/plot_breakdown.py OUT/ablation_*.json --out OUT/breakdown.png

(`benchmarks/run.py ablation --profile` draws it.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

COMPONENTS = ("cache_upkeep", "attention", "gemm", "gemm_allreduce", "collective", "other")
COLORS = {"cache_upkeep": "#d62728", "attention": "#1f77b4", "gemm": "#2ca02c", "gemm_allreduce": "#17becf",
          "collective": "#ff7f0e", "other": "#7f7f7f"}


def variant_label(r: dict) -> str:
    """e.g. 'ring\nattn pallas\nreduce psum\nkernels gemm\ntp=2' from a bench result."""
    engine = r.get("engine") or {}
    return (f"{r.get('mode', '?')}\nattn {r.get('attention', '?')}\nreduce {r.get('reduce', '?')}"
            f"\nkernels {engine.get('kernels', '?')}\ntp={r.get('tp', '?')}")


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(label, bench result) for each file that holds a usable breakdown, in the order given."""
    out = []
    for p in paths:
        try:
            r = json.loads(pathlib.Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skip {p}: {e}", file=sys.stderr)
            continue
        b = r.get("breakdown")
        if not b or "error" in b or "components_ms" not in b:
            print(f"skip {p}: no breakdown", file=sys.stderr)
            continue
        out.append((variant_label(r), r))
    return out


def plot(results: list[tuple[str, dict]], out: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 2.2 * len(results) + 2), 5.5))
    xs = range(len(results))
    bottoms = [0.0] * len(results)
    for c in COMPONENTS:
        vals = [r["breakdown"]["components_ms"].get(c, 0.0) for _, r in results]
        if not any(vals):
            continue
        ax.bar(xs, vals, 0.6, bottom=bottoms, color=COLORS[c], label=c.replace("_", " "))
        for i, (v, b) in enumerate(zip(vals, bottoms)):
            if v > 0.06 * max(1e-9, max(r["breakdown"]["kernel_ms"] for _, r in results)):
                ax.text(i, b + v / 2, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white")
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    busy = [r["breakdown"]["busy_ms"] for _, r in results]
    ax.scatter(list(xs), busy, marker="D", color="black", zorder=5, label="device busy")
    for i, (_, r) in enumerate(results):
        p50 = r.get("step_ms", {}).get("p50")
        if p50:
            ax.hlines(p50, i - 0.35, i + 0.35, colors="black", linewidth=2.5, zorder=6, label="step p50 (bench)" if i == 0 else None)
            ax.text(i + 0.37, p50, f"{p50:.1f}", va="center", fontsize=8)
    budget = results[0][1].get("realtime_budget_ms")
    tallest = max(max(bottoms), max(r.get("step_ms", {}).get("p50", 0.0) for _, r in results))
    if budget and budget < 3 * tallest:  # only where it is on the same scale
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"real-time budget {budget:.1f} ms")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([lbl for lbl, _ in results], fontsize=8)
    ax.set_ylabel("ms per step (kernel time, mean over devices)")
    cfg = results[0][1].get("config", "")
    ax.set_title(title or f"{cfg}: device time per step by component")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsons", nargs="+", help="bench result files with a breakdown")
    p.add_argument("--out", default="breakdown.png")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    results = load(a.jsons)
    if not results:
        print("no bench result with a breakdown", file=sys.stderr)
        return 1
    plot(results, a.out, a.title)
    print(f"wrote {a.out} ({len(results)} variants)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
