"""`characters-jax bench`: time the step of a config on a mesh, in ring or launch mode.

Compiles the step once (compile time reported), warms up, then times each step to its
completion: p50/p90/p99/max, the position-reset steps separately, fps, effective TFLOP/s.
Cache upkeep is measured by timing the step's cache operations alone (`measure.upkeep`,
the same write / re-rotation / re-quantization / shift code the step runs) in the same
process, as a share of the step. The bench syncs the host after each step to time it; the
step itself never does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, np.float64)
    if a.size == 0:
        return {}
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "n": int(a.size),
    }


def reset_steps(num_steps: int, ring_frames: int, reset_period: int) -> set[int]:
    """Host-side replay of the position schedule: the step indices that pay a reset."""
    out, t = set(), 1
    for s in range(num_steps):
        if t >= ring_frames + reset_period:
            out.add(s)
            t -= reset_period
        t += 1
    return out


def _device_memory() -> dict:
    import jax

    stats = {}
    for d in jax.local_devices():
        try:
            m = d.memory_stats() or {}
        except Exception:  # some backends have no memory stats
            m = {}
        if m:
            stats[str(d.id)] = {k: int(m[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in m}
    return stats


def random_session_inputs(cfg, engine, seed: int):
    """A session's inputs drawn at random: (image latent [grid_h, grid_w, C] float32,
    prompt ids (up to 48), one step's audio [A_tok, F_a] float32 on the devices,
    replicated)."""
    import jax

    rng = np.random.default_rng(seed)
    image = rng.standard_normal((cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)).astype(np.float32)
    prompt = list(rng.integers(0, cfg.model.prompt_vocab, size=min(48, cfg.cache.max_prompt_tokens)))
    audio = jax.device_put(
        rng.standard_normal((cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim)).astype(np.float32), engine.replicated
    )
    return image, prompt, audio


def run_bench(args) -> dict:
    import jax

    from characters_jax.config.arguments import config_from_args
    from characters_jax.engine.generator import DiTGenerator, compile_programs
    from characters_jax.engine.options import resolve_engine
    from characters_jax.engine.step import Engine
    from characters_jax.measure.upkeep import cache_upkeep, step_flops, upkeep_inputs
    from characters_jax.model.params import count_params
    from characters_jax.parallel.sharding import make_mesh
    from characters_jax.device_memory import device_memory
    from characters_jax.serving.placement import check_measured, memory_plan_line, pool_bytes, size_generator_pool

    cfg = config_from_args(args)
    b = cfg.bench
    cfg.validate_tp(args.tp)
    # Before the backend starts (resolving the engine's options reads the backend): the GPU
    # pool from the plan (PlacementError if it cannot fit).
    placement = size_generator_pool(cfg, args.tp)
    options = resolve_engine(cfg)  # a bad option fails here, before any parameter exists
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not b.quiet else (lambda *a: None)
    log(f"[bench] {cfg.name}: {count_params(cfg.model) / 1e9:.3f}B params, tp={args.tp}, "
        f"mode={cfg.cache.mode}, cache={cfg.cache.dtype}, attention={options.attention}, "
        f"reduce={options.reduce}, kernels={options.kernels}, backend={jax.default_backend()}")

    # The step and the session's prefill compiled before any weight exists (XLA's autotuning
    # then has the whole pool), their memory measured and checked against the pool.
    engine = Engine(cfg, make_mesh(args.tp))
    image, prompt, audio = random_session_inputs(cfg, engine, cfg.seed)
    programs = compile_programs(engine, buckets=(engine.prompt_bucket(len(prompt)),),
                                random_weights=not args.checkpoint, workers=1)
    compile_s = programs.compile_s["step"]
    log(f"[bench] step compiled in {compile_s:.1f} s")
    compile_peak = device_memory().get("peak_bytes_in_use")  # the autotuning scratch, no weight placed yet
    pool = pool_bytes(engine.mesh.devices.flat)
    m = programs.memory
    need = check_measured(cfg, placement, m.params, m.state, m.working, pool)
    plan_line = memory_plan_line(placement, need, pool)
    log(f"[bench] memory plan {plan_line}")
    mem = programs.step.memory_analysis()
    memory = {}
    if mem is not None:
        memory = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes") if hasattr(mem, k)}

    t0 = time.perf_counter()
    gen = DiTGenerator(cfg, tp=args.tp, checkpoint=args.checkpoint, seed=cfg.seed, programs=programs)
    jax.block_until_ready((gen.params, gen.state))
    init_s = time.perf_counter() - t0
    log(f"[bench] params and state on devices in {init_s:.1f} s")
    step_exe = programs.step

    gen.start_session(image, prompt, seed=cfg.seed)
    total = b.warmup + args.steps
    resets = reset_steps(total, cfg.cache.ring_frames, cfg.cache.reset_period)
    state = gen.state
    times, reset_times = [], []
    for s in range(total):
        t0 = time.perf_counter()
        state, latent = step_exe(gen.params, state, audio)
        latent.block_until_ready()
        dt = (time.perf_counter() - t0) * 1e3
        if s >= b.warmup:
            (reset_times if s in resets else times).append(dt)
        if b.progress and (s + 1) % b.progress == 0:
            log(f"[bench] step {s + 1}/{total}: {dt:.2f} ms")
    finite = bool(np.isfinite(np.asarray(latent)).all())
    gen.state = state

    # Cache operations alone, same shapes, same process.
    new_kv = upkeep_inputs(engine)
    per_call = b.upkeep_steps_per_call
    up_exe = cache_upkeep(engine, per_call).lower(gen.params, state, new_kv).compile()
    up_times = []
    for s in range(b.warmup + max(5, args.steps // per_call)):
        t0 = time.perf_counter()
        state, checksum = up_exe(gen.params, state, new_kv)
        checksum.block_until_ready()
        if s >= b.warmup:
            up_times.append((time.perf_counter() - t0) * 1e3 / per_call)
    gen.state = state

    breakdown = None
    if b.profile_dir:
        prof_exe = step_exe
        if b.profile_without_command_buffers:
            t0 = time.perf_counter()
            prof_exe = engine.step.lower(gen.params, gen.state, audio).compile(
                compiler_options={"xla_gpu_enable_command_buffer": ""})
            log(f"[bench] step compiled without command buffers for the profile in {time.perf_counter() - t0:.1f} s")
        breakdown = _profile(b, prof_exe, gen, audio, log)
        if b.profile_without_command_buffers and "error" not in breakdown:
            breakdown["note"] = breakdown.get("note", "") + "; traced with XLA command buffers off"

    step_ms = percentiles(times)
    upkeep_ms = percentiles(up_times)
    p50_s = step_ms["p50"] / 1e3
    flops = step_flops(cfg)
    result = {
        "config": cfg.name,
        "tp": args.tp,
        "mode": cfg.cache.mode,
        "cache_dtype": cfg.cache.dtype,
        "weight_dtype": cfg.model.weight_dtype,
        "activation_scale": cfg.model.activation_scale,
        "engine": dataclasses.asdict(cfg.engine),
        "attention": gen.engine.options.attention,
        "reduce": gen.engine.options.reduce,
        "kernels": gen.engine.options.kernels,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in gen.mesh.devices.flat],
        "params_billion": count_params(cfg.model) / 1e9,
        "init_s": init_s,
        "compile_s": compile_s,
        "steps": args.steps,
        "warmup": b.warmup,
        "step_ms": step_ms,
        "reset_step_ms": reset_times,
        "fps": cfg.video.frames_per_step / p50_s,
        "realtime_budget_ms": 1e3 * cfg.video.step_seconds,
        "step_tflop": flops / 1e12,
        "effective_tflops_per_device": flops / p50_s / 1e12 / args.tp,
        "cache_upkeep_ms": upkeep_ms,
        "cache_upkeep_share": upkeep_ms["p50"] / step_ms["p50"],
        "compiled_memory": memory,
        "memory_plan": {"line": plan_line, "params_bytes": need.params, "cache_bytes": need.cache,
                        "working_bytes": need.working, "pool_bytes": pool,
                        "largest_temp": list(m.largest_temp()), "after_compile_peak_bytes": compile_peak,
                        "programs": {n: dataclasses.asdict(p) for n, p in m.programs.items()}},
        "device_memory": _device_memory(),
        "latent_finite": finite,
    }
    if breakdown is not None:
        result["breakdown"] = breakdown
    return result


def _profile(b, step_exe, gen, audio, log) -> dict:
    """Traces bench.profile_steps steps into bench.profile_dir (`b`: the [bench] table) and
    returns their component breakdown (see `characters_jax.measure.profile`); on failure,
    {"error": ...} so that the timing stands."""
    from characters_jax.measure.profile import profile_steps

    try:
        state, breakdown = profile_steps(step_exe, gen.params, gen.state, audio, steps=b.profile_steps, logdir=b.profile_dir)
        gen.state = state
        (pathlib.Path(b.profile_dir) / "breakdown.json").write_text(json.dumps(breakdown, indent=2))
        log(f"[bench] profiled {breakdown['steps']} steps into {b.profile_dir}")
        return breakdown
    except Exception as e:  # the profiler is optional: keep the timing results
        log(f"[bench] profile failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def format_table(r: dict) -> str:
    s, u = r["step_ms"], r["cache_upkeep_ms"]
    rows = [
        ("config / tp / mode / cache", f"{r['config']} / {r['tp']} / {r['mode']} / {r['cache_dtype']} ({r['backend']})"),
        ("compile", f"{r['compile_s']:.2f} s"),
        ("step p50 / p90 / p99 / max", f"{s['p50']:.2f} / {s['p90']:.2f} / {s['p99']:.2f} / {s['max']:.2f} ms  (n={s['n']})"),
        ("reset steps", ", ".join(f"{t:.2f} ms" for t in r["reset_step_ms"]) or "none in window"),
        ("fps (budget)", f"{r['fps']:.1f}  ({r['realtime_budget_ms']:.1f} ms/step for real time)"),
        ("effective TFLOP/s per device", f"{r['effective_tflops_per_device']:.2f}  ({r['step_tflop']:.3f} TFLOP/step)"),
        ("cache upkeep p50 (share)", f"{u['p50']:.2f} ms  ({100 * r['cache_upkeep_share']:.1f}% of the step)"),
    ]
    temp = r["compiled_memory"].get("temp_size_in_bytes")
    if temp is not None:
        rows.append(("step temporaries per device", f"{temp / 2**30:.3f} GiB"))
    peaks = [(d.get("peak_bytes_in_use"), d.get("bytes_limit")) for d in r["device_memory"].values()]
    if peaks and all(p is not None and lim for p, lim in peaks):
        peak, limit = max(peaks)
        rows.append(("device memory peak / pool", f"{peak / 2**30:.2f} / {limit / 2**30:.2f} GiB"))
    rows.append(("memory plan", r["memory_plan"]["line"]))
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    b = r.get("breakdown")
    if b:
        from characters_jax.measure.profile import format_breakdown

        table += "\n\nprofile breakdown (device time per step)\n"
        table += f"error: {b['error']}" if "error" in b else format_breakdown(b)
    return table


def _bench(args) -> int:
    if args.steps < 1:
        print("characters-jax bench: --steps must be >= 1", file=sys.stderr)
        return 2
    result = run_bench(args)
    print(format_table(result))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0 if result["latent_finite"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    from characters_jax.config.arguments import add_config_arguments

    p = sub.add_parser("bench", help="time the step: percentiles, reset step, fps, cache-upkeep share",
                       description="Times the step of --config at --tp with the engine its [engine] and [cache] tables "
                                   "pick (--set engine.attention=cudnn, --set cache.mode=launch, ...); the [bench] table "
                                   "holds the rest (warmup, progress, quiet, profile_dir, ...).")
    add_config_arguments(p, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices)")
    p.add_argument("--steps", type=int, default=50, help="timed steps (after bench.warmup)")
    p.add_argument("--checkpoint", default=None, help="orbax checkpoint directory (random weights of the config's seed if omitted)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=_bench)
