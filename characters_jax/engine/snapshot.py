"""The step state to and from the host, for a session snapshot.

`capture(state)` dispatches a device copy of the donated `StepState` (one program that
writes every leaf to a new buffer, so the next step can consume the state while the copy
travels) and starts the copy's transfer to the host (`copy_to_host_async`); nothing waits.
`StateCapture.arrays()` waits for the transfer and returns the leaves as numpy arrays by
name (a sharded cache is gathered: each array is the global one). `restore(...)` places
such arrays back on the engine's mesh with the state's shardings.

The arrays by name: cache.k, cache.v [L, S, H, D] (FP8 as its uint8 bit pattern, bf16 or
float32), cache.k_scale, cache.v_scale [L, H] float32, valid [S] bool, slot_positions [S, 3]
int32, step [] int32, frame_time [] int32, rng [2] uint32. They are the whole generative
state of a session between two steps: the sink (reference image and prompt) lives in the
cache's first slots, the ring and its write index follow from `step`, the position reset's
phase from `frame_time`.

`identity(...)` describes what a state is valid for: the config's generative sections,
the tensor-parallel size, the resolved engine options and the weights; `differences`
names every field in which two identities disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.engine.state import StepState

# The config's sections that decide what a state means and how the next steps compute.
GENERATIVE_SECTIONS = ("model", "video", "cache", "sampler", "audio", "decoder")


def state_arrays(state: StepState) -> dict[str, jax.Array]:
    """The state's leaves by name (the module docstring's names)."""
    c = state.cache
    return {"cache.k": c.k, "cache.v": c.v, "cache.k_scale": c.k_scale, "cache.v_scale": c.v_scale, "valid": state.valid,
            "slot_positions": state.slot_positions, "step": state.step, "frame_time": state.frame_time, "rng": state.rng}


def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


class StateCapture:
    """A device copy of a step state on its way to the host (`capture`)."""

    def __init__(self, copies: dict[str, jax.Array], step_index: int):
        self._copies = copies
        self.step_index = step_index

    def arrays(self) -> dict[str, np.ndarray]:
        """Waits for the transfer; the arrays by name, host copies that own their memory
        (the device copy is released)."""
        out = {name: np.array(a, copy=True) for name, a in self._copies.items()}
        self._copies = {}
        return out

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._copies.values())


class StateCopier:
    """The copy program of one engine's state (compiled at its first use)."""

    def __init__(self, shardings: StepState):
        # A function of its own: jit shares compiled programs between equal functions with
        # equal attributes, and a generator counts only the programs it holds.
        self.program = jax.jit(lambda state: _copy_tree(state), out_shardings=shardings)

    def capture(self, state: StepState, step_index: int) -> StateCapture:
        """Dispatches the copy and the host transfer; returns at once."""
        copies = state_arrays(self.program(state))
        for a in copies.values():
            a.copy_to_host_async()
        return StateCapture(copies, step_index)


def state_shapes(shapes: StepState) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) of a state (or of its ShapeDtypeStructs)."""
    return {name: (tuple(int(d) for d in a.shape), jnp.dtype(a.dtype).name) for name, a in state_arrays(shapes).items()}


def check_arrays(arrays: dict[str, np.ndarray], expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """What is wrong with `arrays` against `expected` (state_shapes): missing, extra, or of
    another shape or dtype. Empty when they fit."""
    problems = [f"{name}: missing" for name in expected if name not in arrays]
    problems += [f"{name}: not a state array" for name in arrays if name not in expected]
    for name, (shape, dtype) in expected.items():
        a = arrays.get(name)
        if a is not None and (tuple(a.shape) != shape or a.dtype.name != dtype):
            problems.append(f"{name}: {a.dtype.name}{list(a.shape)}, expected {dtype}{list(shape)}")
    return problems


def restore(arrays: dict[str, np.ndarray], shardings: StepState) -> StepState:
    """A StepState on the devices from host arrays by name (checked by the caller with
    `check_arrays`), each placed with its sharding (a sharded cache is split again)."""
    s = shardings
    put = jax.device_put
    cache = dataclasses.replace(s.cache, k=put(arrays["cache.k"], s.cache.k), v=put(arrays["cache.v"], s.cache.v),
                                k_scale=put(arrays["cache.k_scale"], s.cache.k_scale), v_scale=put(arrays["cache.v_scale"], s.cache.v_scale))
    return StepState(cache=cache, valid=put(arrays["valid"], s.valid), slot_positions=put(arrays["slot_positions"], s.slot_positions),
                     step=put(arrays["step"], s.step), frame_time=put(arrays["frame_time"], s.frame_time), rng=put(arrays["rng"], s.rng))


def weights_id(checkpoint: str | None, seed: int) -> str:
    """What names a generator's weights: the sha256 of its weights directory's manifest
    (checkpoint: the DiT's orbax directory inside it), or the random weights' seed."""
    if not checkpoint:
        return f"random seed {seed}"
    path = pathlib.Path(checkpoint).resolve()
    for manifest in (path / "manifest.json", path.parent / "manifest.json"):
        if manifest.is_file():
            return "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    return f"orbax {path}"


def identity(config, tp: int, engine_options, weights: str) -> dict:
    """What a state is valid for, JSON-ready: config (its name and generative sections),
    tp, engine (the resolved options) and weights."""
    cfg = dataclasses.asdict(config)
    return {"config_name": config.name, "config": {k: cfg[k] for k in GENERATIVE_SECTIONS}, "tp": int(tp),
            "engine": dataclasses.asdict(engine_options) if dataclasses.is_dataclass(engine_options) else dict(engine_options),
            "weights": weights}


def differences(stored: dict, here: dict, prefix: str = "") -> list[str]:
    """Every leaf in which two identities (or any JSON trees) differ: 'path: stored X, here Y'."""
    if isinstance(stored, dict) and isinstance(here, dict):
        out = []
        for key in sorted(set(stored) | set(here), key=str):
            out += differences(stored.get(key), here.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    if _canonical(stored) != _canonical(here):
        return [f"{prefix}: {json.dumps(stored)} in the snapshot, {json.dumps(here)} on this worker"]
    return []


def _canonical(x):
    return json.dumps(x, sort_keys=True)
