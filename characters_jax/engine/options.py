"""The engine's options, how each resolves on this backend, and the checks that name what
an option asked for by name is missing (a ConfigError at construction, before any init)."""

from __future__ import annotations

import dataclasses

import jax

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import ConfigError
from pallas_kernels import device, fp8_gemm_stacked, fp8_qkv_prepare, fp8_row_quantize
from pallas_kernels.fp8_attention import PALLAS_IMPLS
from pallas_kernels.fp8_attention import resolve_impl as resolve_attention


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """attention: impl passed to `pallas_kernels.fp8_attention.attention`;
    reduce: the block's reduction ('psum' | 'ppermute' | 'pallas' | 'auto');
    gemm: 'auto' (= 'stacked' for FP8 weights where the stacked Pallas GEMM runs, an NVIDIA
    Hopper GPU; 'xla' elsewhere) | 'xla' (blocks' weights sliced per layer by the scan) |
    'stacked' (projection weights read in place from the layer stack:
    `scan_blocks(in_place=True)`; attention-out and MLP-down as one stream-K GEMM where
    both run the kernel);
    input_quant: how the GEMMs' inputs are quantized for FP8 weights with per-row
    activation scales (model.activation_scale = 'row'): 'pallas' (each by one kernel of
    `pallas_kernels.fp8_row_quantize`: the block input's norm + modulation, the MLP hidden's
    GELU, the attention output, each with its rows' maxima and e4m3 in the same pass;
    NVIDIA GPUs of compute capability 8.9+) | 'xla' (XLA's fusions) | 'auto' (pallas where
    it applies and runs, else xla);
    qkv_prep: how a step turns the qkv projection's output into the attention's operands:
    'pallas' (one kernel, `pallas_kernels.fp8_qkv_prepare`: QK-norm, RoPE, Q's e4m3 parts
    and K/V written into the FP8 ring cache; needs the ring FP8 cache and the Pallas
    attention, on a GPU with the kernel) | 'xla' (the model's code) | 'auto' (pallas where
    it applies and runs). Prefill always takes the model's code (it fixes the cache's
    scales from the data first)."""

    attention: str = "auto"
    reduce: str = "auto"
    gemm: str = "auto"
    input_quant: str = "auto"
    qkv_prep: str = "auto"

    def __post_init__(self):
        if self.gemm not in GEMM_MODES:
            raise ValueError(f"gemm must be one of {GEMM_MODES}, got {self.gemm!r}")
        if self.input_quant not in INPUT_QUANT_MODES:
            raise ValueError(f"input_quant must be one of {INPUT_QUANT_MODES}, got {self.input_quant!r}")
        if self.qkv_prep not in QKV_PREP_MODES:
            raise ValueError(f"qkv_prep must be one of {QKV_PREP_MODES}, got {self.qkv_prep!r}")


GEMM_MODES = ("auto", "xla", "stacked")
INPUT_QUANT_MODES = ("auto", "xla", "pallas")
QKV_PREP_MODES = ("auto", "xla", "pallas")
# Attention impls that take Q as the fused qkv kernel makes it (fp8_attention.QuantizedQ).
QKV_PREP_ATTENTION = PALLAS_IMPLS


def resolve_input_quant(input_quant: str, model) -> str:
    """The concrete mode ('pallas' or 'xla') for a ModelConfig: the kernels
    apply to FP8 weights with per-row activation scales; asked for by name where they
    cannot run: ConfigError."""
    applies = model.weight_dtype == "fp8" and model.activation_scale == "row"
    if input_quant == "xla":
        return "xla"
    if input_quant == "pallas":
        if not applies:
            raise ConfigError(f"input_quant={input_quant!r} quantizes per row for FP8 weights: "
                              "needs model.weight_dtype='fp8' and model.activation_scale='row'")
        if not fp8_row_quantize.is_supported():
            raise ConfigError(f"input_quant={input_quant!r} needs an NVIDIA GPU of compute "
                              "capability 8.9+")
        return input_quant
    return "pallas" if applies and fp8_row_quantize.is_supported() else "xla"


def resolve_qkv_prep(qkv_prep: str, layout: kvc.CacheLayout, options) -> str:
    """'pallas' or 'xla' (``EngineOptions.qkv_prep``); 'pallas' asked for where it cannot
    run: ConfigError naming what is missing."""
    if qkv_prep == "xla":
        return "xla"
    attention_impl = resolve_attention(options.attention, kvc.FP8, layout.head_dim)
    missing = [why for ok, why in (
        (layout.mode == "ring" and layout.quantized, "the ring FP8 cache"),
        (attention_impl in QKV_PREP_ATTENTION, f"attention {QKV_PREP_ATTENTION}"),
        (fp8_qkv_prepare.is_supported(), "an NVIDIA GPU of compute capability 8.9+"),
    ) if not ok]
    if not missing:
        return "pallas"
    if qkv_prep == "pallas":
        raise ConfigError("qkv_prep='pallas' needs " + ", ".join(missing))
    return "xla"


def check_attention(attention: str, layout: kvc.CacheLayout) -> None:
    """A Pallas attention impl asked for by name must be able to run: FP8 K/V, head_dim 128,
    an NVIDIA Hopper GPU. Raises ConfigError naming what is missing ('auto' never does),
    or for an unknown name."""
    try:
        resolve_attention(attention, kvc.FP8, layout.head_dim)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if attention not in PALLAS_IMPLS:
        return
    missing = [what for what, ok in (
        (f"an FP8 cache (cache.dtype is {layout.dtype!r})", layout.quantized),
        (f"head_dim 128 (model.head_dim is {layout.head_dim})", layout.head_dim == 128),
        (f"an NVIDIA Hopper GPU (backend is {jax.default_backend()})", device.is_hopper()))
        if not ok]
    if missing:
        raise ConfigError(f"attention {attention!r} needs " + ", ".join(missing)
                          + "; use attention 'auto', 'reference', 'cudnn' or 'xla'")


def resolve_gemm(gemm: str, weight_dtype: str) -> str:
    """'auto' -> 'stacked' for FP8 weights on a GPU where the stacked kernel runs, else 'xla'."""
    if gemm != "auto":
        return gemm
    return "stacked" if weight_dtype == "fp8" and fp8_gemm_stacked.is_supported() else "xla"
