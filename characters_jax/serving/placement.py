"""Device placement of a worker: which devices the generator and its decoder process use,
and how much of each device's memory each may take, decided before any device is touched.

The reference system's layout: the tensor-parallel group on `tp` GPUs and the decoder on a
GPU of its own, so that it decodes chunk n while chunk n + 1 is denoised. With no spare GPU
the decoder shares the generator's first GPU. Both processes then get explicit memory
pools (JAX's default is 75% of a GPU for every process, so two processes on one GPU
fight over it): the decoder its estimated need, the generator all the rest.

Two checks. Before any JAX backend starts (`plan`, from `nvidia-smi` or the host's memory
and the config's abstract shapes): parameters + KV cache, the decoder's share and the
per-process reserves against what the devices have free; a plan that cannot fit is refused
in seconds with a message that says what fits. After the generator's programs are compiled
from abstract shapes and before any weight is placed (`check_measured`): the same with the
working memory measured by XLA's memory analysis of those programs, against the pool the
generator was given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import shutil
import subprocess

from characters_jax.config import CONFIG_DIR, Config, ConfigError, load_config
from characters_jax.processes import host_device_flags

GIB = 1 << 30
# A GPU process's memory outside its allocator pool: the CUDA context, loaded kernel
# images, cuBLAS / cuDNN handles.
PROCESS_RESERVE_BYTES = 2 * GIB
# Inside the generator's pool, beyond what its compiled programs' analysis counts: session
# inputs, the audio front end's programs, the allocator's rounding.
POOL_RESERVE_BYTES = GIB // 2
# A CPU process's runtime beside its arrays (interpreter, jaxlib, compiled code).
HOST_PROCESS_RESERVE_BYTES = GIB
# The decoder's estimate: parameters, per-session temporal state, and this many of its
# largest activation (input history + output of the widest conv at its resolution).
DECODER_LIVE_ACTIVATIONS = 6
# The decoder's pool beyond that estimate: convolution autotuning and workspaces.
DECODER_SCRATCH_BYTES = 2 * GIB
FRACTION_NAMES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")


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


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """The host's memory: `available` is what a new process may take (MemAvailable, or the
    cgroup's limit less its usage where that is lower)."""

    available: int
    total: int


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


def _read_int(path: str) -> int | None:
    try:
        text = pathlib.Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory() -> HostMemory:
    """The host's available and total memory: /proc/meminfo (os.sysconf where it is
    missing), lowered to the cgroup's limit less its usage when one is set."""
    info = {}
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                info[key] = int(value.split()[0]) << 10
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = info.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and limit < total:
            total = limit
            available = min(available, limit - (usage or 0))
    return HostMemory(max(available, 0), total)


@dataclasses.dataclass(frozen=True)
class GeneratorNeed:
    """Per-device bytes of the generator at a tensor-parallel size: parameters and KV cache
    (the step state) from the abstract shapes; working memory (`measured`: from the compiled
    programs' memory analysis, plus POOL_RESERVE_BYTES) or 0 before they are compiled."""

    params: int
    cache: int
    working: int = 0
    measured: bool = False

    @property
    def total(self) -> int:
        return self.params + self.cache + self.working

    def describe(self) -> str:
        work = f", working memory {_gib(self.working)} (measured)" if self.measured else ""
        return f"parameters {_gib(self.params)}, KV cache {_gib(self.cache)}{work}"


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


@dataclasses.dataclass(frozen=True)
class GeneratorShapes:
    """The generator's abstract parameters and step state with their partition specs (no
    device touched): `need(tp)` at any tensor-parallel size."""

    params: object
    param_specs: object
    state: object
    state_specs: object

    @classmethod
    def of(cls, cfg: Config) -> "GeneratorShapes":
        import jax
        from flax import nnx

        from characters_jax.cache import kv_cache as kvc
        from characters_jax.engine.state import empty_state, state_partition_spec
        from characters_jax.model.dit import DiT
        from characters_jax.model.params import param_partition_specs
        from characters_jax.parallel.sharding import TP, ShardingRules

        abstract = nnx.state(nnx.eval_shape(lambda: DiT(cfg.model, rngs=nnx.Rngs(0))))
        state = jax.eval_shape(lambda: empty_state(kvc.CacheLayout.from_config(cfg)))
        return cls(abstract, param_partition_specs(abstract, ShardingRules()), state, state_partition_spec(TP))

    def need(self, tp: int, working: int = 0, measured: bool = False) -> GeneratorNeed:
        return GeneratorNeed(_per_device_bytes(self.params, self.param_specs, tp),
                             _per_device_bytes(self.state, self.state_specs, tp), working, measured)


def generator_need(cfg: Config, tp: int) -> GeneratorNeed:
    """Parameters and KV cache per device at `tp`, from the abstract shapes."""
    return GeneratorShapes.of(cfg).need(tp)


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
    """Where the worker's two processes run, and the memory each was planned.

    need: the generator's per-device need (parameters and KV cache at planning time);
    decoder_bytes: what the decoder process takes from its device (its pool and its process
    reserve on a GPU; its estimate on the CPU), 0 without a decoder; device_bytes: one
    generator device's memory (a GPU's total; on CPU the host's available memory);
    gpu_count: the GPUs visible when planned; decoder_on: 'none' (no decoder on this
    machine), 'cpu', 'gpu' (a GPU of its own) or 'shared' (the generator's first GPU)."""

    platform: str  # 'gpu' | 'cpu'
    tp: int
    generator_devices: tuple[str, ...] = ()
    decoder_device: str | None = None  # a GPU's UUID, or None: the CPU
    generator_fraction: float | None = None
    decoder_fraction: float | None = None
    summary: str = ""
    need: GeneratorNeed | None = None
    decoder_bytes: int = 0
    device_bytes: int = 0
    gpu_count: int = 0
    decoder_on: str = "none"

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

    def pool_env(self) -> dict[str, str]:
        """The generator's GPU pool fraction for a process that sizes only its pool (the
        benchmarks): what the environment does not already set; {} on CPU."""
        if self.platform == "cpu" or any(name in os.environ for name in FRACTION_NAMES):
            return {}
        return {FRACTION_NAMES[0]: f"{self.generator_fraction:.3f}"}


def _budget_env(fraction: float | None) -> dict[str, str]:
    """The GPU backend's pool (preallocated once, at start-up) and no fallback to the CPU:
    a GPU process whose CUDA backend cannot start fails instead of serving from the host."""
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS") or "cuda"}
    if fraction is None:
        return env
    # One spelling only: the CUDA plugin rejects both set at once (and then falls back to
    # the CPU). The newer name where the user already uses it, else the one jax 0.11 reads.
    name = FRACTION_NAMES[1] if FRACTION_NAMES[1] in os.environ else FRACTION_NAMES[0]
    return {**env, name: f"{fraction:.3f}", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) < GIB else f"{n / GIB:.1f} GiB"


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
        raise PlacementError(f"serve.decoder_device {decoder_device}: not a visible GPU (visible: 0..{len(gpus) - 1}, a UUID, or 'cpu')")
    return match[0]


def _gpu_fit_hint(cfg: Config, shapes: GeneratorShapes, room: int, gpu_count: int, working: int) -> str:
    """Which tensor-parallel sizes fit `gpu_count` GPUs with `room` bytes each for the
    generator (working memory taken as measured at the requested size)."""
    fits = lambda t: shapes.need(t).total + working <= room  # noqa: E731
    fitting = [t for t in _tp_sizes(cfg, gpu_count) if fits(t)]
    if fitting:
        return f"tensor-parallel sizes that fit this machine: {', '.join(map(str, fitting))}"
    larger = [t for t in _tp_sizes(cfg, cfg.model.num_heads) if t > gpu_count and fits(t)]
    if larger:
        return (f"it needs at least {larger[0]} such GPUs (tp={larger[0]}: ~{_gib(shapes.need(larger[0]).total + working)} "
                f"per GPU)")
    return "it fits no number of such GPUs"


def _host_fit_hint(cfg: Config, available: int, with_decoder: bool) -> str:
    """The configs of configs/ that fit this host at tp = 1, and what `cfg` needs on GPUs."""
    fitting = []
    for path in sorted(CONFIG_DIR.glob("*.toml")):
        other = cfg if path.stem == cfg.name else load_config(path.stem)
        if _host_need(other, 1, GeneratorShapes.of(other), with_decoder)[0] <= available:
            fitting.append(other.name)
    where = f"configs that fit this host: {', '.join(fitting)}" if fitting else "no config fits this host"
    one = GeneratorShapes.of(cfg).need(1).total
    return f"{where}; {cfg.name} on GPUs needs ~{_gib(one)} per GPU at tp=1 (parameters + KV cache), less at larger tp"


def _host_need(cfg: Config, tp: int, shapes: GeneratorShapes, with_decoder: bool) -> tuple[int, GeneratorNeed, int]:
    """(host bytes in all, the generator's per-device need, the decoder's bytes) on CPU:
    `tp` host devices share the host's memory, each with its shard and the replicated
    parts."""
    need = shapes.need(tp)
    decoder = decoder_need(cfg) if with_decoder else 0
    total = tp * need.total + decoder + (2 if with_decoder else 1) * HOST_PROCESS_RESERVE_BYTES
    return total, need, decoder


def _cpu_plan(cfg: Config, tp: int, decoder_device: str | None, with_decoder: bool, host: HostMemory | None) -> Placement:
    if decoder_device not in (None, "cpu"):
        raise PlacementError(f"serve.decoder_device {decoder_device}: no GPU is visible (CPU only)")
    host = host or host_memory()
    shapes = GeneratorShapes.of(cfg)
    total, need, decoder = _host_need(cfg, tp, shapes, with_decoder)
    if total > host.available:
        raise PlacementError(
            f"config {cfg.name} at --tp {tp} on the CPU needs ~{_gib(total)} of host memory ({tp} host device(s), each "
            f"{need.describe()}" + (f"; decoder ~{_gib(decoder)}" if with_decoder else "")
            + f"); this host has {_gib(host.available)} available of {_gib(host.total)}; "
            + _host_fit_hint(cfg, host.available, with_decoder))
    summary = (f"CPU: generator on {tp} host device(s) (needs ~{_gib(tp * need.total)}: {need.describe()} each)"
               + (f", decoder on its own host device (~{_gib(decoder)})" if with_decoder else "")
               + f"; host memory {_gib(host.available)} available")
    return Placement("cpu", tp, summary=summary, need=need, decoder_bytes=decoder, device_bytes=host.available,
                     decoder_on="cpu" if with_decoder else "none")


def plan(cfg: Config, tp: int, gpus: list[Gpu], *, decoder_device: str | None = None,
         decoder_memory_bytes: int | None = None, generator_memory_fraction: float | None = None,
         with_decoder: bool = True, host: HostMemory | None = None) -> Placement:
    """The placement for `cfg` at tensor-parallel size `tp` on `gpus` (visible_gpus()), or on
    the CPU when there is none (`host`: the host's memory, default host_memory()).

    decoder_device: None (a GPU of its own if one is spare, else the generator's first),
    'cpu', or a GPU by visible index or UUID; with_decoder=False: no decoder process on this
    machine (the benchmarks). Raises PlacementError with what fits.
    """
    cfg.validate_tp(tp)
    if generator_memory_fraction is not None and not 0 < generator_memory_fraction <= 1:
        raise PlacementError(f"serve.memory_fraction: must be in (0, 1], got {generator_memory_fraction}")
    if decoder_memory_bytes is not None and decoder_memory_bytes <= 0:
        raise PlacementError(f"serve.decoder_memory_gib: must be positive, got {decoder_memory_bytes / GIB:g}")
    if not gpus:
        return _cpu_plan(cfg, tp, decoder_device, with_decoder, host)
    if tp > len(gpus):
        raise PlacementError(
            f"--tp {tp} needs {tp} GPUs; {len(gpus)} visible ({gpus[0].name}). "
            f"Tensor-parallel sizes that this machine has GPUs for: {', '.join(map(str, _tp_sizes(cfg, len(gpus))))}")
    gen = gpus[:tp]
    dec = _pick_decoder(gpus, tp, decoder_device) if with_decoder else None
    shapes = GeneratorShapes.of(cfg)
    need = shapes.need(tp)
    if dec is None:
        dec_bytes = 0
    else:
        dec_bytes = int(decoder_memory_bytes) if decoder_memory_bytes is not None else decoder_need(cfg)
    # What the decoder process takes from a GPU: its pool, plus its context outside it.
    dec_footprint = 0 if dec is None else dec_bytes + DECODER_SCRATCH_BYTES + PROCESS_RESERVE_BYTES

    def pool(g: Gpu) -> int:
        shared = dec is not None and dec.device == g.device
        left = g.free_bytes - PROCESS_RESERVE_BYTES - (dec_footprint if shared else 0)
        if generator_memory_fraction is not None:
            left = min(left, int(generator_memory_fraction * g.total_bytes))
        return left

    if dec is not None and dec not in gen and dec_footprint > dec.free_bytes:
        raise PlacementError(f"the decoder needs ~{_gib(dec_footprint)} on GPU {gpus.index(dec)}, which has {_gib(dec.free_bytes)} free")
    short = [g for g in gen if need.total + POOL_RESERVE_BYTES > pool(g)]
    if short:
        g = short[0]
        room = g.total_bytes - PROCESS_RESERVE_BYTES - dec_footprint
        where = " (shared with the decoder)" if dec is not None and dec.device == g.device else ""
        raise PlacementError(
            f"config {cfg.name} at --tp {tp} needs more than ~{_gib(need.total + POOL_RESERVE_BYTES)} per GPU "
            f"({need.describe()}, before its working memory); GPU {gpus.index(g)} ({g.name}, {_gib(g.total_bytes)}, "
            f"{_gib(g.used_bytes)} in use) has {_gib(max(pool(g), 0))} for it{where}; "
            + _gpu_fit_hint(cfg, shapes, room, len(gpus), POOL_RESERVE_BYTES))
    # The generator takes what the decoder and the per-process reserves leave.
    generator_fraction = generator_memory_fraction or min(pool(g) for g in gen) / gen[0].total_bytes
    decoder_fraction = None if dec is None else min(0.95, (dec_bytes + DECODER_SCRATCH_BYTES) / dec.total_bytes)
    dec_where = ("none on this machine" if not with_decoder else "the CPU" if dec is None else
                 f"GPU {gpus.index(dec)}" + (" (shared with the generator)" if dec in gen else " (its own)")
                 + f", pool ~{_gib(dec_bytes + DECODER_SCRATCH_BYTES)} + {_gib(PROCESS_RESERVE_BYTES)} outside it")
    summary = (f"generator on GPU {', '.join(str(gpus.index(g)) for g in gen)} (tp={tp}; per GPU {need.describe()}; "
               f"pool {generator_fraction:.1%} of {_gib(gen[0].total_bytes)}), decoder on {dec_where}")
    return Placement("gpu", tp, tuple(g.device for g in gen), None if dec is None else dec.device,
                     round(generator_fraction, 3), None if decoder_fraction is None else round(decoder_fraction, 3), summary,
                     need=need, decoder_bytes=dec_footprint, device_bytes=gen[0].total_bytes, gpu_count=len(gpus),
                     decoder_on="none" if not with_decoder else "cpu" if dec is None else "shared" if dec in gen else "gpu")


def pool_bytes(devices) -> int | None:
    """The smallest allocator pool (bytes_limit) of `devices`; None where the backend does
    not report one (the CPU)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    return None if not limits or None in limits else int(min(limits))


def check_measured(cfg: Config, placement: Placement, params: int, cache: int, working: int, pool: int | None) -> GeneratorNeed:
    """The generator's need with its measured working memory (the compiled programs' memory
    analysis; POOL_RESERVE_BYTES added here), checked against its pool (`pool_bytes` of its
    devices; None on CPU: the host's available memory now). Raises PlacementError with what
    would fit; returns the need."""
    need = GeneratorNeed(params, cache, working + POOL_RESERVE_BYTES, measured=True)
    if placement.platform == "cpu":
        host = host_memory()
        total = placement.tp * need.total
        if total > host.available:
            raise PlacementError(
                f"config {cfg.name} at --tp {placement.tp} on the CPU needs ~{_gib(total)} of host memory ({need.describe()} "
                f"per host device); this host has {_gib(host.available)} available; "
                + _host_fit_hint(cfg, host.available, False))
        return need
    if pool is not None and need.total > pool:
        shared = placement.decoder_bytes if placement.decoder_shares_gpu else 0
        raise PlacementError(
            f"config {cfg.name} at --tp {placement.tp} needs ~{_gib(need.total)} per GPU ({need.describe()}); its pool "
            f"is {_gib(pool)}" + (f" beside the decoder's {_gib(shared)}" if shared else "")
            + "; with pools like it, " + _gpu_fit_hint(cfg, GeneratorShapes.of(cfg), pool, placement.gpu_count, need.working))
    return need


def memory_plan_line(placement: Placement, need: GeneratorNeed, pool: int | None) -> str:
    """One line: per device, parameters, KV cache, measured working memory, the pool and
    what is left in it, and the decoder's share of the device."""
    where = "per host device" if placement.platform == "cpu" else "per GPU"
    line = f"{where}: {need.describe()}, in all ~{_gib(need.total)}"
    if pool is not None:
        line += f"; pool {_gib(pool)} ({_gib(pool - need.total)} to spare)"
    if placement.platform == "gpu":
        line += f"; outside the pool {_gib(PROCESS_RESERVE_BYTES)}; GPU {_gib(placement.device_bytes)}"
    if placement.decoder_on == "none":
        return line + "; no decoder on this machine"
    if placement.decoder_on == "cpu" and placement.platform == "gpu":
        return line + "; the decoder on the CPU"
    where = {"cpu": "the host", "gpu": "a GPU of its own", "shared": "the generator's first GPU"}[placement.decoder_on]
    return line + f"; the decoder's share ~{_gib(placement.decoder_bytes)} on {where}"


def size_generator_pool(cfg: Config, tp: int) -> Placement:
    """For a process that runs the generator alone (no decoder beside it: `bench`, the
    benchmarks): plans `cfg` at `tp` on the visible GPUs (or the host) and sets this
    process's GPU pool fraction from the plan, unless the environment already sets one.
    Call it before JAX starts its backend. Raises PlacementError when the config cannot fit."""
    placement = plan(cfg, tp, visible_gpus(), with_decoder=False)
    apply_to_this_process(placement.pool_env())
    return placement


def apply_to_this_process(env: dict[str, str]) -> None:
    """Sets the generator's environment in this process; JAX must not have started a
    backend yet (its device set and memory pool are fixed when it does)."""
    from jax._src import xla_bridge

    if env and xla_bridge.backends_are_initialized():
        raise RuntimeError("JAX's backend is already initialised: the placement cannot apply")
    os.environ.update(env)
