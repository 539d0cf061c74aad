"""The DiT's weights: sharded parameter checkpoints with orbax (`characters-jax
init-checkpoint` writes one of random weights), and the DiT of a weights directory.

Random weights are created directly sharded on the devices by the engine's jitted init
(`out_shardings`), then written by orbax shard by shard: no full host copy, so
characters-57b (~56B parameters) needs no 112 GB of host memory. Restore reads each shard
straight onto its device, laid out for the given mesh (a checkpoint written at one tp size
restores at another).
"""

from __future__ import annotations

import pathlib

import jax
from flax import nnx

from characters_jax.weights.directory import check_tree, checkpointer, open_weights, tree_spec


def save_params(path: str | pathlib.Path, params: nnx.State) -> pathlib.Path:
    """Writes params (an nnx.State of sharded arrays) to `path` (must not exist)."""
    path = pathlib.Path(path).resolve()
    ckpt = checkpointer()
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
    restored = checkpointer().restore(path, target)
    state = jax.tree.map(lambda x: x, engine.abstract_params)
    nnx.replace_by_pure_dict(state, restored)
    return state


def dit_target(cfg) -> dict:
    """The DiT parameters' pure dict of ShapeDtypeStructs that the engine restores."""
    from characters_jax.model.dit import DiT

    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DiT(cfg.model, rngs=nnx.Rngs(0)))))


def dit_checkpoint(directory, cfg) -> str:
    """The orbax directory of the DiT in a weights directory, after every start-up check
    against cfg (`open_weights`, and the DiT's arrays against the engine's): the path to
    give `DiTGenerator(checkpoint=...)`."""
    w = open_weights(directory, cfg)
    check_tree(f"{w.path}: dit", w.manifest["trees"]["dit"], tree_spec(dit_target(cfg)))
    return str(w.part("dit"))
