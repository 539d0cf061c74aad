"""The benchmarks as named suites: ``python3 benchmarks/run.py SUITE [options] [-- ARGS]``.

  step      the step of ``--config`` at ``--tp`` (``characters-jax bench``), its engine as
            the config's [engine] and [cache] tables say (with the ``--set`` items given here)
  share     one GPU's share of tp = N (``--tp N``, default 4): the config cut to
            num_heads / N and mlp_dim / N (the residual width, norms, modulation and cache
            rows as at tp = N; written to the results directory), its step run at tp = 1:
            what one GPU of the tp = N step computes, without the all-reduce
  ablation  the step's optimizations one at a time: launch cache, then the ring cache,
            the Pallas FP8 attention, the stacked GEMM kernel, the fused GEMM + all-reduce
            (tp >= 2), and every kernel (the default)
  kernels   each kernel against its contenders at the config's per-GPU shapes at ``--tp``:
            attention (bench_attention.py), stacked GEMM (bench_gemm_stacked.py), row
            quantization (bench_row_quantize.py), and with 2 GPUs or more the block's
            reduction (bench_gemm_allreduce.py)
  gate      ``characters-jax gate latent``: the variants' latent distance against the
            reference's run-to-run spread, random weights at reduced depth (4 blocks, full
            width), 20 steps
  decoder   the VAE decoder alone (decoder_timing.py) and, with 2 GPUs or more, sharing a
            GPU of the generator (decoder_overlap.py)
  torch     the step against PyTorch (``benchmarks/torch_step.py``, its ``main(argv)``),
            skipped with a message where the file or torch is missing

Every run is a subprocess under a time limit (``--timeout`` each, ``--deadline`` in all; a
run that would start with less than 30 s left is skipped), its output in ``logs/NAME.log``
and its results in the results directory (``--out``; default ``$OUT/SUITE`` or
``out/bench/SUITE``; nothing is written into the source tree). The suite's table is printed
last. Arguments after ``--`` go to every run of the suite (the bench, the gate command,
the benchmark scripts or torch_step). ``--set TABLE.KEY=VALUE`` (repeatable) goes to every
bench and gate run (``--set engine.attention=cudnn``, ``--set cache.mode=launch``; the gate's
own tables too: ``--set gate.runs=3``).
``--trees`` runs step and share from other checkouts too (e.g. ``--trees . ../base .`` for
an A/B/A comparison of two versions in one call; each runs its own ``characters_jax`` and
its own copy of the config, with the same command line: versions that take ``--set``).

    python3 benchmarks/run.py step --config characters-57b --tp 1
    python3 benchmarks/run.py share --tp 4 --profile
    python3 benchmarks/run.py ablation --tp 2 --profile
    python3 benchmarks/run.py kernels --tp 4
    python3 benchmarks/run.py gate --tp 2 --set gate.runs=3
    python3 benchmarks/run.py ablation --dry-run          # the commands, nothing run
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MIN_LEFT_S = 30  # a run with less left than this is skipped

# (name, what it adds, (cache.mode, engine.attention, engine.reduce, engine.kernels)): every
# engine option is set, so that each row differs from the one before in one thing (at tp = 1,
# where 'fused' is left out, the reduction method has no effect).
ABLATION = (
    ("launch", "launch cache, cuDNN attention, XLA GEMMs, psum", ("launch", "cudnn", "psum", "none")),
    ("ring", "+ ring cache", ("ring", "cudnn", "psum", "none")),
    ("attention", "+ Pallas FP8 attention", ("ring", "pallas", "psum", "none")),
    ("gemm", "+ stacked GEMM kernel", ("ring", "pallas", "psum", "gemm")),
    ("fused", "+ fused GEMM + all-reduce", ("ring", "pallas", "pallas", "gemm")),
    ("all", "+ quantization and qkv kernels: what 'auto' runs on Hopper", ("ring", "pallas", "pallas", "auto")),
)
ABLATION_KEYS = ("cache.mode", "engine.attention", "engine.reduce", "engine.kernels")
GATE_VARIANTS = ("ring-fp8", "fp8-attention", "qkv-kernel", "stacked-gemm-row", "quant-kernels",
                 "fused-reduce", "ppermute", "production")
MULTI_GPU_VARIANTS = ("fused-reduce", "ppermute")


@dataclasses.dataclass(frozen=True)
class Job:
    """One subprocess: argv run in ``cwd`` (its ``characters_jax`` first on the path), its
    output to ``logs/name.log``, at most ``timeout_s``; ``result``: the JSON it writes."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    cwd: pathlib.Path = ROOT
    result: pathlib.Path | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: Job
    rc: int | None  # None: skipped
    seconds: float
    note: str = ""


class Runner:
    """Runs jobs in order under the overall deadline; ``dry_run`` prints them instead."""

    def __init__(self, out: pathlib.Path, deadline_s: float, dry_run: bool):
        self.out, self.dry_run = out, dry_run
        self.logs = out / "logs"
        self.end = time.monotonic() + deadline_s
        self.outcomes: list[Outcome] = []

    def run(self, job: Job) -> Outcome:
        left = self.end - time.monotonic()
        if self.dry_run:
            print(f"[{job.name}] (cwd {job.cwd}) {' '.join(job.argv)}")
            return self._record(Outcome(job, None, 0.0, "dry run"))
        if left < MIN_LEFT_S:
            return self._record(Outcome(job, None, 0.0, f"skipped: {left:.0f} s left"))
        limit = min(job.timeout_s, left - 10)
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{job.name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
                   PYTHONPATH=os.pathsep.join([str(job.cwd)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        print(f"== {job.name} (limit {limit:.0f} s): {' '.join(job.argv)}", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(job.argv, cwd=job.cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
                note = ""
            except subprocess.TimeoutExpired:
                rc, note = 124, f"timed out after {limit:.0f} s"
        outcome = Outcome(job, rc, time.monotonic() - t0, note)
        print(f"== {job.name}: rc={rc} in {outcome.seconds:.0f} s {note}", flush=True)
        print("\n".join(_tail(log, 12)), flush=True)
        return self._record(outcome)

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome

    def summary(self) -> str:
        lines = [f"{'run':<28} {'rc':>4} {'s':>6}  note"]
        for o in self.outcomes:
            lines.append(f"{o.job.name:<28} {'-' if o.rc is None else o.rc:>4} {o.seconds:6.0f}  {o.note}")
        return "\n".join(lines)

    def failed(self) -> bool:
        return any(o.rc not in (0, None) for o in self.outcomes)


def _tail(path: pathlib.Path, n: int) -> list[str]:
    """The last n lines of a log that say something (no progress lines or warnings)."""
    noise = re.compile(r"^\[bench\] step \d+/|Warning|warn\(|^\s*$")
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return ["   " + ln[:200] for ln in [ln for ln in lines if not noise.search(ln)][-n:]]


# ---------------------------------------------------------------------------------- configs

def config_path(config: str, tree: pathlib.Path) -> pathlib.Path:
    """A config name (``configs/NAME.toml`` of the tree) or a path."""
    p = pathlib.Path(config)
    if p.suffix == ".toml" or p.exists():
        return p.resolve()
    return (tree / "configs" / f"{config}.toml").resolve()


def share_config(src: pathlib.Path, n: int, dst: pathlib.Path) -> pathlib.Path:
    """Writes one GPU's share of tp = n of the config ``src`` to ``dst``: its text with
    ``num_heads`` and ``mlp_dim`` divided by n and ``-share-of-tpN`` appended to its name
    (every other line as it is, so that any version of the loader reads it)."""
    text = src.read_text()
    model = tomllib.loads(text).get("model", {})
    for key in ("num_heads", "mlp_dim"):
        if key not in model:
            raise ValueError(f"{src}: [model] has no {key}")
        if model[key] % n:
            raise ValueError(f"{src}: model.{key} = {model[key]} does not split {n} ways")
        text, count = re.subn(rf"(?m)^{key}\s*=\s*\d+", f"{key} = {model[key] // n}", text, count=1)
        if not count:
            raise ValueError(f"{src}: no line '{key} = ...' to cut")
    text = re.sub(r'(?m)^name\s*=\s*"([^"]*)"', rf'name = "\1-share-of-tp{n}"', text, count=1)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text)
    return dst


def gpu_count() -> int:
    """NVIDIA GPUs on this machine (``nvidia-smi -L``; 0 without it). The runner itself
    never starts jax, so that the runs below get the GPUs whole."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# ---------------------------------------------------------------------------------- suites

def set_flags(items) -> tuple[str, ...]:
    """`--set` items as command-line arguments."""
    return tuple(arg for item in items for arg in ("--set", item))


def bench_job(a, name: str, config: pathlib.Path, tp: int, tree: pathlib.Path, sets=()) -> Job:
    """A bench run: the runner's --set items, then `sets` (the later wins)."""
    out = a.out / f"{name}.json"
    items = [f"bench.warmup={a.warmup}", "bench.progress=10", *a.set, *sets]
    if a.profile:
        items += [f"bench.profile_dir={a.out / 'traces' / name}", "bench.profile_steps=2",
                  "bench.profile_without_command_buffers=true"]
    argv = [sys.executable, "-m", "characters_jax.cli", "bench", "--config", str(config), "--tp", str(tp),
            "--steps", str(a.steps), "--json", str(out), *set_flags(items)]
    return Job(name, tuple(argv + a.extra), a.timeout or 300, tree, out)


def trees_of(a) -> list[tuple[str, pathlib.Path]]:
    trees = [pathlib.Path(t).resolve() for t in a.trees]
    if len(trees) == 1:
        return [("", trees[0])]
    return [(f"_tree{i}", t) for i, t in enumerate(trees)]


def suite_step(a, runner: Runner) -> None:
    for tag, tree in trees_of(a):
        runner.run(bench_job(a, f"step_tp{a.tp}{tag}", config_path(a.config, tree), a.tp, tree))


def suite_share(a, runner: Runner) -> None:
    n = a.tp
    for tag, tree in trees_of(a):
        dst = a.out / f"share_tp{n}{tag}.toml"
        share_config(config_path(a.config, tree), n, dst)
        runner.run(bench_job(a, f"share_tp{n}{tag}", dst, 1, tree))


def suite_ablation(a, runner: Runner) -> None:
    cfg = config_path(a.config, ROOT)
    for name, _, values in ABLATION:
        if name == "fused" and a.tp == 1:
            continue  # no reduction at tp = 1
        runner.run(bench_job(a, f"ablation_{name}", cfg, a.tp, ROOT, [f"{k}={v}" for k, v in zip(ABLATION_KEYS, values)]))
    plot = ROOT / "tools" / "plot_breakdown.py"
    results = [str(o.job.result) for o in runner.outcomes if o.rc == 0 and o.job.result]
    if a.profile and plot.exists() and results:
        runner.run(Job("plot", (sys.executable, str(plot), *results, "--out", str(a.out / "breakdown.png")), 60))


def suite_kernels(a, runner: Runner) -> None:
    cfg = str(config_path(a.config, ROOT))
    common = ["--config", cfg, "--out", str(a.out)] + (["--smoke"] if a.smoke else [])
    script = lambda name: [sys.executable, str(HERE / f"{name}.py")]  # noqa: E731
    tps = sorted({1, a.tp})
    runner.run(Job("attention", tuple(script("bench_attention") + common + ["--tp", ",".join(map(str, tps))] + a.extra),
                   a.timeout or 240, result=a.out / "attention.json"))
    for name in ("gemm_stacked", "row_quantize"):
        runner.run(Job(name, tuple(script(f"bench_{name}") + common + ["--tp", str(a.tp)] + a.extra),
                       a.timeout or 300, result=a.out / f"{name}.json"))
    tp_reduce = max(2, a.tp)
    if a.smoke or gpu_count() >= tp_reduce:
        runner.run(Job("gemm_allreduce", tuple(script("bench_gemm_allreduce") + common + ["--tp", str(tp_reduce)] + a.extra),
                       a.timeout or 300, result=a.out / "gemm_allreduce.json"))
    else:
        print(f"gemm_allreduce: skipped (needs {tp_reduce} GPUs, found {gpu_count()})")


def suite_gate(a, runner: Runner) -> None:
    variants = [v for v in GATE_VARIANTS if a.tp > 1 or v not in MULTI_GPU_VARIANTS]
    timeout = a.timeout or 400
    own = ("model.num_blocks=4", "latent.steps=20", "gate.runs=4", "latent.decoder=small",
           f"gate.time_budget_s={int(timeout * 0.75)}")
    argv = [sys.executable, "-m", "characters_jax.cli", "gate", "latent", "--config", str(config_path(a.config, ROOT)),
            "--tp", str(a.tp), "--variants", ",".join(variants), "--out", str(a.out / "gate"),
            *set_flags(own + tuple(a.set))]  # the suite's items first: the caller's win
    runner.run(Job("gate", tuple(argv + a.extra), timeout, result=a.out / "gate.json"))


def suite_decoder(a, runner: Runner) -> None:
    cfg = str(config_path(a.config, ROOT))
    runner.run(Job("decoder_timing", (sys.executable, str(HERE / "decoder_timing.py"), "--config", cfg,
                                      "--json", str(a.out / "decoder_timing.json"), *a.extra),
                   a.timeout or 200, result=a.out / "decoder_timing.json"))
    tp = max(2, a.tp)
    if gpu_count() >= tp:
        runner.run(Job("decoder_overlap", (sys.executable, str(HERE / "decoder_overlap.py"), "--config", cfg,
                                           "--tp", str(tp), "--decoder-device", str(tp - 1),
                                           "--json", str(a.out / "decoder_overlap.json"), *a.extra),
                       a.timeout or 300, result=a.out / "decoder_overlap.json"))
    else:
        print(f"decoder_overlap: skipped (needs {tp} GPUs, found {gpu_count()})")


def suite_torch(a, runner: Runner) -> None:
    """Calls ``benchmarks/torch_step.py``'s ``main(argv)`` in this process."""
    path = HERE / "torch_step.py"
    why = None
    if not path.exists():
        why = f"{path} is not in this tree"
    elif importlib.util.find_spec("torch") is None:
        why = "torch is not installed"
    argv = ["--config", str(config_path(a.config, ROOT)), "--tp", str(a.tp), "--steps", str(a.steps),
            "--out", str(a.out), *a.extra]
    job = Job("torch_step", tuple(argv), 0)
    if why or runner.dry_run:
        print(f"torch: {why or 'dry run'}: torch_step.main({argv})")
        runner.outcomes.append(Outcome(job, None, 0.0, f"skipped: {why}" if why else "dry run"))
        return
    spec = importlib.util.spec_from_file_location("torch_step", path)
    module = importlib.util.module_from_spec(spec)
    t0 = time.monotonic()
    spec.loader.exec_module(module)
    rc = module.main(argv)
    runner.outcomes.append(Outcome(job, int(rc or 0), time.monotonic() - t0))


SUITES = {"step": suite_step, "share": suite_share, "ablation": suite_ablation, "kernels": suite_kernels,
          "gate": suite_gate, "decoder": suite_decoder, "torch": suite_torch}
DEFAULT_TP = {"share": 4}


# ---------------------------------------------------------------------------------- tables

def step_table(outcomes) -> str:
    """One row per bench result: step p50 / p99, fps, TFLOP/s per GPU, upkeep share, and the
    profile's components where traced."""
    comps = ("cache_upkeep", "attention", "gemm", "gemm_allreduce", "collective", "other")
    lines = [f"{'run':<24} {'p50 ms':>8} {'p99 ms':>8} {'fps':>6} {'TFLOP/s':>8} {'upkeep':>7}  | "
             + " ".join(f"{c[:6]:>6}" for c in comps) + "   engine"]
    for o in outcomes:
        r = _load(o.job.result)
        if not r or "step_ms" not in r:
            continue
        c = (r.get("breakdown") or {}).get("components_ms", {})
        engine = {k: r[k] for k in ("attention", "reduce", "kernels", "gemm") if k in r}
        lines.append(f"{o.job.name:<24} {r['step_ms']['p50']:8.1f} {r['step_ms']['p99']:8.1f} {r['fps']:6.1f} "
                     f"{r['effective_tflops_per_device']:8.0f} {100 * r['cache_upkeep_share']:6.1f}%  | "
                     + " ".join(f"{c[k]:6.1f}" if k in c else f"{'-':>6}" for k in comps)
                     + f"   {r.get('mode', '?')} " + " ".join(f"{k}={v}" for k, v in engine.items()))
    return "\n".join(lines) if len(lines) > 1 else "(no step results)"


def kernels_table(outcomes) -> str:
    parts = [f"-- {o.job.name}\n{_load(o.job.result).get('table', '(no table)')}" for o in outcomes
             if _load(o.job.result)]
    return "\n".join(parts) or "(no kernel results)"


def gate_table(outcomes, out: pathlib.Path) -> str:
    md = out / "gate.md"
    return md.read_text() if md.exists() else "(no gate table)"


def decoder_table(outcomes) -> str:
    lines = []
    t = next((_load(o.job.result) for o in outcomes if o.job.name == "decoder_timing"), None)
    if t:
        lines.append(f"decoder {t.get('frames_shape')}: {t['latency_ms']['p50']:.1f} ms a chunk (pipelined "
                     f"{t['pipelined_ms']:.1f}, with the host copy {t['with_copy_ms']['p50']:.1f})")
    v = next((_load(o.job.result) for o in outcomes if o.job.name == "decoder_overlap"), None)
    if v:
        s = v["step_ms"]
        lines.append(f"sharing a GPU: step p50 alone {s['alone']['p50']:.1f} ms, paced x{v['step_ratio_paced']:.3f}, "
                     f"back to back x{v['step_ratio_back_to_back']:.3f}")
    return "\n".join(lines) or "(no decoder results)"


def _load(path) -> dict:
    try:
        return json.loads(pathlib.Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def table(suite: str, runner: Runner, out: pathlib.Path) -> str:
    if suite in ("step", "share", "ablation"):
        return step_table(runner.outcomes)
    if suite == "kernels":
        return kernels_table(runner.outcomes)
    if suite == "gate":
        return gate_table(runner.outcomes, out)
    if suite == "decoder":
        return decoder_table(runner.outcomes)
    return ""


# ---------------------------------------------------------------------------------- main

def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=tuple(SUITES))
    p.add_argument("--config", default="characters-57b", help="config name (configs/NAME.toml) or path")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (share: the N of tp = N; default 4; else 1)")
    p.add_argument("--out", default=None, help="results directory (default $OUT/SUITE or out/bench/SUITE)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each step run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="step runs: trace 2 steps for the per-component breakdown")
    p.add_argument("--trees", nargs="+", default=["."], help="step, share: checkouts to run from, in order")
    p.add_argument("--timeout", type=float, default=None, help="seconds each run may take (default per suite)")
    p.add_argument("--deadline", type=float, default=3600, help="seconds all runs may take")
    p.add_argument("--smoke", action="store_true", help="kernels: the scripts' CPU checks (small shapes)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    sys.path.insert(0, str(ROOT))
    from characters_jax.config.arguments import add_set_argument

    add_set_argument(p)
    a = p.parse_args(argv)
    a.extra = extra
    a.tp = a.tp or DEFAULT_TP.get(a.suite, 1)
    a.out = pathlib.Path(a.out or pathlib.Path(os.environ.get("OUT") or ROOT / "out" / "bench") / a.suite).resolve()
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from characters_jax.config import ConfigError, load_config

    try:  # a bad --set item or config fails here, before any run starts
        items = a.set
        if a.suite == "gate":  # the gate's own tables beside the config's
            from characters_jax.config.arguments import config_sets
            from characters_jax.gate.options import gate_tables

            items, gate_items = config_sets(a.set)
            gate_tables(gate_items)
        load_config(str(config_path(a.config, ROOT)), items).validate_tp(a.tp)
    except (ConfigError, OSError) as e:
        print(f"run.py {a.suite}: {e}", file=sys.stderr)
        return 2
    runner = Runner(a.out, a.deadline, a.dry_run)
    try:
        SUITES[a.suite](a, runner)
    except (ValueError, OSError) as e:  # a config that does not split, a missing file
        print(f"run.py {a.suite}: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        return 0
    print(f"\n==== {a.suite}: results in {a.out} ====")
    print(runner.summary())
    print()
    print(table(a.suite, runner, a.out))
    return 1 if runner.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
