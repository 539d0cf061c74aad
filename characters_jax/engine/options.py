"""The engine's options (``config.EngineConfig``, the config's ``[engine]`` table) as they
resolve for a config on this backend.

``resolve_engine(cfg)`` turns 'auto' into what runs here and checks that what is asked for
by name can run, with a ConfigError that names the option and what is missing (at
construction, before any parameter is initialised). The command line sets the table's keys
with ``--set engine.KEY=VALUE`` (``config.loader``).
"""

from __future__ import annotations

import dataclasses

import jax

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import KERNELS, Config, ConfigError
from pallas_kernels import device, fp8_gemm_stacked, fp8_qkv_prepare, fp8_row_quantize
from pallas_kernels.fp8_attention import PALLAS_IMPLS
from pallas_kernels.fp8_attention import resolve_impl as resolve_attention

# Attention impls that take Q as the fused qkv kernel makes it (fp8_attention.QuantizedQ).
QKV_PREP_ATTENTION = PALLAS_IMPLS


@dataclasses.dataclass(frozen=True)
class ResolvedEngine:
    """What the engine runs: attention, the impl ``fp8_attention.attention`` runs
    ('pallas' | 'cudnn' | 'xla' | 'reference'); reduce, the block's reduction method
    ('auto': ``row_parallel`` picks per call); gemm, quant, qkv: whether each kernel of
    ``EngineConfig.kernels`` runs."""

    attention: str
    reduce: str
    gemm: bool
    quant: bool
    qkv: bool

    @property
    def kernels(self) -> str:
        """The kernels on, as ``EngineConfig.kernels`` names them ('none' if none)."""
        return "+".join(k for k in KERNELS if getattr(self, k)) or "none"


def resolve_engine(cfg: Config) -> ResolvedEngine:
    """``cfg.engine`` resolved for ``cfg`` on this backend (module docstring)."""
    e, m = cfg.engine, cfg.model
    layout = kvc.CacheLayout.from_config(cfg)
    attention = _resolve_attention(e.attention, layout)
    if e.reduce == "pallas" and m.weight_dtype != "fp8":
        raise ConfigError(f"engine.reduce='pallas' runs the fused FP8 GEMM + all-reduce: needs "
                          f"model.weight_dtype='fp8', got {m.weight_dtype!r}")
    named = e.kernel_set()
    fp8 = m.weight_dtype == "fp8"
    needs = {
        # kernel: [(met, what it needs)], every condition for it to apply and run here
        "gemm": [(fp8, "model.weight_dtype='fp8'")],
        "quant": [(fp8 and m.activation_scale == "row",
                   "model.weight_dtype='fp8' and model.activation_scale='row'"),
                  (fp8_row_quantize.is_supported(), "an NVIDIA GPU of compute capability 8.9+")],
        "qkv": [(layout.mode == "ring" and layout.quantized, "the ring FP8 cache"),
                (attention in QKV_PREP_ATTENTION, f"attention {QKV_PREP_ATTENTION}"),
                (fp8_qkv_prepare.is_supported(), "an NVIDIA GPU of compute capability 8.9+")],
    }
    on = {}
    for kernel, conditions in needs.items():
        missing = [what for ok, what in conditions if not ok]
        if named is None:  # auto: where it applies and runs (the GEMM's kernel: on Hopper)
            on[kernel] = not missing and (kernel != "gemm" or fp8_gemm_stacked.is_supported())
        elif kernel in named:
            if missing:
                raise ConfigError(f"engine.kernels {kernel!r} needs " + ", ".join(missing))
            on[kernel] = True
        else:
            on[kernel] = False
    return ResolvedEngine(attention=attention, reduce=e.reduce, **on)


def _resolve_attention(attention: str, layout: kvc.CacheLayout) -> str:
    """The impl for the cache's K/V; a Pallas impl asked for by name must be able to run
    (FP8 K/V, head_dim 128, an NVIDIA Hopper GPU): ConfigError naming what is missing."""
    kv_dtype = kvc.FP8 if layout.quantized else layout.storage_dtype
    impl = resolve_attention(attention, kv_dtype, layout.head_dim)
    if attention not in PALLAS_IMPLS:
        return impl
    missing = [what for what, ok in (
        (f"an FP8 cache (cache.dtype is {layout.dtype!r})", layout.quantized),
        (f"head_dim 128 (model.head_dim is {layout.head_dim})", layout.head_dim == 128),
        (f"an NVIDIA Hopper GPU (backend is {jax.default_backend()})", device.is_hopper()))
        if not ok]
    if missing:
        raise ConfigError(f"engine.attention {attention!r} needs " + ", ".join(missing)
                          + "; use 'auto', 'reference', 'cudnn' or 'xla'")
    return impl
