"""CLI sub-command of the weights: init-checkpoint."""

from __future__ import annotations

import argparse
import pathlib
import time


def _init_checkpoint(args) -> int:
    import functools

    import jax

    from characters_jax.config.arguments import config_from_args
    from characters_jax.model.params import abstract_model, count_params, init_state, param_partition_specs
    from characters_jax.parallel.sharding import ShardingRules, make_mesh, named_shardings
    from characters_jax.weights.dit import save_params

    cfg = config_from_args(args)
    cfg.validate_tp(args.tp)
    out = pathlib.Path(args.out)
    if out.exists():
        print(f"characters-jax init-checkpoint: {out} already exists; choose a new directory")
        return 2
    _, abstract = abstract_model(cfg.model)
    shardings = named_shardings(make_mesh(args.tp), param_partition_specs(abstract, ShardingRules()))
    init = jax.jit(functools.partial(init_state, cfg.model), out_shardings=shardings)
    print(f"{cfg.name}: {count_params(cfg.model) / 1e9:.2f}B parameters, tp={args.tp}, initialising on {jax.default_backend()} ...", flush=True)
    t0 = time.perf_counter()
    params = init(jax.random.key(cfg.seed))
    jax.block_until_ready(params)
    t1 = time.perf_counter()
    print(f"initialised in {t1 - t0:.1f} s; writing {out} ...", flush=True)
    save_params(out, params)
    print(f"wrote {out} in {time.perf_counter() - t1:.1f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from characters_jax.config.arguments import add_config_arguments

    p = sub.add_parser("init-checkpoint", help="create random weights (of the config's seed: --set seed=N) sharded on the "
                                               "devices and save them")
    add_config_arguments(p, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.set_defaults(func=_init_checkpoint)
