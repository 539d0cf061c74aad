"""Device placement of a worker: which GPUs the generator and its decoder process use, and
how much of each GPU's memory each may take, decided before any device is touched.

The reference system's layout: the tensor-parallel group on `tp` GPUs and the decoder on a
GPU of its own, so that it decodes chunk n while chunk n + 1 is denoised. With no spare GPU
the decoder shares the generator's first GPU. Both processes then get explicit memory
budgets (JAX's default is 75% of a GPU for every process, so two processes on one GPU
fight over it): the decoder its estimated need, the generator the rest.

The plan is made from `nvidia-smi` and the config's abstract shapes (no JAX backend is
initialised), so a plan that cannot fit is refused in a second with a message that says
what fits, not after minutes of initialisation as an out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess

from characters_jax.config import Config, ConfigError

GIB = 1 << 30
# Per process, outside the allocator's pool: the CUDA context, cuBLAS/cuDNN handles, and
# the compiler's autotuning scratch.
PROCESS_RESERVE_BYTES = 3 * GIB
# The generator's working memory beyond its parameters and cache (activations of one
# pass, attention partials, kernel workspaces): measured 0.1-12 GiB of temporaries for
# characters-57b at tp=1 depending on the path; the launch baseline is the largest.
GENERATOR_WORKSPACE_BYTES = 14 * GIB
# The decoder's estimate: parameters, per-session temporal state, and this many of its
# largest activation (input history + output of the widest conv at its resolution).
DECODER_LIVE_ACTIVATIONS = 6
# The decoder's pool beyond that estimate: convolution autotuning and workspaces.
DECODER_SCRATCH_BYTES = 2 * GIB


class PlacementError(ConfigError):
    """The requested placement cannot work on this machine; the message says what fits."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One visible GPU: `device` is what CUDA_VISIBLE_DEVICES takes (its UUID)."""

    index: int
    device: str
    name: str
    total_bytes: int
    used_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes


def visible_gpus() -> list[Gpu]:
    """The NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES honoured, by index or
    UUID), from `nvidia-smi`; [] when there is none or JAX is told to use the CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu",):
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,name,memory.total,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index, uuid, name, total, used = parts
        gpus.append(Gpu(int(index), uuid, name, int(float(total)) << 20, int(float(used)) << 20))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    chosen = []
    for item in (v.strip() for v in visible.split(",") if v.strip()):
        match = [g for g in gpus if item == str(g.index) or g.device.startswith(item)]
        if not match:
            break  # CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen


@dataclasses.dataclass(frozen=True)
class GeneratorNeed:
    """Per-GPU bytes of the generator at a tensor-parallel size."""

    params: int
    cache: int
    workspace: int

    @property
    def total(self) -> int:
        return self.params + self.cache + self.workspace


def _per_device_bytes(abstract_tree, specs, tp: int) -> int:
    import jax
    from jax.sharding import PartitionSpec as P

    leaves = jax.tree.leaves(abstract_tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if len(leaves) != len(spec_leaves):
        raise ValueError("abstract tree and partition specs do not match")
    total = 0
    for leaf, spec in zip(leaves, spec_leaves):
        shards = math.prod(tp for axis in spec if axis is not None)
        total += math.prod(leaf.shape) * leaf.dtype.itemsize // shards
    return total


def generator_need(cfg: Config, tp: int) -> GeneratorNeed:
    """Parameters and KV cache per GPU from the abstract shapes (no device touched), plus
    the working memory of a step."""
    import jax
    from flax import nnx

    from characters_jax.cache import kv_cache as kvc
    from characters_jax.engine.state import empty_state, state_partition_spec
    from characters_jax.model.params import param_partition_specs
    from characters_jax.model.dit import DiT
    from characters_jax.parallel.sharding import TP, ShardingRules

    abstract = nnx.state(nnx.eval_shape(lambda: DiT(cfg.model, rngs=nnx.Rngs(0))))
    params = _per_device_bytes(abstract, param_partition_specs(abstract, ShardingRules()), tp)
    layout = kvc.CacheLayout.from_config(cfg)
    state = jax.eval_shape(lambda: empty_state(layout))
    cache = _per_device_bytes(state, state_partition_spec(TP), tp)
    scale = (params + cache) / (60 * GIB)  # the workspace figure is characters-57b's at tp=1
    return GeneratorNeed(params, cache, int(GENERATOR_WORKSPACE_BYTES * min(1.0, max(scale, 0.01))))


def decoder_need(cfg: Config) -> int:
    """Bytes the decoder process needs: VAE parameters, the session's temporal state and its
    largest activations (estimated from the stage shapes)."""
    import jax
    import numpy as np
    from flax import nnx

    from characters_jax.decoder.vae import ImageEncoder, VideoDecoder

    def nbytes(tree):
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    dec_def, dec = nnx.split(nnx.eval_shape(lambda: VideoDecoder(cfg, rngs=nnx.Rngs(0))))
    enc = nnx.state(nnx.eval_shape(lambda: ImageEncoder(cfg, rngs=nnx.Rngs(0))))
    v, d = cfg.video, cfg.decoder
    latent = jax.ShapeDtypeStruct((1, v.grid_h, v.grid_w, cfg.model.latent_channels), np.float32)
    state = jax.eval_shape(lambda p, z: nnx.merge(dec_def, p)(z, None)[1], dec, latent)
    itemsize = 2 if d.dtype == "bfloat16" else 4
    largest = 0
    n = len(d.channels)
    for i, c in enumerate(d.channels):
        frames = min(v.frames_per_step, 2 ** i) + 2  # its time resolution + the causal history
        h, w = v.grid_h * 2 ** i, v.grid_w * 2 ** i
        width = c * (4 * 2 if i < n - 1 else 1)  # the upsampler's conv widens 4-8x before the shuffle
        largest = max(largest, frames * h * w * width * itemsize)
    return nbytes(dec) + nbytes(enc) + nbytes(state) + DECODER_LIVE_ACTIVATIONS * largest


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the worker's two processes run. On CPU: host devices, no budgets."""

    platform: str  # 'gpu' | 'cpu'
    tp: int
    generator_devices: tuple[str, ...] = ()
    decoder_device: str | None = None  # a GPU's UUID, or None: the CPU
    generator_fraction: float | None = None
    decoder_fraction: float | None = None
    summary: str = ""

    @property
    def decoder_shares_gpu(self) -> bool:
        return self.decoder_device is not None and self.decoder_device in self.generator_devices

    def generator_env(self) -> dict[str, str]:
        """Environment the generator process must have before JAX starts its backend (on
        CPU: at least `tp` host devices)."""
        if self.platform == "cpu":
            flags = os.environ.get("XLA_FLAGS", "")
            found = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
            if found and int(found.group(1)) >= self.tp or not found and self.tp == 1:
                return {}
            return {"XLA_FLAGS": host_device_flags(flags, self.tp)}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.generator_devices), **_budget_env(self.generator_fraction)}

    def decoder_env(self) -> dict[str, str]:
        if self.platform == "cpu":
            return {}
        if self.decoder_device is None:
            return {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        return {"CUDA_VISIBLE_DEVICES": self.decoder_device, **_budget_env(self.decoder_fraction)}


def _budget_env(fraction: float | None) -> dict[str, str]:
    """The GPU backend's pool (preallocated once, at start-up) and no fallback to the CPU:
    a GPU process whose CUDA backend cannot start fails instead of serving from the host."""
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS") or "cuda"}
    if fraction is None:
        return env
    # One spelling only: the CUDA plugin rejects both set at once (and then falls back to
    # the CPU). The newer name where the user already uses it, else the one jax 0.11 reads.
    name = "XLA_CLIENT_MEM_FRACTION" if "XLA_CLIENT_MEM_FRACTION" in os.environ else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    return {**env, name: f"{fraction:.3f}", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _tp_sizes(cfg: Config, limit: int) -> list[int]:
    m = cfg.model
    return [t for t in range(1, limit + 1) if m.num_heads % t == 0 and m.mlp_dim % t == 0]


def _pick_decoder(gpus: list[Gpu], tp: int, decoder_device: str | None) -> Gpu | None:
    if decoder_device is None:
        return gpus[tp] if len(gpus) > tp else gpus[0]
    if decoder_device == "cpu":
        return None
    if decoder_device.isdigit() and int(decoder_device) < len(gpus):
        return gpus[int(decoder_device)]
    match = [g for g in gpus if g.device.startswith(decoder_device)]
    if not match:
        raise PlacementError(f"--decoder-device {decoder_device}: not a visible GPU (visible: 0..{len(gpus) - 1}, a UUID, or 'cpu')")
    return match[0]


def plan(cfg: Config, tp: int, gpus: list[Gpu], *, decoder_device: str | None = None,
         decoder_memory_bytes: int | None = None, generator_memory_fraction: float | None = None) -> Placement:
    """The placement for `cfg` at tensor-parallel size `tp` on `gpus` (visible_gpus()).

    decoder_device: None (a GPU of its own if one is spare, else the generator's first),
    'cpu', or a GPU by visible index or UUID. Raises PlacementError with what fits.
    """
    cfg.validate_tp(tp)
    if generator_memory_fraction is not None and not 0 < generator_memory_fraction <= 1:
        raise PlacementError(f"--memory-fraction: must be in (0, 1], got {generator_memory_fraction}")
    if decoder_memory_bytes is not None and decoder_memory_bytes <= 0:
        raise PlacementError(f"--decoder-memory-gib: must be positive, got {decoder_memory_bytes / GIB:g}")
    if not gpus:
        if decoder_device not in (None, "cpu"):
            raise PlacementError(f"--decoder-device {decoder_device}: no GPU is visible (CPU only)")
        return Placement("cpu", tp, summary=f"CPU: generator on {tp} host device(s), decoder on its own host device")
    if tp > len(gpus):
        raise PlacementError(
            f"--tp {tp} needs {tp} GPUs; {len(gpus)} visible ({gpus[0].name}). "
            f"Tensor-parallel sizes that this machine has GPUs for: {', '.join(map(str, _tp_sizes(cfg, len(gpus))))}")
    gen, dec = gpus[:tp], _pick_decoder(gpus, tp, decoder_device)
    need = generator_need(cfg, tp)
    if dec is None:
        dec_bytes = 0
    else:
        dec_bytes = int(decoder_memory_bytes) if decoder_memory_bytes is not None else decoder_need(cfg)
    # What the decoder process takes from a GPU: its pool, plus its context outside it.
    dec_footprint = dec_bytes + DECODER_SCRATCH_BYTES + PROCESS_RESERVE_BYTES

    def available(g: Gpu) -> int:
        shared = dec is not None and dec.device == g.device
        left = g.free_bytes - PROCESS_RESERVE_BYTES - (dec_footprint if shared else 0)
        if generator_memory_fraction is not None:
            left = min(left, int(generator_memory_fraction * g.total_bytes))
        return left

    if dec is not None and dec not in gen and dec_footprint > dec.free_bytes:
        raise PlacementError(f"the decoder needs ~{_gib(dec_footprint)} on GPU {gpus.index(dec)}, which has {_gib(dec.free_bytes)} free")
    short = [g for g in gen if need.total > available(g)]
    if short:
        g = short[0]
        room = g.total_bytes - 2 * PROCESS_RESERVE_BYTES - dec_footprint
        fitting = [t for t in _tp_sizes(cfg, len(gpus)) if generator_need(cfg, t).total <= room]
        if fitting:
            hint = f"tensor-parallel sizes that fit this machine: {', '.join(map(str, fitting))}"
        else:
            larger = [t for t in _tp_sizes(cfg, cfg.model.num_heads) if t > len(gpus) and generator_need(cfg, t).total <= room]
            hint = (f"it needs at least {larger[0]} such GPUs (tp={larger[0]}: ~{_gib(generator_need(cfg, larger[0]).total)} per GPU)"
                    if larger else "it fits no number of such GPUs")
        where = " (shared with the decoder)" if dec is not None and dec.device == g.device else ""
        raise PlacementError(
            f"config {cfg.name} at --tp {tp} needs ~{_gib(need.total)} per GPU (parameters {_gib(need.params)}, "
            f"KV cache {_gib(need.cache)}, working memory {_gib(need.workspace)}); GPU {gpus.index(g)} "
            f"({g.name}, {_gib(g.total_bytes)}, {_gib(g.used_bytes)} in use) has {_gib(max(available(g), 0))} "
            f"for it{where}; {hint}")
    # The generator takes what the decoder and the per-process reserves leave.
    generator_fraction = generator_memory_fraction or min(available(g) for g in gen) / gen[0].total_bytes
    decoder_fraction = None if dec is None else min(0.95, (dec_bytes + DECODER_SCRATCH_BYTES) / dec.total_bytes)
    dec_where = ("the CPU" if dec is None else
                 f"GPU {gpus.index(dec)}" + (" (shared with the generator)" if dec in gen else " (its own)")
                 + f", budget ~{_gib(dec_bytes + DECODER_SCRATCH_BYTES)}")
    summary = (f"generator on GPU {', '.join(str(gpus.index(g)) for g in gen)} (tp={tp}; needs ~{_gib(need.total)} per GPU: "
               f"parameters {_gib(need.params)}, KV cache {_gib(need.cache)}; budget {generator_fraction:.1%} of "
               f"{_gib(gen[0].total_bytes)}), decoder on {dec_where}")
    return Placement("gpu", tp, tuple(g.device for g in gen), None if dec is None else dec.device,
                     round(generator_fraction, 3), None if decoder_fraction is None else round(decoder_fraction, 3), summary)


def apply_to_this_process(env: dict[str, str]) -> None:
    """Sets the generator's environment in this process; JAX must not have started a
    backend yet (its device set and memory pool are fixed when it does)."""
    from jax._src import xla_bridge

    if env and xla_bridge.backends_are_initialized():
        raise RuntimeError("JAX's backend is already initialised: the placement cannot apply")
    os.environ.update(env)


def host_device_flags(flags: str, count: int) -> str:
    """XLA_FLAGS with the host platform's device count set to `count`."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags).strip()
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()
