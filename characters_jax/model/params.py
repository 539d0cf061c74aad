"""The model's parameters as the devices hold them: the abstract model (no memory), each
parameter's sharding from its logical axes, and the exact parameter count.

Block weights are stacked over a leading 'layers' axis that the Variables' metadata does
not name (``DiT`` builds its blocks with ``nnx.vmap``).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from characters_jax.config import ModelConfig
from characters_jax.model.dit import DiT


def abstract_model(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of the DiT: shapes and dtypes, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: DiT(model_cfg, rngs=nnx.Rngs(0))))


def init_state(model_cfg: ModelConfig, key) -> nnx.State:
    """The DiT's random parameters from ``key`` (jit it with the parameters' shardings as
    out_shardings: each device then creates its own shards, no host copy)."""
    return nnx.state(DiT(model_cfg, rngs=nnx.Rngs(params=key)))


def param_partition_specs(abstract_state: nnx.State, rules):
    """PartitionSpecs for the model state from each Variable's ``logical_axes``, mapped by
    ``rules`` (``parallel.sharding.ShardingRules``)."""

    def spec(path, var):
        axes = tuple(var.get_metadata().get("logical_axes", (None,) * var.get_value().ndim))
        if path and getattr(path[0], "key", path[0]) == "blocks":
            axes = ("layers",) + axes
        if len(axes) != var.get_value().ndim:
            raise ValueError(f"{jax.tree_util.keystr(path)}: logical axes {axes} do not match shape {var.get_value().shape}")
        return rules.spec(axes)

    return jax.tree_util.tree_map_with_path(spec, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def count_params(model_cfg: ModelConfig) -> int:
    """Exact parameter count, from the abstract model (no memory allocated)."""
    _, state = abstract_model(model_cfg)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
