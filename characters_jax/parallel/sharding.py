"""The tensor-parallel mesh and the mapping from logical axes to mesh axes.

Every parameter carries `logical_axes` metadata (one name per dimension, or None); a
`ShardingRules` maps names to mesh axes. Megatron layout over a 1-D mesh `('tp',)`: QKV and
MLP-up column-parallel (output features over 'tp'), attention-out and MLP-down row-parallel
(input features over 'tp'), the KV cache over heads.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis (or None for replicated)."""

    layers: str | None = None
    embed: str | None = None
    heads: str | None = TP  # attention features, head-major: [heads * (3 *) head_dim]
    mlp: str | None = TP
    head_dim: str | None = None
    vocab: str | None = None

    def spec(self, logical_axes: tuple[str | None, ...]) -> P:
        return P(*(getattr(self, a) if a is not None else None for a in logical_axes))


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D ('tp',) mesh over the first `tp` devices (CPU tests: XLA_FLAGS device count)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} available ({jax.default_backend()})")
    return Mesh(np.array(devices[:tp]), (TP,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def named_shardings(mesh: Mesh, specs):
    """A pytree of PartitionSpecs -> the same tree of NamedShardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))
