"""Sharded parameter checkpoints with orbax, and `characters-jax init-checkpoint`.

Random weights are created directly sharded on the devices by the engine's jitted init
(`out_shardings`), then written by orbax shard by shard: no full host copy, so
characters-57b (~56B parameters) needs no 112 GB of host memory. Restore reads each shard
straight onto its device, laid out for the given mesh (a checkpoint written at one tp size
restores at another).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jax
from flax import nnx


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_params(path: str | pathlib.Path, params: nnx.State) -> pathlib.Path:
    """Writes params (an nnx.State of sharded arrays) to `path` (must not exist)."""
    path = pathlib.Path(path).resolve()
    ckpt = _checkpointer()
    ckpt.save(path, nnx.to_pure_dict(params))
    ckpt.wait_until_finished()
    return path


def restore_params(path: str | pathlib.Path, engine) -> nnx.State:
    """Restores params for `engine` (an ``engine.step.Engine``: its abstract params and
    their shardings on its mesh), each shard onto its device."""
    path = pathlib.Path(path).resolve()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    abstract = jax.tree.map(
        lambda var, sharding: jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=sharding),
        engine.abstract_params,
        engine.param_shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    target = nnx.to_pure_dict(abstract)
    restored = _checkpointer().restore(path, target)
    state = jax.tree.map(lambda x: x, engine.abstract_params)
    nnx.replace_by_pure_dict(state, restored)
    return state


def _init_checkpoint(args) -> int:
    from characters_jax.config.arguments import config_from_args
    from characters_jax.model.params import abstract_model, count_params, init_state, param_partition_specs
    from characters_jax.parallel.sharding import ShardingRules, make_mesh, named_shardings

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
