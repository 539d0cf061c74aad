"""One step program compiled under several sets of XLA compiler options, timed in one
process: what XLA's command buffers (CUDA graphs) do to the launch gaps between the step's
~5,000 kernels.

The generator is built once (same weights, same session); the step is lowered once and
compiled per option set. Every option set first runs one step from a copy of the same
state, and its latent must equal the first set's bit for bit (the options change how the
kernels are launched, not what they compute). Then `--rounds` interleaved rounds of
`--steps` steps each (after one warm-up step per executable); each step timed to its
completion on the host clock, as `characters-jax bench` does. Median per option set, and
its ratio to the first.

Option sets (`--sets`, comma-separated names):
  default     the compiler's defaults
  cb_off      no command buffers: every kernel launched from the host
  cb_while    command buffers for fusions, cuBLAS(Lt), custom calls and cuDNN, and around
              while loops and conditionals too (each block scan one graph: no host round
              trip per iteration)
  cb_while_unroll  as cb_while, loops of known trip count unrolled inside the graph
  cb_min1     the default command-buffer types, graphs of any size (min graph size 1)

`--share N` cuts the model to one GPU's share of tp = N (num_heads / N, mlp_dim / N), as
`benchmarks/run.py share` does, and runs it at tp = 1.

Run (one GPU):  PYTHONPATH=. python3 tools/bench_step_options.py --config characters-57b \
                  --share 4 --json $OUT/step_options.json
CPU smoke:      python tools/bench_step_options.py --config tiny --steps 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

# Command-buffer types named explicitly (XLA's default set may differ by version).
_CB_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
OPTION_SETS = {
    "default": {},
    "cb_off": {"xla_gpu_enable_command_buffer": ""},
    "cb_while": {"xla_gpu_enable_command_buffer": _CB_TYPES + ",WHILE,CONDITIONAL"},
    "cb_while_unroll": {"xla_gpu_enable_command_buffer": _CB_TYPES + ",WHILE,CONDITIONAL",
                        "xla_gpu_command_buffer_unroll_loops": True},
    "cb_min1": {"xla_gpu_graph_min_graph_size": 1},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="characters-57b")
    p.add_argument("--share", type=int, default=1, help="one GPU's share of tp = N, run at tp = 1")
    p.add_argument("--sets", default="default,cb_off,cb_while,cb_while_unroll")
    p.add_argument("--steps", type=int, default=6, help="timed steps per round and set")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in OPTION_SETS]
    if unknown or not names:
        print(f"bench_step_options: unknown option sets {unknown}; known: {sorted(OPTION_SETS)}", file=sys.stderr)
        return 2

    import jax

    from characters_jax.config import ConfigError, load_config
    from characters_jax.engine.generator import DiTGenerator
    from characters_jax.measure.bench import random_session_inputs

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = load_config(args.config)
    try:
        cfg = cfg.share_of_tp(args.share)
    except ConfigError as err:
        print(f"bench_step_options: --share {args.share}: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    gen = DiTGenerator(cfg, tp=1, seed=args.seed)
    jax.block_until_ready((gen.params, gen.state))
    log(f"[options] {cfg.name}: params and state on the device in {time.perf_counter() - t0:.1f} s")
    engine = gen.engine
    image, prompt, audio = random_session_inputs(cfg, engine, args.seed)
    gen.start_session(image, prompt, seed=args.seed)

    lowered = engine.step.lower(gen.params, gen.state, audio)
    exes, compile_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        exes[name] = lowered.compile(compiler_options=OPTION_SETS[name] or None)
        compile_s[name] = time.perf_counter() - t0
        log(f"[options] {name}: compiled in {compile_s[name]:.1f} s")

    # The same step from the same state under every option set: identical latents.
    start = jax.tree.map(lambda a: a.copy(), gen.state)
    latents = {}
    for name in names:
        state = jax.tree.map(lambda a: a.copy(), start)
        _, latent = exes[name](gen.params, state, audio)
        latents[name] = np.asarray(latent)
    del start
    first = names[0]
    same = {n: bool(np.array_equal(latents[n], latents[first])) for n in names}
    finite = {n: bool(np.isfinite(latents[n]).all()) for n in names}

    state = gen.state
    for name in names:  # warm-up
        state, latent = exes[name](gen.params, state, audio)
        latent.block_until_ready()
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, latent = exes[name](gen.params, state, audio)
                latent.block_until_ready()
                times[name].append((time.perf_counter() - t0) * 1e3)
        log(f"[options] round {r + 1}/{args.rounds}: " +
            ", ".join(f"{n} {statistics.median(times[n][-args.steps:]):.2f}" for n in names))
    gen.state = state

    med = {n: statistics.median(times[n]) for n in names}
    result = {"config": cfg.name, "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "sets": {n: OPTION_SETS[n] for n in names},
              "compile_s": compile_s, "step_ms": times, "median_ms": med,
              "ratio_to_first": {n: med[n] / med[first] for n in names},
              "latent_equal_to_first": same, "latent_finite": finite}
    print(f"{'option set':<18} {'p50 ms':>8} {'min ms':>8} {'ratio':>7}  same latent  compile s")
    for n in names:
        print(f"{n:<18} {med[n]:8.2f} {min(times[n]):8.2f} {med[n] / med[first]:7.3f}  {str(same[n]):<11}  {compile_s[n]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(finite.values()) and all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
