"""characters-57b at tp=1 on one GPU with the defaults (no XLA_PYTHON_CLIENT_MEM_FRACTION):
the memory plan against what the processes really take.

    python3 benchmarks/memory_gpu.py [--config characters-57b] [--steps 20] [--speech-s 2]
        [--only bench,jax,serve] [--out DIR]

Runs, each as a user would, in a subprocess with the memory-fraction variables removed from
its environment, while a thread polls ``nvidia-smi`` for every process's GPU memory:

* bench: ``characters-jax bench --config C --tp 1`` (step p50, the allocator's peak and
  pool, the plan's figures, what each process took from the GPU outside its pool);
* jax: ``benchmarks/torch_step.py --side jax`` (the PyTorch comparison's JAX side);
* serve: ``characters-jax serve --config C`` with its decoder on the same GPU, ready, then
  one session of `--speech-s` seconds of speech over gRPC (the client library), and both
  processes' memory (their allocators' peaks and pools, and nvidia-smi's per process).

Writes ``memory_gpu.json``, the bench's JSON and the three logs under --out ($OUT/memory or
out/bench/memory; the rest goes to a temporary directory) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

GIB = 1 << 30
FRACTION_NAMES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")


def clean_env(compile_cache: pathlib.Path) -> dict[str, str]:
    """This environment without any memory-fraction or preallocation setting (the defaults),
    with the repository importable, NVLink multicast off, and XLA's persistent compilation
    cache in `compile_cache`."""
    env = {k: v for k, v in os.environ.items() if k not in FRACTION_NAMES}
    env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class GpuPoller:
    """Polls nvidia-smi every `period` s: the largest GPU memory seen per process (MiB) and
    the GPU's largest used memory."""

    def __init__(self, period: float = 0.5):
        self.per_pid: dict[int, int] = {}
        self.gpu_used_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _query(self, what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            try:
                for pid, used in self._query("compute-apps=pid,used_memory"):
                    if used.isdigit():
                        self.per_pid[int(pid)] = max(self.per_pid.get(int(pid), 0), int(used))
                for (used,) in self._query("gpu=memory.used"):
                    self.gpu_used_mib = max(self.gpu_used_mib, int(float(used)))
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            self._stop.wait(period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(30)
        return {"per_pid_mib": dict(self.per_pid), "gpu_used_mib": self.gpu_used_mib}


def run_logged(name: str, argv: list[str], out: pathlib.Path, work: pathlib.Path, timeout: float) -> tuple[int, float, dict]:
    """argv under `timeout` with its output in out/NAME.log: (exit code, seconds, nvidia-smi
    peaks while it ran). The bench and the JAX side share one compilation cache (the second
    finds the step compiled); serve starts cold with its own."""
    poller = GpuPoller()
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, env=clean_env(work / "xla-bench"), stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0, poller.stop()


def tail(path: pathlib.Path, n: int = 2500) -> str:
    return path.read_text()[-n:] if path.exists() else ""


def bench(args, out: pathlib.Path, work: pathlib.Path) -> dict:
    path = out / "bench.json"
    rc, secs, smi = run_logged("bench", [sys.executable, "-m", "characters_jax.cli", "bench", "--config", args.config, "--tp", "1",
                                         "--steps", str(args.steps), "--json", str(path)], out, work, args.timeout)
    row = {"rc": rc, "seconds": round(secs, 1), "nvidia_smi": smi}
    if rc != 0 or not path.exists():
        return {**row, "error": tail(out / "bench.log")}
    r = json.loads(path.read_text())
    mem = next(iter(r["device_memory"].values()), {})
    plan = r["memory_plan"]
    return {**row, "step_p50_ms": round(r["step_ms"]["p50"], 2), "tflops": round(r["effective_tflops_per_device"], 1),
            "compile_s": round(r["compile_s"], 1), "init_s": round(r["init_s"], 1),
            "peak_gib": mem.get("peak_bytes_in_use", 0) / GIB, "pool_gib": mem.get("bytes_limit", 0) / GIB,
            "after_compile_peak_gib": (plan.get("after_compile_peak_bytes") or 0) / GIB, "plan": plan["line"],
            "largest_temp": plan["largest_temp"], "working_gib": plan["working_bytes"] / GIB,
            "programs": plan["programs"], "outside_pool_gib": (max(smi["per_pid_mib"].values(), default=0) << 20) / GIB
            - mem.get("bytes_limit", 0) / GIB}


def jax_side(args, out: pathlib.Path, work: pathlib.Path) -> dict:
    rc, secs, smi = run_logged("torch_step_jax", [sys.executable, "benchmarks/torch_step.py", "--config", args.config,
                                                  "--side", "jax", "--steps", "10", "--warmup", "2", "--out", str(work / "torch_step")],
                               out, work, args.timeout)
    row = {"rc": rc, "seconds": round(secs, 1), "nvidia_smi": smi}
    path = work / "torch_step" / f"torch_step_{args.config}_tp1.json"
    if rc != 0 or not path.exists():
        return {**row, "error": tail(out / "torch_step_jax.log")}
    j = json.loads(path.read_text()).get("jax", {})
    return {**row, "step_p50_ms": round(j.get("step_ms", {}).get("p50", 0), 2), "compile_s": round(j.get("compile_s", 0), 1),
            "memory_gib": j.get("device_memory_gib")}


def serve(args, out: pathlib.Path, work: pathlib.Path) -> dict:
    from serving_harness import Worker, png, speech

    from characters_jax.config import load_config

    cfg = load_config(args.config)
    poller = GpuPoller()
    row: dict = {}
    t0 = time.monotonic()
    try:
        w = Worker(work / "serve", args.config, env=clean_env(work / "xla-serve"), ready_timeout=args.timeout)
    except AssertionError as err:
        shutil.copy(work / "serve" / "worker.log", out / "serve_worker.log")
        row.update(error=str(err)[-2500:], nvidia_smi=poller.stop())
        return row
    try:
        state = w.state()
        row.update(ready_s=round(time.monotonic() - t0, 1), startup_s=state["startup_s"], placement=state["placement"],
                   memory_plan=state.get("memory_plan"), warmup=state["warmup"], decoder_memory=state.get("decoder_memory"),
                   pids={"worker": state["pid"], "decoder": state.get("decoder_pid")})
        pcm = speech(args.speech_s, seed=7)
        result = w.client.converse(None, pcm, image=png(), prompt="a calm voice", seed=11, realtime=True)
        row["session"] = result.summary(cfg.video.fps)
        row["frames_shape"] = [len(result.frames), *result.frames[0].shape] if result.chunks else []
    except Exception as err:  # reported in the table; the worker is stopped below
        row["error"] = f"{type(err).__name__}: {err}"
    finally:
        w.stop()
        shutil.copy(w.log_path, out / "serve_worker.log")
    smi = poller.stop()
    row["nvidia_smi"] = smi
    pids = row.get("pids", {})
    row["smi_gib"] = {k: smi["per_pid_mib"].get(pid, 0) / 1024 for k, pid in pids.items() if pid}
    return row


def table(rows: dict) -> str:
    lines = []
    b = rows.get("bench")
    if b:
        lines.append(f"bench            rc={b['rc']} {b['seconds']} s" + (
            f"  step p50 {b['step_p50_ms']} ms ({b['tflops']} TFLOP/s), compile {b['compile_s']} s, init {b['init_s']} s, "
            f"allocator peak {b['peak_gib']:.2f} of a {b['pool_gib']:.2f} GiB pool, peak after compile (no weights) "
            f"{b['after_compile_peak_gib']:.2f} GiB, working {b['working_gib']:.2f} GiB (largest temp {b['largest_temp']}), "
            f"outside the pool {b['outside_pool_gib']:.2f} GiB; GPU used peak {b['nvidia_smi']['gpu_used_mib']} MiB"
            if "error" not in b else "  FAILED"))
        if "plan" in b:
            lines.append(f"  plan: {b['plan']}")
    j = rows.get("jax")
    if j:
        lines.append(f"torch_step jax   rc={j['rc']} {j['seconds']} s" + (
            f"  step p50 {j['step_p50_ms']} ms, compile {j['compile_s']} s, memory {j['memory_gib']}; GPU used peak "
            f"{j['nvidia_smi']['gpu_used_mib']} MiB" if "error" not in j else "  FAILED"))
    s = rows.get("serve")
    if s:
        if "ready_s" in s:
            sess = s.get("session", {})
            gen, dec = s["warmup"]["memory"], s.get("decoder_memory") or {}
            lines.append(f"serve            ready {s['ready_s']} s (startup {s['startup_s']} s); session {sess.get('final_state')} "
                         f"{sess.get('frames')} frames, step {sess.get('step_ms_p50')} ms, decode {sess.get('decode_ms_p50')} ms, "
                         f"{sess.get('sustained_fps')} fps, underruns {sess.get('playout_underruns')}")
            lines.append(f"  generator: allocator peak {gen.get('peak_bytes_in_use', 0) / GIB:.2f} of {gen.get('bytes_limit', 0) / GIB:.2f} GiB; "
                         f"decoder: {dec.get('peak_bytes_in_use', 0) / GIB:.2f} of {dec.get('bytes_limit', 0) / GIB:.2f} GiB; "
                         f"nvidia-smi per process {json.dumps({k: round(v, 2) for k, v in s.get('smi_gib', {}).items()})} GiB; "
                         f"GPU used peak {s['nvidia_smi']['gpu_used_mib']} MiB")
            lines.append(f"  plan: {s.get('memory_plan')}")
        if "error" in s:
            lines.append(f"serve            FAILED: {s['error'][-600:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="characters-57b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--speech-s", type=float, default=2.0)
    p.add_argument("--only", default="bench,jax,serve", help="comma list of: bench, jax, serve")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds each run may take")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out/bench"), "memory"))
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="memory-gpu-"))
    runs = {"bench": bench, "jax": jax_side, "serve": serve}
    rows: dict = {}
    for name in args.only.split(","):
        print(f"[memory_gpu] {name} ...", flush=True)
        rows[name] = runs[name](args, out, work)
        (out / "memory_gpu.json").write_text(json.dumps(rows, indent=1, default=str))
    print(table(rows))
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
