"""The variants, the reference path, their engines and weights, and the reference runs' plan.

A variant differs from the reference path in its arithmetic only: the same inputs, noise
seeds and weights. The float weights are the reference's; the FP8-GEMM variants quantize
those same weights (`fp8_params`), so a variant differs from the reference only in
arithmetic. The reference path: launch cache in bf16 (or float32), reference attention,
plain GEMMs (the config's FP8 weight storage replaced by the activation dtype), XLA psum.
`reference_plan` lists the reference runs: the base run and runs under perturbations a
deployment has anyway (a one-ulp nudge, another tp size, a repeat, other noise seeds).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.config import Config
from characters_jax.gate.options import PERTURBATIONS


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a run differs from the reference path: its cache (cache_dtype None: the
    reference's), FP8 block weights and their activations' scales (None: the config's),
    and its [engine] table (``config.EngineConfig``'s fields). from_config: the cache and
    the [engine] table are the config's as given (with the command line's overrides):
    the model as it serves."""

    name: str
    cache_mode: str = "launch"
    cache_dtype: str | None = None
    attention: str = "reference"
    reduce: str = "psum"
    kernels: str = "none"
    fp8_weights: bool = False
    activation_scale: str | None = None  # FP8 activations per 'tensor' | 'row'; None: the config's
    from_config: bool = False
    description: str = ""

    @property
    def engine(self) -> dict[str, str]:
        return {"attention": self.attention, "reduce": self.reduce, "kernels": self.kernels}


REFERENCE = Variant("reference", description="launch cache, reference attention, plain GEMMs, psum")

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("ring-bf16", cache_mode="ring", cache_dtype="bf16", description="ring cache, bf16, RoPE at write"),
        Variant("ring-fp8", cache_mode="ring", cache_dtype="fp8", description="ring cache, FP8 e4m3, scales on device"),
        Variant("fp8-attention", cache_mode="ring", cache_dtype="fp8", attention="pallas", description="ring FP8 cache + the Pallas FP8 attention kernel (P's e4m3 codes from float bits, the lazy rescale)"),
        Variant("qkv-kernel", cache_mode="ring", cache_dtype="fp8", attention="pallas", kernels="qkv", description="as fp8-attention, QK-norm, RoPE, Q's e4m3 parts and the K/V cache write by one kernel"),
        Variant("fp8-gemm", fp8_weights=True, description="block GEMMs in FP8 (the same weights, quantized)"),
        Variant("fp8-gemm-row", fp8_weights=True, activation_scale="row", description="block GEMMs in FP8, activations quantized with one scale per row (token)"),
        Variant("stacked-gemm", fp8_weights=True, kernels="gemm", description="FP8 GEMMs reading the layer stack in place (the stacked Pallas GEMM on Hopper, its reference elsewhere)"),
        Variant("stacked-gemm-row", fp8_weights=True, kernels="gemm", activation_scale="row", description="as stacked-gemm, activations quantized with one scale per row (token)"),
        Variant("quant-kernels", fp8_weights=True, kernels="gemm+quant", activation_scale="row", description="as stacked-gemm-row, each GEMM input's norm / GELU and per-row quantization by one kernel"),
        Variant("fused-reduce", fp8_weights=True, reduce="pallas", description="FP8 GEMMs + fused Pallas GEMM/all-reduce"),
        Variant("ppermute", reduce="ppermute", description="ppermute ring reduction overlapping the GEMM"),
        Variant("production", fp8_weights=True, from_config=True, description="as it serves: FP8 GEMMs, the config's cache and [engine] table (auto: every kernel that runs here)"),
    )
}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A variant as it runs on this backend: `variant` None means skipped; `note` says why/what changed."""

    name: str
    variant: Variant | None
    note: str = ""


def resolve(variant: Variant, tp: int) -> Resolved:
    """The variant as it runs on this backend: None where its own arithmetic cannot run here
    (the Pallas kernels off Hopper), with the reason; a note where it changes nothing."""
    from pallas_kernels import device, fp8_attention, fp8_gemm_allreduce

    if variant.attention in fp8_attention.PALLAS_IMPLS and not device.is_hopper():
        return Resolved(variant.name, None, f"Pallas FP8 attention needs a Hopper GPU ({jax.default_backend()} here)")
    if variant.reduce == "pallas" and not fp8_gemm_allreduce.is_supported():
        return Resolved(variant.name, None, f"fused GEMM + all-reduce needs a Hopper GPU ({jax.default_backend()} here)")
    if variant.reduce in ("ppermute", "pallas") and tp == 1:
        return Resolved(variant.name, variant, "tp=1: no reduction to change")
    return Resolved(variant.name, variant)


def parse_variant(name: str) -> tuple[Variant, int | None]:
    """'ring-fp8' -> (the variant, None); 'production@tp2' -> (production, 2)."""
    base, _, tp = name.partition("@")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}; known: {', '.join(VARIANTS)} (optionally @tpN)")
    if tp and not (tp.startswith("tp") and tp[2:].isdigit() and int(tp[2:]) > 0):
        raise ValueError(f"variant {name!r}: the suffix must be @tpN (N a tensor-parallel size)")
    return VARIANTS[base], (int(tp[2:]) if tp else None)


def act_dtype(cfg: Config):
    return jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32


def nudge_ulp(x: np.ndarray, dtype, seed: int) -> np.ndarray:
    """Moves every element of x (exactly representable in `dtype`) one ulp of `dtype` up or
    down in magnitude, with a random sign per element; zeros stay. Returns float32."""
    rs = np.random.RandomState(seed)
    bits_t = {2: np.int16, 4: np.int32}[jnp.dtype(dtype).itemsize]
    y = np.asarray(x).astype(dtype)
    bits = y.view(bits_t)
    step = rs.choice(np.array([-1, 1], bits_t), size=bits.shape)
    nonzero = (bits & np.array(np.iinfo(bits_t).max, bits_t)) != 0
    out = np.where(nonzero, bits + step, bits).astype(bits_t).view(jnp.dtype(dtype))
    return out.astype(np.float32)


def nudge_noise_ulp(x: jax.Array, key) -> jax.Array:
    """Moves each nonzero float32 element one ulp up or down in magnitude (random sign)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    step = jnp.where(jax.random.bernoulli(key, 0.5, x.shape), 1, -1).astype(jnp.int32)
    return jnp.where(x != 0, jax.lax.bitcast_convert_type(bits + step, jnp.float32), x)


def noise_ulp_nudge(seed: int):
    """The engine's noise transform (``Engine(noise_transform=...)``) that moves every step's
    noise by one float32 ulp, a fresh random sign per element and step from ``seed``."""
    def transform(x, step):
        return nudge_noise_ulp(x, jax.random.fold_in(jax.random.key(seed), step))
    return transform


def reference_config(cfg: Config, cache_dtype: str) -> Config:
    """The reference path's config: launch cache in `cache_dtype`, plain GEMMs, the
    reference's [engine] table."""
    wd = cfg.model.weight_dtype
    if wd == "fp8":
        wd = cfg.model.dtype
    return cfg.replace(model={"weight_dtype": wd}, cache={"mode": "launch", "dtype": cache_dtype},
                       engine=REFERENCE.engine)


def variant_config(ref_cfg: Config, v: Variant, base_cfg: Config | None = None) -> Config:
    """The variant's config from the reference's; base_cfg: the config as given (cache and
    [engine] table of a ``from_config`` variant; default ref_cfg's)."""
    model = {"weight_dtype": "fp8"} if v.fp8_weights else {}
    if v.activation_scale:
        model["activation_scale"] = v.activation_scale
    if v.from_config:
        base = base_cfg or ref_cfg
        cache, engine = dataclasses.asdict(base.cache), dataclasses.asdict(base.engine)
    else:
        cache = {"mode": v.cache_mode, "dtype": v.cache_dtype or ref_cfg.cache.dtype}
        engine = v.engine
    return ref_cfg.replace(model=model, cache=cache, engine=engine)


def make_engine(cfg: Config, tp: int, noise_ulp_seed: int | None = None):
    """The engine of ``cfg`` (its [engine] table); noise_ulp_seed: every step's noise
    nudged by one ulp (``noise_ulp_nudge``), a run-to-run perturbation of the reference."""
    from characters_jax.engine.step import Engine
    from characters_jax.parallel.sharding import make_mesh

    nudge = None if noise_ulp_seed is None else noise_ulp_nudge(noise_ulp_seed)
    return Engine(cfg, make_mesh(tp), noise_transform=nudge)


def _block_weight_key(key: str) -> bool:
    return key.startswith("['blocks']") and key.endswith("['w'].value")


def fp8_grid_quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [L, N, K] float -> (e4m3 values [L, N, K], scale [L] float32), one scale per layer:
    the power of two at or above amax / 448, so values * scale is exact in bf16 and f32."""
    from characters_jax.parallel.fp8_linear import FP8_DTYPE, FP8_MAX

    wf = w.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(wf), axis=(1, 2)), 1e-30)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / FP8_MAX)))
    values = jnp.clip(wf / scale[:, None, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, scale


def snap_to_fp8_grid(params):
    """The block projection weights [L, N, K] rounded to what `fp8_params` stores
    (e4m3 values times a power-of-two per-layer scale), in their own dtype; everything
    else unchanged. A reference drawn this way and its FP8 variants run the same model,
    so their difference is the FP8 arithmetic (activations quantized, FP8 GEMMs), not
    the weight rounding (a property of the checkpoint, the same in every run)."""

    def leaf(path, x):
        if not _block_weight_key(jax.tree_util.keystr(path)):
            return x
        values, scale = fp8_grid_quantize(x)
        return (values.astype(jnp.float32) * scale[:, None, None]).astype(x.dtype)

    return jax.jit(lambda p: jax.tree_util.tree_map_with_path(leaf, p))(params)


def fp8_params(engine, ref_params):
    """The reference's float weights as this FP8 engine stores them (on its mesh).

    Block projections w [L, N, K] -> e4m3 values with a per-tensor (per layer)
    power-of-two scale (`fp8_grid_quantize`; `w_scale` [L]); every other parameter is
    copied. Exact when the reference was snapped with `snap_to_fp8_grid`.
    """
    from characters_jax.parallel.fp8_linear import FP8_DTYPE

    def build(ref):
        flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(ref)[0]}
        quant = fp8_grid_quantize

        def leaf(path, abstract):
            key = jax.tree_util.keystr(path)
            if key.endswith("['w_scale'].value"):
                return quant(flat[key.replace("['w_scale']", "['w']")])[1]
            if _block_weight_key(key) and abstract.dtype == FP8_DTYPE:
                return quant(flat[key])[0]
            return flat[key].astype(abstract.dtype)

        return jax.tree_util.tree_map_with_path(leaf, engine.abstract_params)

    return jax.jit(build, out_shardings=engine.param_shardings)(ref_params)


def place_params(engine, params, ref_engine):
    """`params` (the reference's) for `engine`: resharded, or quantized for FP8 GEMMs."""
    if engine.cfg.model.weight_dtype == "fp8" and ref_engine.cfg.model.weight_dtype != "fp8":
        if engine.mesh.devices.size != ref_engine.mesh.devices.size:  # another tp size: onto this mesh first
            params = jax.device_put(params, engine.replicated)
        return fp8_params(engine, params)
    return jax.device_put(params, engine.param_shardings)


@dataclasses.dataclass(frozen=True)
class RefRun:
    """One reference run: `kind` base | tp | ulp | repeat | seed; tp; ulp_seed (0:
    unperturbed; for kind 'seed': which shift of the noise seeds)."""

    label: str
    kind: str
    tp: int
    ulp_seed: int = 0


def reference_plan(runs: int, tp: int, num_heads: int, devices: int, repeat: bool,
                   kinds: tuple[str, ...] | None = None) -> list[RefRun]:
    """The base run, then perturbed runs cycling over `kinds` (default: one-ulp input
    nudges, other tp sizes (each a different reduction order), and (GPU, `repeat`) an
    identical repeat; 'seed': every noise seed moved, the sampler's own variation, a kind
    only callers that score sampled outputs ask for). Kinds that cannot run (no other tp
    size fits the devices) are passed over."""
    alt_tps = [t for t in (1, 2, 4, 8, 3, 6) if t != tp and t <= devices and num_heads % t == 0]
    plan = [RefRun(f"ref tp={tp}", "base", tp)]
    ulp, seeds, i = 0, 0, 0
    if kinds is None:
        kinds = ["ulp", "tp", "repeat", "ulp", "tp"] if repeat else ["ulp", "tp"]
    else:
        unknown = set(kinds) - set(PERTURBATIONS)
        if unknown or not kinds:
            raise ValueError(f"unknown perturbation(s) {sorted(unknown)}; known: {', '.join(PERTURBATIONS)}")
        repeat = "repeat" in kinds
    while len(plan) < runs:
        kind = kinds[i % len(kinds)]
        i += 1
        if kind == "tp":
            if not alt_tps:
                continue
            t = alt_tps.pop(0)
            plan.append(RefRun(f"ref tp={t}", "tp", t))
        elif kind == "repeat":
            if repeat:
                plan.append(RefRun(f"ref repeat tp={tp}", "repeat", tp))
                repeat = False
        elif kind == "seed":
            seeds += 1
            plan.append(RefRun(f"ref seed#{seeds} tp={tp}", "seed", tp, seeds))
        else:
            ulp += 1
            plan.append(RefRun(f"ref ulp#{ulp} tp={tp}", "ulp", tp, ulp))
        if i > 4 * runs + 10:
            break
    return plan


class Timer:
    """Wall-clock seconds per label (host side)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, label: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[label] = timer.seconds.get(label, 0.0) + time.perf_counter() - self.t0

        return _Ctx()
