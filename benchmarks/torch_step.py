"""The characters-57b step in PyTorch, side by side with the JAX step on the same GPU(s).

A PyTorch build of the same step as ``characters_jax`` (same config, same shapes, same
work), written the way a PyTorch engineer would write it for speed today, and a benchmark
that runs it next to the JAX step (``DiTGenerator`` with its defaults) in one process:

* 60 parallel blocks (characters-57b) x 4 flow-matching Euler passes on the config's
  sigmas, 757 new tokens a pass (748 latent + 9 audio). A block: one modulated RMSNorm
  (adaLN-single: the shared modulation plus the block's offset), the qkv and MLP-up GEMMs
  on it, QK RMSNorm, 3-D RoPE on Q and on K at write time, K/V written into the ring cache
  (``index_copy_`` into the current frame's 757 slots: sink first, then ``ring_frames``
  frames, 5,788 slots for characters-57b), attention over every slot, then the
  attention-out and MLP-down GEMMs summed and reduced by ONE all-reduce (tp > 1), and the
  gated residual.
* FP8: block projections stored (N, K) as e4m3 with a per-tensor dequantization scale,
  run through ``torch._scaled_mm`` (cuBLASLt; CUTLASS for row-wise scales) with fast
  accumulation and dynamic activation scales, per tensor or per row (``--scales``);
  embeddings, the adaLN MLP and the head in bf16.
* Attention: ``F.scaled_dot_product_attention`` on a bf16 cache laid out [L, H, S, D]
  (each layer's K/V a contiguous [1, H, S, D] operand), with the backend that measured
  fastest on the step's own shapes (cuDNN / flash / memory-efficient, picked at capture).
  Once every slot is valid (a full-length prompt and a full ring) the step drops the mask:
  the best case for PyTorch (the JAX step always masks). ``--mask always`` keeps it.
* torch.compile (Inductor) for the elementwise work between the GEMMs (norm +
  modulation + FP8 quantization, QK-norm + RoPE + layout, GELU + quantization, the
  partial sum and the residual); the whole step captured once per mask variant as one
  CUDA graph over static buffers (audio, noise, ring index, frame time in; latent out),
  the cache updated in place, replayed every step.
* Tensor parallel: one process per GPU (torch.distributed, NCCL), Megatron-style: qkv and
  up column-parallel (heads and MLP columns split), out and down row-parallel, one
  ``all_reduce`` per block; the cache holds the rank's heads.
* Positions, ring offsets and the position reset as the JAX engine assigns them: frame
  time starts at 1, slot ``sink + (step % ring_frames) * T``, and when the frame time
  reaches ``ring_frames + reset_period`` every ring key is rotated back by
  ``reset_period`` positions once (outside the graph). Shapes, slots, positions and prompt
  buckets come from the config and the JAX engine's own code (``StepSpec``).

Correctness (``tests/test_torch_step.py``; on a GPU machine ``benchmarks/gpu_tests.sh``
runs it with the kernels' GPU tests): on tiny/small configs the eager path (CPU, no
compile, no graphs, no FP8 GEMM) and the GPU path take the JAX generator's weights
(``weights_from_jax``) and the JAX step's noise (``jax_noise``) and give the JAX latents
within float32 rounding over several steps, a reset included; the FP8 path is checked
against a float32 torch reference on the same weights.

The benchmark (one H200):

    python benchmarks/torch_step.py --config characters-57b --steps 30 [--scales row|tensor|both]
        [--share 4] [--out DIR]

runs the JAX step first (compile, session, warm-up, timed steps), frees every JAX array
and backend, then builds the PyTorch step with random weights made on the GPU (no host
copy) and times it with each activation-scale mode, a torch.profiler breakdown of its
device time (GEMMs, attention, elementwise, cache write, all-reduce, embeddings + head),
and writes ``torch_step_<config>_tp<N>.json`` and ``.md`` under --out. Both steps take
~56 GB of FP8 weights at tp=1; to fit them one after the other on one GPU, this script sets
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX loads (JAX then grows its pool as
needed instead of taking it whole) and clears JAX's backends before torch allocates. The
JAX side's pool limit is planned (``serving.placement.size_generator_pool``: the GPU's free
memory less a reserve; ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set by the caller is left as it
is) and its programs are compiled before its weights exist, so XLA's autotuning has the
whole pool. ``--side jax`` /
``--side torch`` runs one side alone. ``--share N`` cuts the model to one GPU's share of
tp = N (num_heads / N, mlp_dim / N, full residual width, no all-reduce), run at tp = 1.
``--tp N`` runs JAX on N GPUs in this process, then the torch step in N spawned processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import socket
import sys
import time
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from characters_jax.cache.kv_cache import CacheLayout  # noqa: E402
from characters_jax.config import Config, ModelConfig  # noqa: E402
from characters_jax.engine import state as engine_state  # noqa: E402
from characters_jax.engine.step import prompt_bucket  # noqa: E402
from characters_jax.measure.bench import reset_steps  # noqa: E402
from characters_jax.model.rope import rope_frequencies  # noqa: E402
from pallas_kernels.numerics import AMAX_FLOOR, FP8_MAX  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError as _err:  # the CPU CI has no torch: main() says so, the tests skip
    torch = None
    TORCH_IMPORT_ERROR = str(_err)
else:
    TORCH_IMPORT_ERROR = None

TIME_FREQ_DIM = 256
SCALES = ("row", "tensor")
# Profiler scopes of the step, one per component (flat: none nests in another).
COMPONENTS = ("gemm", "attention", "elementwise", "cache_write", "all_reduce", "embed_head", "step_begin")


# ==========================================================================================
# Shapes
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the torch step takes from a ``Config``, for one rank of tensor-parallel size tp.
    Nothing is derived here: the model's shapes are ``cfg.model``; the rank's heads and MLP
    columns ``shard`` (``Config.share_of_tp``); the cache's slots ``layout``
    (``CacheLayout``, as the JAX engine lays its cache out); positions and prompt buckets
    the JAX engine's own (``engine.state``, ``engine.step.prompt_bucket``)."""

    cfg: Config
    tp: int = 1
    rank: int = 0

    @classmethod
    def from_config(cls, cfg: Config, tp: int = 1, rank: int = 0) -> "StepSpec":
        cfg.validate_tp(tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not in [0, {tp})")
        return cls(cfg, tp, rank)

    def replace(self, **kw) -> "StepSpec":
        return dataclasses.replace(self, **kw)

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @functools.cached_property
    def shard(self) -> ModelConfig:
        """The rank's share of the model: num_heads and mlp_dim divided by tp."""
        return self.cfg.share_of_tp(self.tp).model

    @functools.cached_property
    def layout(self) -> CacheLayout:
        return CacheLayout.from_config(self.cfg)

    @property
    def act_dtype(self):
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.model.dtype]

    @functools.cached_property
    def frame_positions(self) -> np.ndarray:
        """[T, 3] int64: a step's new tokens' positions at frame time 0 (a step adds its
        frame time on axis 0)."""
        v = self.cfg.video
        return _engine_array(engine_state.frame_positions, 0, v.grid_h, v.grid_w,
                             self.model.audio_tokens_per_step)

    def sink_positions(self, bucket: int) -> np.ndarray:
        """[T_img + bucket, 3] int64: the sink's positions for a prompt padded to ``bucket``."""
        v = self.cfg.video
        return _engine_array(engine_state.sink_positions, v.grid_h, v.grid_w, bucket)


def _engine_array(fn, *args) -> np.ndarray:
    """fn(*args), a function of the JAX engine, evaluated on JAX's CPU device, as int64."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(fn(*args)).astype(np.int64)


# ==========================================================================================
# The model's arithmetic (as characters_jax.model: float32 inside, rounded to the activation dtype)
# ==========================================================================================


def rms_norm(x, eps: float):
    """RMSNorm without gain over the last axis, in float32, returned in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype)


def modulated_norm(x, shift, scale, eps: float):
    """rms_norm(x) * (1 + scale) + shift in float32, in x.dtype. x [T, d]; shift, scale [d] f32."""
    return (rms_norm(x, eps).float() * (1.0 + scale) + shift).to(x.dtype)


def gelu_tanh(x):
    """GELU, tanh approximation, in x's dtype: x * 0.5 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
    return x * (0.5 * (1.0 + torch.tanh(inner)))


def rotate(x, cos, sin):
    """RoPE rotation of pairs (i, i + D/2) of x [..., D] by angles whose cos/sin [..., D/2]
    broadcast against x[..., :D/2]; float32 inside, returns x.dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def rope_angles(positions, freqs):
    """(cos, sin) [T, 1, D/2] float32 of positions [T, 3] float32 against freqs [3, D/2]:
    each pair's angle is its one axis' position times its frequency (a sum of exact products
    with zeros, so no rounding beyond the product)."""
    angles = (positions[:, :, None] * freqs[None]).sum(1)
    return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]


def timestep_features(sigma: float, dim: int = TIME_FREQ_DIM):
    """Sinusoidal features of a noise level: [dim] float32 (cos then sin of 1000 sigma f)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    t = torch.tensor(sigma, dtype=torch.float32) * 1000.0
    return torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)])


CUBLASLT_FP8_ALIGN = 16  # cuBLASLt's FP8 GEMMs: every dimension a multiple of 16


def quantize_fp8(x, per_row: bool):
    """Dynamic e4m3 quantization: x [M, K] -> (x8 [M, K] float8_e4m3fn, scale float32 [M, 1]
    per row or [] per tensor), scale = max(amax, 1e-12) / 448, saturating."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_row else xf.abs().amax()
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(x8, x_scale, w8, w_scale, out_dtype, emulate: bool, fast_accum: bool = True):
    """x8 [M, K] e4m3 (scale [] or [M, 1]) times w8 [N, K] e4m3 (scale [] or [1, N]) -> [M, N].

    CUDA: one ``torch._scaled_mm`` (the weight consumed as stored: w8.t() is column-major);
    fast_accum: Hopper's FP8 accumulation without the periodic promotion to float32 (what
    torchao's Float8Linear runs in the forward: the faster cuBLASLt/CUTLASS kernels).
    emulate (CPU): the same product from the e4m3 values in float32, scaled afterwards.
    Per-tensor scales run on cuBLASLt, which takes FP8 operands only with every dimension a
    multiple of 16: M (757 tokens a pass, 1,246 in a prefill) is padded with zero rows, and
    the product's extra rows dropped (row-wise scales run on CUTLASS, which takes any M)."""
    if emulate:
        return ((x8.float() @ w8.float().t()) * x_scale * w_scale).to(out_dtype)
    m = x8.shape[0]
    pad = (-m) % CUBLASLT_FP8_ALIGN if x_scale.numel() == 1 else 0
    if pad:  # e4m3's zero byte is 0.0; torch pads float8 tensors only as bytes
        x8 = torch.nn.functional.pad(x8.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    elif x_scale.numel() == 1 and (x8.data_ptr() % 16 or not x8.is_contiguous()):
        x8 = x8.contiguous().clone()  # cuBLASLt's FP8 operands: 16-byte aligned, row-major
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    return y[:m] if pad else y


# ==========================================================================================
# Weights
# ==========================================================================================

BLOCK_PROJECTIONS = ("qkv", "out", "up", "down")


@dataclasses.dataclass(frozen=True)
class Weights:
    """The model's weights for one rank, every projection stored (N, K).

    Small layers (activation dtype): patch_embed [d, C], audio_embed [d, F_a], prompt_embed
    [V, d], time_in [d, 256], time_out [d, d], adaln [3d, d], final_mod [2d, d], proj_out [C, d].
    Blocks, stacked over L: qkv [L, 3 H_l D, d] (rows head-major: head, (q, k, v), D),
    out [L, d, H_l D], up [L, F_l, d], down [L, d, F_l] (float8_e4m3fn or a float dtype);
    scales [L, 4] float32 (per-tensor dequantization scales of qkv, out, up, down; ones for
    float weights); q_norm, k_norm [L, D] float32; modulation [L, 3, d] float32 (shift,
    scale, gate offsets of adaLN-single)."""

    patch_embed: object
    audio_embed: object
    prompt_embed: object
    time_in: object
    time_out: object
    adaln: object
    final_mod: object
    proj_out: object
    qkv: object
    out: object
    up: object
    down: object
    scales: object
    q_norm: object
    k_norm: object
    modulation: object

    def block(self, name: str):
        return getattr(self, name)

    @property
    def fp8(self) -> bool:
        return self.qkv.dtype == torch.float8_e4m3fn

    def to(self, device) -> "Weights":
        return Weights(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def dequantized(self, dtype=None) -> "Weights":
        """Float copies (float32 unless dtype): block projections = values x scale, scales one."""
        dtype = dtype or torch.float32
        kw = {f.name: getattr(self, f.name).to(dtype) if getattr(self, f.name).is_floating_point()
              else getattr(self, f.name) for f in dataclasses.fields(self)}
        for i, name in enumerate(BLOCK_PROJECTIONS):
            w = getattr(self, name)
            kw[name] = (w.float() * self.scales[:, i, None, None].float()).to(dtype)
        kw["scales"] = torch.ones_like(self.scales)
        for name in ("q_norm", "k_norm", "modulation"):
            kw[name] = getattr(self, name).float()
        return Weights(**kw)


def _projection_shapes(spec: StepSpec) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the rank's block projections."""
    s = spec.shard
    d, hd = s.d_model, s.num_heads * s.head_dim
    return {"qkv": (3 * hd, d), "out": (d, hd), "up": (s.mlp_dim, d), "down": (d, s.mlp_dim)}


def _projection_stds(spec: StepSpec) -> dict[str, float]:
    """The init std of each projection (``characters_jax.model.dit.Block``), global widths."""
    m = spec.model
    d, hd, f = m.d_model, m.num_heads * m.head_dim, m.mlp_dim
    depth = 1.0 / math.sqrt(2 * m.num_blocks)
    return {"qkv": d ** -0.5, "out": hd ** -0.5 * depth, "up": d ** -0.5, "down": f ** -0.5 * depth}


def random_weights(spec: StepSpec, device, seed: int = 0) -> Weights:
    """Random weights of the rank's shard, made where they live (on the GPU: no host copy).
    FP8: unit-normal values cast to e4m3, one layer at a time (a bf16 temporary of one
    layer), the std as the per-tensor scale (the JAX init's distribution)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1009 + spec.rank)
    act, m = spec.act_dtype, spec.model
    d, c = m.d_model, m.latent_channels

    def normal(shape, std, dtype):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    small = {
        "patch_embed": normal((d, c), c ** -0.5, act),
        "audio_embed": normal((d, m.audio_feature_dim), m.audio_feature_dim ** -0.5, act),
        "prompt_embed": normal((m.prompt_vocab, d), 1.0, act),
        "time_in": normal((d, TIME_FREQ_DIM), TIME_FREQ_DIM ** -0.5, act),
        "time_out": normal((d, d), d ** -0.5, act),
        "adaln": normal((3 * d, d), 0.02 * d ** -0.5, act),
        "final_mod": normal((2 * d, d), 0.02 * d ** -0.5, act),
        "proj_out": normal((c, d), d ** -0.5, act),
    }
    L = m.num_blocks
    stds = _projection_stds(spec)
    blocks = {}
    scales = torch.ones((L, 4), dtype=torch.float32, device=device)
    for i, (name, (n, k)) in enumerate(_projection_shapes(spec).items()):
        if m.weight_dtype == "fp8":
            w = torch.empty((L, n, k), dtype=torch.float8_e4m3fn, device=device)
            for layer in range(L):
                w[layer] = torch.randn((n, k), generator=gen, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            scales[:, i] = stds[name]
        else:
            wd = {"float32": torch.float32, "bfloat16": torch.bfloat16}[m.weight_dtype]
            w = torch.empty((L, n, k), dtype=wd, device=device)
            for layer in range(L):
                w[layer] = normal((n, k), stds[name], wd)
        blocks[name] = w
    modulation = normal((L, 3, d), 0.1, torch.float32)
    modulation[:, 2] += 1.0
    ones = torch.ones((L, m.head_dim), dtype=torch.float32, device=device)
    return Weights(**small, **blocks, scales=scales, q_norm=ones, k_norm=ones.clone(), modulation=modulation)


def _torch_of_numpy(a: np.ndarray):
    """A host array (float8 / bfloat16 from ml_dtypes included) as a torch tensor."""
    name = str(a.dtype)
    if name == "bfloat16":
        return torch.from_numpy(np.array(a).view(np.uint16)).view(torch.bfloat16)
    if name == "float8_e4m3fn":
        return torch.from_numpy(np.array(a).view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.array(a))


def weights_from_jax(params, device="cpu") -> Weights:
    """The full (tp = 1) weights of a JAX generator's ``params`` (an nnx.State of the DiT),
    copied through the host (small configs: the correctness check). Names follow the model's
    modules: <layer>/w (and blocks/<proj>/w_scale for FP8 weights)."""
    from flax import nnx

    flat = {}
    for path, var in nnx.to_flat_state(params):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        flat["/".join(str(p) for p in path)] = _torch_of_numpy(np.asarray(value))
    small = {name: flat[f"{name}/w"] for name in ("patch_embed", "audio_embed", "time_in", "time_out",
                                                    "adaln", "final_mod", "proj_out")}
    blocks = {name: flat[f"blocks/{name}/w"] for name in BLOCK_PROJECTIONS}
    L = blocks["qkv"].shape[0]
    scales = torch.ones((L, 4), dtype=torch.float32)
    for i, name in enumerate(BLOCK_PROJECTIONS):
        if f"blocks/{name}/w_scale" in flat:
            scales[:, i] = flat[f"blocks/{name}/w_scale"].float().reshape(L)
    w = Weights(**small, **blocks, prompt_embed=flat["prompt_embed"], scales=scales,
                q_norm=flat["blocks/q_norm"].float(), k_norm=flat["blocks/k_norm"].float(),
                modulation=flat["blocks/modulation"].float())
    return w.to(device)


def shard_weights(full: Weights, spec: StepSpec) -> Weights:
    """The rank's Megatron shard of full (tp = 1) weights: qkv and up rows (heads, MLP
    columns), out and down columns; everything else replicated."""
    if spec.tp == 1:
        return full
    r, hd, f = spec.rank, spec.shard.num_heads * spec.shard.head_dim, spec.shard.mlp_dim
    rows = lambda w, n: w[:, r * n:(r + 1) * n].contiguous()  # noqa: E731
    cols = lambda w, n: w[:, :, r * n:(r + 1) * n].contiguous()  # noqa: E731
    return dataclasses.replace(full, qkv=rows(full.qkv, 3 * hd), up=rows(full.up, f),
                               out=cols(full.out, hd), down=cols(full.down, f))


def check_weights(weights: Weights, spec: StepSpec) -> None:
    """Raises ValueError naming the first weight whose shape does not fit spec's rank."""
    m = spec.model
    d, c, L = m.d_model, m.latent_channels, m.num_blocks
    want = {"patch_embed": (d, c), "audio_embed": (d, m.audio_feature_dim),
            "prompt_embed": (m.prompt_vocab, d), "time_in": (d, TIME_FREQ_DIM), "time_out": (d, d),
            "adaln": (3 * d, d), "final_mod": (2 * d, d), "proj_out": (c, d),
            "scales": (L, 4), "q_norm": (L, m.head_dim), "k_norm": (L, m.head_dim),
            "modulation": (L, 3, d)}
    want.update({name: (L, n, k) for name, (n, k) in _projection_shapes(spec).items()})
    for name, shape in want.items():
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            raise ValueError(f"weight {name}: shape {got}, expected {shape} for rank {spec.rank} of tp={spec.tp}")


# ==========================================================================================
# The elementwise work between the GEMMs (eager, or compiled by Inductor)
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class ElementwiseOps:
    """The block's elementwise functions (``make_ops``). Shapes for T tokens, H_l heads:

      block_input(x [T, d], shared_mod [3, d], modulation [3, d]) -> (h, h_scale): the
        modulated norm, FP8-quantized (e4m3 + scale) or (h in the activation dtype, None);
      qk_prep(qkv [T, 3 H_l D], q_gain [D], k_gain [D], cos, sin [T, 1, D/2]) -> q [H_l, T, D]
        (act dtype), k, v [H_l, T, D] (cache dtype): QK-norm, RoPE on q and k;
      attention_out(o [1, H_l, T, D]) -> (o [T, H_l D], scale) quantized like block_input;
      mlp_hidden(up [T, F_l]) -> (GELU(up), scale) quantized like block_input;
      partial_sum(y1, y2 [T, d]) -> y [T, d] act dtype (the rank's share, summed in f32);
      residual(x, shared_mod, modulation, y) -> x + gate * y (f32 inside, act dtype);
      residual_sum(x, shared_mod, modulation, y1, y2) -> residual of partial_sum(y1, y2)."""

    block_input: Callable
    qk_prep: Callable
    attention_out: Callable
    mlp_hidden: Callable
    partial_sum: Callable
    residual: Callable
    residual_sum: Callable


def make_ops(spec: StepSpec, quant: str | None, cache_dtype, compiler: Callable | None = None) -> ElementwiseOps:
    """The block's elementwise functions for spec's rank; quant: 'row' | 'tensor' (FP8
    activations for the GEMMs) or None (float GEMMs); compiler: e.g. ``torch.compile``
    (applied to each function), or None for eager."""
    if quant is not None and quant not in SCALES:
        raise ValueError(f"activation scales must be one of {SCALES}, got {quant!r}")
    dt, eps, heads, hd = spec.act_dtype, spec.model.norm_eps, spec.shard.num_heads, spec.shard.head_dim
    per_row = quant == "row"

    def gemm_input(h):
        if quant is None:
            return h, None
        return quantize_fp8(h, per_row)

    def block_input(x, shared_mod, modulation):
        mod = shared_mod + modulation
        return gemm_input(modulated_norm(x, mod[0], mod[1], eps))

    def qk_prep(qkv, q_gain, k_gain, cos, sin):
        t = qkv.shape[0]
        qkv = qkv.view(t, heads, 3, hd)
        q = rotate(rms_norm(qkv[:, :, 0], eps) * q_gain.to(dt), cos, sin)
        k = rotate(rms_norm(qkv[:, :, 1], eps) * k_gain.to(dt), cos, sin)
        v = qkv[:, :, 2]
        return (q.transpose(0, 1).contiguous(), k.transpose(0, 1).to(cache_dtype).contiguous(),
                v.transpose(0, 1).to(cache_dtype).contiguous())

    def attention_out(o):
        t = o.shape[2]
        return gemm_input(o[0].transpose(0, 1).reshape(t, heads * hd).to(dt))

    def mlp_hidden(up):
        return gemm_input(gelu_tanh(up.float()).to(dt))

    def partial_sum(y1, y2):
        return (y1.float() + y2.float()).to(dt)

    def residual(x, shared_mod, modulation, y):
        gate = shared_mod[2] + modulation[2]
        return (x.float() + gate * y.float()).to(dt)

    def residual_sum(x, shared_mod, modulation, y1, y2):
        return residual(x, shared_mod, modulation, partial_sum(y1, y2))

    fns = dict(block_input=block_input, qk_prep=qk_prep, attention_out=attention_out, mlp_hidden=mlp_hidden,
               partial_sum=partial_sum, residual=residual, residual_sum=residual_sum)
    if compiler is not None:
        fns = {name: compiler(fn) for name, fn in fns.items()}
    return ElementwiseOps(**fns)


def inductor(fn):
    """torch.compile for one elementwise function: whole graph, static shapes, no
    Inductor CUDA graphs (the step is captured as one graph by TorchStep), and the
    roundings to bf16 between float32 steps kept where the model has them (Inductor's
    emulate_precision_casts; without it a fused kernel keeps such values in float32)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # Every TorchStep's functions share their code objects, one compiled entry per config,
    # quantization and operand layout: more than Dynamo's default 8 in one process of tests.
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))
    options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else None
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


# ==========================================================================================
# Attention backend
# ==========================================================================================

SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def pick_sdpa_backend(q, k, v, mask, choice: str = "auto", calls: int = 10) -> tuple[str, dict]:
    """The SDPA backend for these operands (CUDA): 'auto' times cuDNN, flash and
    memory-efficient attention on them (CUDA events, after a warm-up) and returns the
    fastest that runs; a named one is checked to run. Returns (name, {name: ms or why not})."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = [n for n in ("cudnn", "flash", "efficient")] if choice == "auto" else [choice]
    timings = {}
    for name in names:
        try:
            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])]):
                for _ in range(2):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                end.record()
                end.synchronize()
                timings[name] = start.elapsed_time(end) / calls
        except RuntimeError as err:  # this backend does not take these operands
            timings[name] = f"unavailable: {str(err).splitlines()[0][:160]}"
    ran = {n: t for n, t in timings.items() if isinstance(t, float)}
    if not ran:
        if choice != "auto":
            raise RuntimeError(f"SDPA backend {choice!r} does not run these operands: {timings[choice]}")
        return "math", timings
    return min(ran, key=ran.get), timings


# ==========================================================================================
# The step
# ==========================================================================================


def _scope(name: str):
    return torch.profiler.record_function(name)


class TorchStep:
    """One session of the PyTorch step for one rank: the bf16 (or float32) ring cache
    [L, H_l, S, D] and the step's static buffers, ``start_session`` (the sink prefill, eager)
    and ``step`` (on CUDA with graphs: one CUDA graph replay).

    act_scale: 'row' | 'tensor', how FP8 activations are scaled (FP8 weights only);
    compile: Inductor for the elementwise work (None: on CUDA only; True: on the CPU too);
    graphs: the step as CUDA graphs (CUDA only);
    mask: 'when-needed' (no mask once every slot is valid) | 'always';
    attention: SDPA backend, 'auto' (the fastest, timed at capture) or a name of
    ``SDPA_BACKENDS``; fast_accum: ``torch._scaled_mm``'s use_fast_accum (``fp8_linear``);
    group: the torch.distributed group of the tp ranks (tp > 1)."""

    def __init__(self, spec: StepSpec, weights: Weights, device, *, act_scale: str = "row",
                 compile: bool | None = None, graphs: bool = True, mask: str = "when-needed",
                 attention: str = "auto", fast_accum: bool = True, group=None):
        check_weights(weights, spec)
        if mask not in ("when-needed", "always"):
            raise ValueError(f"mask must be 'when-needed' or 'always', got {mask!r}")
        if attention != "auto" and attention not in SDPA_BACKENDS:
            raise ValueError(f"attention must be 'auto' or one of {tuple(SDPA_BACKENDS)}, got {attention!r}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.spec, self.weights, self.group = spec, weights, group
        self.fp8 = weights.fp8
        if self.fp8 and act_scale not in SCALES:
            raise ValueError(f"act_scale must be one of {SCALES}, got {act_scale!r}")
        if self.fp8 and self.cuda and spec.model.dtype != "bfloat16":
            raise ValueError("FP8 GEMMs through torch._scaled_mm write bf16: the config's model.dtype must be bfloat16")
        self.act_scale = act_scale if self.fp8 else None
        self.mask_mode, self.attention, self.fast_accum = mask, attention, fast_accum
        self.graphs = graphs and self.cuda
        dt = spec.act_dtype
        self.cache_dtype = dt
        m, layout = spec.model, spec.layout
        L, H, S, D, T = m.num_blocks, spec.shard.num_heads, layout.slots, m.head_dim, layout.tokens_per_step
        dev = self.device
        self.k_cache = torch.zeros((L, H, S, D), dtype=dt, device=dev)
        self.v_cache = torch.zeros((L, H, S, D), dtype=dt, device=dev)
        self.valid = torch.zeros((S,), dtype=torch.bool, device=dev)
        # Static inputs and output of the step (the CUDA graphs read and write these).
        self.audio = torch.zeros((m.audio_tokens_per_step, m.audio_feature_dim), dtype=torch.float32, device=dev)
        self.noise = torch.zeros((spec.cfg.video.tokens_per_frame, m.latent_channels), dtype=torch.float32, device=dev)
        self.latent = torch.zeros_like(self.noise)
        self.ring_index = torch.zeros((), dtype=torch.int64, device=dev)
        self.frame_time = torch.zeros((), dtype=torch.int64, device=dev)
        self.frame_slots = layout.sink_slots + torch.arange(T, dtype=torch.int64, device=dev)
        self.base_positions = torch.from_numpy(spec.frame_positions).float().to(dev)
        self.time_axis = torch.tensor([1.0, 0.0, 0.0], device=dev)
        self.freqs = torch.from_numpy(rope_frequencies(D, m.rope_split, m.rope_theta)).to(dev)
        self.pass_features = torch.stack([timestep_features(s) for s in spec.cfg.sampler.sigmas[:-1]]).to(dev)
        self.sink_features = timestep_features(0.0).to(dev)
        # Each block weight's per-tensor scale, per layer: row scales as the [1, N] operand
        # _scaled_mm takes; tensor scales one per 16 bytes ([L, 4], column 0), since cuBLASLt
        # refuses a scale pointer that is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED).
        self.w_scale = {}
        for i, name in enumerate(BLOCK_PROJECTIONS):
            s = weights.scales[:, i].float()
            if self.act_scale == "row":
                n = weights.block(name).shape[1]
                self.w_scale[name] = s[:, None, None].expand(L, 1, n).contiguous()
            else:
                self.w_scale[name] = s[:, None].expand(L, 4).contiguous()[:, 0]
        compiler = inductor if (compile or (compile is None and self.cuda)) else None
        self.compiled = compiler is not None
        self.ops = make_ops(spec, self.act_scale, self.cache_dtype, compiler)
        self.eager_ops = make_ops(spec, self.act_scale, self.cache_dtype) if compiler else self.ops
        self.backend = {}  # masked -> SDPA backend name
        self.backend_timings = {}
        self._graphs = {}
        self._pool = None
        self.gen = torch.Generator(device=dev)
        self.step_index, self.frame_time_host, self.sink_full = 0, 1, False
        self.notes = []

    @property
    def captured(self) -> tuple[str, ...]:
        """The mask variants captured as CUDA graphs so far ('masked', 'unmasked')."""
        return tuple("masked" if m else "unmasked" for m in sorted(self._graphs, reverse=True))

    # ---- session ----------------------------------------------------------------------------
    def start_session(self, image_latent, prompt_tokens, seed: int = 0) -> None:
        """Prefills the sink: image_latent [grid_h, grid_w, C] float32, prompt ids (at most
        cache.max_prompt_tokens, padded to a bucket and masked); seed: the noise seed."""
        cfg, w, dt = self.spec.cfg, self.weights, self.spec.act_dtype
        v, m = cfg.video, cfg.model
        image = torch.as_tensor(np.asarray(image_latent, np.float32))
        if tuple(image.shape) != (v.grid_h, v.grid_w, m.latent_channels):
            raise ValueError(f"image_latent must have shape {(v.grid_h, v.grid_w, m.latent_channels)}, got {tuple(image.shape)}")
        ids = np.asarray(prompt_tokens, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= m.prompt_vocab):
            raise ValueError(f"prompt token ids must be in [0, {m.prompt_vocab})")
        n = ids.size
        b = prompt_bucket(cfg.cache, n)
        padded = torch.from_numpy(np.pad(ids, (0, b - n))).to(self.device)
        img = image.reshape(v.tokens_per_frame, m.latent_channels).to(self.device)
        tokens = torch.cat([F.linear(img.to(dt), w.patch_embed), w.prompt_embed[padded].to(dt)])
        pos = torch.from_numpy(self.spec.sink_positions(b)).float().to(self.device)
        cos, sin = rope_angles(pos, self.freqs)
        slots = torch.arange(v.tokens_per_frame + b, dtype=torch.int64, device=self.device)
        self.valid.zero_()
        self.valid[: v.tokens_per_frame + n] = True
        temb = self._time_embedding(self.sink_features)
        shared = self._shared_modulation(temb)
        mask = self.valid.view(1, 1, 1, -1)
        with self._sdpa(True, pick=False):
            for layer in range(m.num_blocks):
                tokens = self._block(layer, tokens, shared, cos, sin, slots, mask, self.eager_ops)
        self.step_index, self.frame_time_host = 0, 1
        self.sink_full = n == cfg.cache.max_prompt_tokens
        self.gen.manual_seed(seed)

    def masked_now(self) -> bool:
        """Whether this step needs the slot mask: some sink slot is empty (a short prompt)
        or the ring still has frames not written (the first ring_frames - 1 steps)."""
        full = self.sink_full and self.step_index + 1 >= self.spec.layout.ring_frames
        return self.mask_mode == "always" or not full

    def step(self, audio, noise=None):
        """audio [A_tok, F_a] float32 (on the step's device: no host transfer), noise
        [T_img, C] float32 or None (drawn from the session's generator) -> the latent
        [T_img, C] float32: a static buffer, valid until the next step. No host sync."""
        c = self.spec.cfg.cache
        if tuple(audio.shape) != tuple(self.audio.shape):
            raise ValueError(f"audio must have shape {tuple(self.audio.shape)}, got {tuple(audio.shape)}")
        if noise is not None and tuple(noise.shape) != tuple(self.noise.shape):
            raise ValueError(f"noise must have shape {tuple(self.noise.shape)}, got {tuple(noise.shape)}")
        if self.frame_time_host >= c.ring_frames + c.reset_period:
            with _scope("cache_write"):
                self._rotate_ring(-c.reset_period)
            self.frame_time_host -= c.reset_period
        self.audio.copy_(audio)
        if noise is None:
            self.noise.normal_(generator=self.gen)
        else:
            self.noise.copy_(noise)
        self.ring_index.fill_(self.step_index % c.ring_frames)
        self.frame_time.fill_(self.frame_time_host)
        masked = self.masked_now()
        if self.graphs:
            self._graph(masked).replay()
        else:
            with self._sdpa(masked, pick=True):
                self._step_body(masked)
        self.step_index += 1
        self.frame_time_host += 1
        return self.latent

    # ---- the step's body (captured as a CUDA graph) -----------------------------------------
    def _step_body(self, masked: bool) -> None:
        cfg, w, dt = self.spec.cfg, self.weights, self.spec.act_dtype
        sigmas, t_img = cfg.sampler.sigmas, cfg.video.tokens_per_frame
        with _scope("step_begin"):
            slots = self.frame_slots + self.ring_index * self.spec.layout.tokens_per_step
            self.valid.index_fill_(0, slots, True)
            pos = self.base_positions + self.frame_time.float() * self.time_axis
            cos, sin = rope_angles(pos, self.freqs)
        mask = self.valid.view(1, 1, 1, -1) if masked else None
        with _scope("embed_head"):
            audio_tokens = F.linear(self.audio.to(dt), w.audio_embed)
        x = self.noise
        for i in range(cfg.sampler.num_passes):
            with _scope("embed_head"):
                h = torch.cat([F.linear(x.to(dt), w.patch_embed), audio_tokens])
                temb = self._time_embedding(self.pass_features[i])
                shared = self._shared_modulation(temb)
            for layer in range(cfg.model.num_blocks):
                h = self._block(layer, h, shared, cos, sin, slots, mask, self.ops)
            with _scope("embed_head"):
                x = x + (sigmas[i + 1] - sigmas[i]) * self._head(h[:t_img], temb)
        self.latent.copy_(x)

    def _block(self, layer: int, x, shared, cos, sin, slots, mask, ops: ElementwiseOps):
        w = self.weights
        modulation = w.modulation[layer]
        with _scope("elementwise"):
            h, h_scale = ops.block_input(x, shared, modulation)
        with _scope("gemm"):
            qkv = self._linear(h, h_scale, "qkv", layer)
            up = self._linear(h, h_scale, "up", layer)
        with _scope("elementwise"):
            q, k, v = ops.qk_prep(qkv, w.q_norm[layer], w.k_norm[layer], cos, sin)
        with _scope("cache_write"):
            self.k_cache[layer].index_copy_(1, slots, k)
            self.v_cache[layer].index_copy_(1, slots, v)
        with _scope("attention"):
            o = F.scaled_dot_product_attention(q[None], self.k_cache[layer][None], self.v_cache[layer][None], attn_mask=mask)
        with _scope("elementwise"):
            o, o_scale = ops.attention_out(o)
            g, g_scale = ops.mlp_hidden(up)
        with _scope("gemm"):
            y1 = self._linear(o, o_scale, "out", layer)
            y2 = self._linear(g, g_scale, "down", layer)
        if self.spec.tp == 1:
            with _scope("elementwise"):
                return ops.residual_sum(x, shared, modulation, y1, y2)
        with _scope("elementwise"):
            y = ops.partial_sum(y1, y2)
        with _scope("all_reduce"):
            torch.distributed.all_reduce(y, group=self.group)
        with _scope("elementwise"):
            return ops.residual(x, shared, modulation, y)

    def _linear(self, x, x_scale, name: str, layer: int):
        w = self.weights.block(name)[layer]
        if self.fp8:
            return fp8_linear(x, x_scale, w, self.w_scale[name][layer], self.spec.act_dtype, emulate=not self.cuda,
                              fast_accum=self.fast_accum)
        return F.linear(x, w.to(x.dtype))

    def _time_embedding(self, features):
        """[256] f32 -> temb [d] f32: time_out(silu(time_in(features)))."""
        w, dt = self.weights, self.spec.act_dtype
        return F.linear(F.silu(F.linear(features.to(dt), w.time_in)), w.time_out).float()

    def _shared_modulation(self, temb):
        """adaLN-single's shared projection: temb [d] -> [3, d] f32 (shift, scale, gate)."""
        w, dt = self.weights, self.spec.act_dtype
        return F.linear(F.silu(temb).to(dt), w.adaln).float().reshape(3, -1)

    def _head(self, x, temb):
        """Velocity of the image tokens: x [T_img, d], temb [d] -> [T_img, C] f32."""
        w, dt = self.weights, self.spec.act_dtype
        mod = F.linear(F.silu(temb).to(dt), w.final_mod).float().reshape(2, -1)
        return F.linear(modulated_norm(x, mod[0], mod[1], self.spec.model.norm_eps).to(dt), w.proj_out).float()

    def _rotate_ring(self, delta_time: int) -> None:
        """The position reset: every ring key rotated by delta_time positions on the time
        axis, in place, one layer at a time (the sink keeps its positions)."""
        angles = delta_time * self.freqs[0]
        cos, sin = torch.cos(angles), torch.sin(angles)
        ring = slice(self.spec.layout.sink_slots, None)
        for layer in range(self.spec.model.num_blocks):
            keys = self.k_cache[layer, :, ring]
            keys.copy_(rotate(keys, cos, sin))

    # ---- attention backend and CUDA graphs -------------------------------------------------
    def _probe(self, masked: bool):
        """Operands of the step's attention call for timing the SDPA backends."""
        sp = self.spec
        q = torch.zeros((1, sp.shard.num_heads, sp.layout.tokens_per_step, sp.model.head_dim), dtype=sp.act_dtype,
                        device=self.device)
        return q, self.k_cache[0][None], self.v_cache[0][None], (self.valid.view(1, 1, 1, -1) if masked else None)

    def _sdpa(self, masked: bool, pick: bool):
        """The SDPA backend context for the mask variant (CUDA; CPU: the default dispatch).
        Not picked yet: with pick, picked now on the step's operands (``pick_sdpa_backend``),
        else SDPA's own dispatch (the prefill)."""
        import contextlib

        if not self.cuda:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if masked not in self.backend:
            if not pick:
                return contextlib.nullcontext()
            self.backend[masked], self.backend_timings[masked] = pick_sdpa_backend(*self._probe(masked), choice=self.attention)
        return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[self.backend[masked]])])

    def _graph(self, masked: bool):
        """The step's CUDA graph for the mask variant, captured at its first use. Should the
        capture fail with the fastest SDPA backend, it is captured once more with the next
        one (a note says so)."""
        graph = self._graphs.get(masked)
        if graph is not None:
            return graph
        try:
            graph = self._capture(masked)
        except RuntimeError as err:
            timings = self.backend_timings.get(masked, {})
            failed = self.backend.get(masked)
            others = sorted((t, n) for n, t in timings.items() if isinstance(t, float) and n != failed)
            variant = "masked" if masked else "unmasked"
            if not others:
                raise RuntimeError(f"capturing the {variant} step with SDPA backend {failed!r} failed "
                                   f"({err}); --no-graphs runs it eagerly") from err
            self.notes.append(f"{variant} step: the capture with SDPA {failed!r} failed "
                              f"({str(err).splitlines()[0][:160]}); captured with {others[0][1]!r}")
            self.backend[masked] = others[0][1]
            torch.cuda.synchronize(self.device)
            graph = self._capture(masked)
        self._graphs[masked] = graph
        return graph

    def _capture(self, masked: bool):
        """Two eager runs of the body on a side stream (Inductor compiles, cuBLAS/cuDNN plans;
        the body is idempotent: it overwrites the same slots from the same static inputs),
        then one capture into the memory pool the variants share. With tp > 1 the capture
        is thread-local (the NCCL watchdog thread queries events meanwhile)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._sdpa(masked, pick=True):
            for _ in range(2):
                self._step_body(masked)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        mode = "thread_local" if self.spec.tp > 1 else "global"
        with self._sdpa(masked, pick=False), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
            self._step_body(masked)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def profile(self, steps: int = 2) -> dict:
        """Device time per step of each component (``COMPONENTS``), from torch.profiler over
        ``steps`` eager runs of the last step's body (the same kernels the graph replays; the
        body is idempotent). Returns {"components_ms": {...}, "kernel_ms": total, "other_ms"}."""
        from torch.profiler import ProfilerActivity, profile

        masked = self.masked_now()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with self._sdpa(masked, pick=True):
            self._step_body(masked)  # compiled and planned outside the trace
            if self.cuda:
                torch.cuda.synchronize(self.device)
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    self._step_body(masked)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
        return device_time_by_scope(prof.events(), steps, cuda=self.cuda)


def device_time_by_scope(events, steps: int, cuda: bool) -> dict:
    """Per component (``COMPONENTS`` scopes of TorchStep) the device time (CPU time without a
    GPU) of the kernels launched inside it, ms per step; the kernel total and the rest."""
    def device_ms(ev):
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        return us / 1e3

    comps = {c: 0.0 for c in COMPONENTS}
    kernel_ms = 0.0
    for ev in events:
        is_device = str(getattr(ev, "device_type", "")).endswith("CUDA")
        if is_device:  # kernels, copies, memsets; not the GPU-side copies of the scopes
            if not getattr(ev, "is_user_annotation", False) and ev.name not in comps:
                kernel_ms += ev.time_range.elapsed_us() / 1e3
        elif ev.name in comps:
            comps[ev.name] += device_ms(ev) if cuda else ev.time_range.elapsed_us() / 1e3
    if not cuda:
        kernel_ms = sum(comps.values())
    comps = {c: v / steps for c, v in comps.items()}
    total = kernel_ms / steps
    return {"components_ms": comps, "kernel_ms": total, "other_ms": total - sum(comps.values()),
            "note": "device time of the kernels launched in each scope, eager runs of the step's body"}


# ==========================================================================================
# Sessions: inputs, the JAX reference, the torch step
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class SessionInputs:
    """image [grid_h, grid_w, C] float32, prompt ids, audio [steps, A_tok, F_a] float32."""

    image: np.ndarray
    prompt: tuple[int, ...]
    audio: np.ndarray


def session_inputs(cfg, steps: int, seed: int, prompt_len: int | None = None) -> SessionInputs:
    """Random session inputs; prompt_len defaults to cache.max_prompt_tokens (a full sink)."""
    rng = np.random.default_rng(seed)
    n = cfg.cache.max_prompt_tokens if prompt_len is None else prompt_len
    return SessionInputs(
        image=rng.standard_normal((cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)).astype(np.float32),
        prompt=tuple(int(t) for t in rng.integers(0, cfg.model.prompt_vocab, size=n)),
        audio=rng.standard_normal((steps, cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim)).astype(np.float32))


def jax_noise(cfg, seed: int, steps: int) -> np.ndarray:
    """The noise the JAX step draws at steps 0..steps-1 of a session started with ``seed``:
    normal(fold_in(key(seed), step), [T_img, C]) float32 -> [steps, T_img, C]."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(np.uint32(seed % 2**32))
    shape = (cfg.video.tokens_per_frame, cfg.model.latent_channels)
    return np.stack([np.asarray(jax.random.normal(jax.random.fold_in(key, s), shape, jnp.float32)) for s in range(steps)])


def jax_session(cfg, inputs: SessionInputs, seed: int, steps: int):
    """(generator, latents [steps, grid_h, grid_w, C]) of a JAX session on these inputs."""
    import jax.numpy as jnp

    from characters_jax.engine.generator import DiTGenerator

    gen = DiTGenerator(cfg, tp=1, seed=seed)
    gen.start_session(inputs.image, list(inputs.prompt), seed=seed)
    latents = [np.asarray(gen.step(jnp.asarray(inputs.audio[s]))) for s in range(steps)]
    return gen, np.stack(latents)


def torch_session(engine: TorchStep, inputs: SessionInputs, seed: int, steps: int, noise=None) -> np.ndarray:
    """Latents [steps, grid_h, grid_w, C] float32 of a torch session; noise [steps, T_img, C]
    (e.g. ``jax_noise``) or None (the session's generator)."""
    v, m = engine.spec.cfg.video, engine.spec.model
    engine.start_session(inputs.image, inputs.prompt, seed=seed)
    audio = torch.from_numpy(inputs.audio).to(engine.device)
    noise = None if noise is None else torch.from_numpy(np.asarray(noise, np.float32)).to(engine.device)
    out = []
    for s in range(steps):
        lat = engine.step(audio[s], None if noise is None else noise[s])
        out.append(lat.to("cpu", torch.float32, copy=True).numpy().reshape(v.grid_h, v.grid_w, m.latent_channels))
    return np.stack(out)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ==========================================================================================
# Benchmark
# ==========================================================================================


def percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms, np.float64)
    if a.size == 0:
        return {}
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "min": float(a.min()), "max": float(a.max()), "mean": float(a.mean()), "n": int(a.size)}


def run_jax_side(cfg, inputs: SessionInputs, args, log) -> dict:
    """The JAX step (DiTGenerator with its defaults) on this process's GPUs: per-step wall
    time to completion (as ``characters-jax bench``), the first step (compile) apart."""
    import jax
    import jax.numpy as jnp

    from characters_jax.engine.generator import DiTGenerator, compile_programs
    from characters_jax.engine.step import Engine
    from characters_jax.parallel.sharding import make_mesh
    from characters_jax.serving.placement import size_generator_pool

    # The GPU pool from the plan before the backend starts (the environment's fraction, if
    # set, stays), then the step and prefill compiled before the weights exist.
    size_generator_pool(cfg, args.tp)
    t0 = time.perf_counter()
    engine = Engine(cfg, make_mesh(args.tp))
    programs = compile_programs(engine, buckets=(engine.prompt_bucket(len(inputs.prompt)),))
    compile_s = time.perf_counter() - t0
    log(f"[jax] step and prefill compiled in {compile_s:.1f} s")
    t0 = time.perf_counter()
    gen = DiTGenerator(cfg, tp=args.tp, seed=args.seed, programs=programs)
    jax.block_until_ready(gen.params)
    init_s = time.perf_counter() - t0
    log(f"[jax] params on {args.tp} device(s) in {init_s:.1f} s")
    audio = jnp.asarray(inputs.audio[0])
    t0 = time.perf_counter()
    gen.start_session(inputs.image, list(inputs.prompt), seed=args.seed)
    first = gen.step(audio)
    first.block_until_ready()
    first_s = time.perf_counter() - t0
    log(f"[jax] prefill + first step in {first_s:.1f} s")
    total = 1 + args.warmup + args.steps
    resets = reset_steps(total, cfg.cache.ring_frames, cfg.cache.reset_period)
    times, reset_ms = [], []
    latent = first
    for s in range(1, total):
        t0 = time.perf_counter()
        latent = gen.step(audio)
        latent.block_until_ready()
        dt = (time.perf_counter() - t0) * 1e3
        if s > args.warmup:
            (reset_ms if s in resets else times).append(dt)
    finite = bool(np.isfinite(np.asarray(latent)).all())
    out = {"step_ms": percentiles(times), "reset_step_ms": reset_ms, "init_s": init_s, "compile_s": compile_s,
           "prefill_and_first_step_s": first_s, "latent_finite": finite, "jax": jax.__version__,
           "devices": [d.device_kind for d in jax.local_devices()[: args.tp]],
           "timing": "host wall time per step to completion (block_until_ready), as characters-jax bench"}
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
        out["device_memory_gib"] = {k: stats[k] / 2**30 for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}
    except Exception:  # a backend without memory stats
        pass
    if args.jax_profile:
        out["breakdown"] = _jax_profile(gen, audio, args.jax_profile, log)
    del gen, latent, first, audio
    return out


def _jax_profile(gen, audio, logdir: str, log) -> dict:
    """The JAX step's component breakdown (``characters_jax.measure.profile``), optional:
    on any failure, {"error": ...} and the timing stands."""
    try:
        from characters_jax.measure.profile import profile_steps

        exe = gen.programs.step if gen.programs is not None else gen.engine.step.lower(gen.params, gen.state, audio).compile()
        gen.state, breakdown = profile_steps(exe, gen.params, gen.state, audio, steps=2, logdir=logdir)
        log(f"[jax] profiled 2 steps into {logdir}")
        return breakdown
    except Exception as err:
        log(f"[jax] profile failed: {type(err).__name__}: {err}")
        return {"error": f"{type(err).__name__}: {err}"}


def free_jax(log) -> None:
    """Drops JAX's compiled programs and backends so that its GPU memory returns to the
    driver (the arrays must be gone already)."""
    import jax

    gc.collect()
    jax.clear_caches()
    try:
        from jax.extend import backend

        backend.clear_backends()
    except Exception as err:  # an older or newer jax without it: the pool stays with JAX
        log(f"[jax] backends not cleared ({type(err).__name__}: {err}); its memory pool stays allocated")
    gc.collect()


def time_step(engine: TorchStep, audio) -> tuple[float, float]:
    """(device ms, host ms) of one step: CUDA events around it (the graph replay and the
    few small kernels before it), and the host wall time to its completion (as the JAX side
    is timed); without CUDA both are the host time."""
    if not engine.cuda:
        t0 = time.perf_counter()
        engine.step(audio)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    engine.step(audio)
    end.record()
    end.synchronize()
    return start.elapsed_time(end), (time.perf_counter() - t0) * 1e3


def run_torch_side(cfg, inputs: SessionInputs, args, log, rank: int = 0, group=None, on_mode=None) -> dict:
    """The torch step on this rank's device: random weights made there, then per activation
    scale mode a session, warm-up (graph capture, the masked variant while the ring fills),
    timed steps and the profile breakdown. on_mode(result so far) after each mode."""
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    spec = StepSpec.from_config(cfg, tp=args.tp, rank=rank)
    free_gib = None
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        free_gib = free / 2**30
        log(f"[torch] {torch.cuda.get_device_name(device)}: {free_gib:.1f} of {total / 2**30:.1f} GiB free")
    t0 = time.perf_counter()
    weights = random_weights(spec, device, seed=args.seed)
    if cuda:
        torch.cuda.synchronize(device)
    init_s = time.perf_counter() - t0
    log(f"[torch] random weights on {device} in {init_s:.1f} s")
    audio = torch.from_numpy(inputs.audio[0]).to(device)
    if spec.model.weight_dtype == "fp8":
        modes = list(SCALES) if args.scales == "both" else [args.scales]
    else:
        modes = ["float"]  # float block weights: no activation scales
    total = 1 + args.warmup + args.steps
    resets = reset_steps(total, cfg.cache.ring_frames, cfg.cache.reset_period)
    results = {}
    out = {"modes": results, "init_s": init_s, "torch": torch.__version__, "free_gib_at_start": free_gib,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    for mode in modes:
        try:
            results[mode] = _time_mode(mode, spec, weights, device, cuda, args, inputs, audio, total, resets, group, log)
        except Exception as err:  # one mode failing keeps the others' figures
            import traceback

            log(traceback.format_exc())
            results[mode] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if on_mode is not None:
            on_mode(out)
    del weights
    return out


def _time_mode(mode, spec, weights, device, cuda, args, inputs, audio, total, resets, group, log) -> dict:
    """One activation-scale mode of the torch step: session, warm-up, timed steps, profile."""
    engine = TorchStep(spec, weights, device, act_scale=mode if mode in SCALES else "row",
                       compile=False if args.no_compile else None,
                       graphs=not args.no_graphs, mask=args.mask, attention=args.attention,
                       fast_accum=not args.no_fast_accum, group=group)
    engine.start_session(inputs.image, inputs.prompt, seed=args.seed)
    t0 = time.perf_counter()
    engine.step(audio)
    if cuda:
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    log(f"[torch {mode}] first step (compile + capture) in {first_s:.1f} s")
    masked_ms, times, host_ms, reset_ms = [], [], [], []
    for s in range(1, total):
        masked = engine.masked_now()
        dt, host = time_step(engine, audio)
        if s <= args.warmup:
            if masked:
                masked_ms.append(dt)
        elif s in resets:
            reset_ms.append(dt)
        else:
            times.append(dt)
            host_ms.append(host)
    finite = bool(torch.isfinite(engine.latent).all().item())
    res = {"step_ms": percentiles(times), "host_step_ms": percentiles(host_ms), "reset_step_ms": reset_ms,
           "masked_warmup_step_ms": percentiles(masked_ms[1:]) if len(masked_ms) > 1 else {},
           "timed_steps_masked": engine.masked_now(), "first_step_s": first_s,
           "latent_finite": finite, "attention_backend": {("masked" if k else "unmasked"): v for k, v in engine.backend.items()},
           "attention_timings_ms": {("masked" if k else "unmasked"): v for k, v in engine.backend_timings.items()},
           "graphs": engine.graphs, "compiled": engine.compiled,
           "fast_accum": engine.fast_accum and engine.fp8 and cuda,
           "notes": engine.notes,
           "timing": "CUDA events around each step (graph replay), waited on per step" if cuda else "host time"}
    if args.profile_steps > 0:
        try:
            res["breakdown"] = engine.profile(args.profile_steps)
        except Exception as err:  # the profile is extra: keep the timing
            res["breakdown"] = {"error": f"{type(err).__name__}: {err}"}
    if cuda:
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    p = res["step_ms"]
    if p:
        log(f"[torch {mode}] step p50 {p['p50']:.2f} ms, p90 {p['p90']:.2f} ms")
    del engine
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, world: int, port: int, job: str, payload: dict, out_path: str) -> None:
    """One torch.distributed rank (spawned): 'bench' runs ``run_torch_side``; 'session'
    runs a torch session of shard_weights(random_weights(tp = 1)) and returns its latents.
    JAX (the engine's positions) runs on the CPU here: a rank never touches JAX's GPUs."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    cuda = torch.cuda.is_available() and not payload["cpu"]
    if cuda:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    try:
        group = torch.distributed.group.WORLD
        cfg, inputs = payload["cfg"], payload["inputs"]
        if job == "bench":
            log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
            result = run_torch_side(cfg, inputs, argparse.Namespace(**payload["args"]), log, rank, group)
        else:
            device = torch.device(f"cuda:{rank}" if cuda else "cpu")
            spec = StepSpec.from_config(cfg, tp=world, rank=rank)
            full = random_weights(StepSpec.from_config(cfg), torch.device("cpu"), seed=payload["seed"])
            engine = TorchStep(spec, shard_weights(full, spec).to(device), device, compile=False, graphs=False,
                               act_scale=payload.get("act_scale", "row"), group=group)
            result = {"latents": torch_session(engine, inputs, payload["seed"], payload["steps"], payload.get("noise"))}
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        import pickle

        pathlib.Path(out_path).write_bytes(pickle.dumps(result))


def run_ranks(world: int, job: str, payload: dict, timeout_s: float = 3600.0):
    """Runs ``_rank_worker`` in ``world`` spawned processes and returns rank 0's result."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pkl")
        ctx = mp.spawn(_rank_worker, args=(world, _free_port(), job, payload, out_path), nprocs=world, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"the {world} torch ranks did not finish in {timeout_s:.0f} s")
        return pickle.loads(pathlib.Path(out_path).read_bytes())


def _fmt(x, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _label(mode: str) -> str:
    return f"PyTorch, {mode} scales" if mode in SCALES else f"PyTorch, {mode} weights"


def _breakdown_rows(columns: list[tuple[str, dict]]) -> list[str]:
    """Markdown rows of component breakdowns ({"components_ms": {...}, ...} per column)."""
    comps = []
    for _, b in columns:
        comps += [c for c in b.get("components_ms", {}) if c not in comps]
    lines = ["| component (ms per step) | " + " | ".join(c for c, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for comp in comps + ["other_ms", "kernel_ms"]:
        cells = [_fmt(b.get("components_ms", {}).get(comp, b.get(comp))) for _, b in columns]
        lines.append(f"| {comp.replace('_ms', '')} | " + " | ".join(cells) + " |")
    return lines


def append_results(path: pathlib.Path, table: str, device: str) -> None:
    """Appends the run's markdown table to a results file (benchmarks/RESULTS.md) under a
    dated heading naming the machine."""
    import datetime

    day = datetime.date.today().isoformat()
    with open(path, "a") as fh:
        fh.write(f"\n## The step against PyTorch, {day}, {device}\n\n{table}")


def markdown_report(r: dict) -> str:
    """The result as markdown: p50/p90 of each step, effective TFLOP/s, the ratio, the
    component breakdowns (PyTorch's; JAX's with --jax-profile) and the notes."""
    flops, tp = r["step_flops"], r["tp"]
    jax_r, torch_r = r.get("jax", {}), r.get("torch", {})
    jx = jax_r.get("step_ms", {})
    modes = torch_r.get("modes", {})
    cols = [("JAX (DiTGenerator defaults)", jx)] + [(_label(m), v.get("step_ms", {})) for m, v in modes.items()]
    lines = [f"### {r['config']}, tp={tp}: the step, JAX and PyTorch on the same GPU{'s' if tp > 1 else ''}", "",
             f"`{r['command']}`  ",
             f"{r['device']}; jax {jax_r.get('jax', '-')}, torch {torch_r.get('torch', '-')}; "
             f"{flops / 1e12:.1f} TFLOP a step; {r['timed_steps']} timed steps after {r['warmup']} warm-up steps; "
             f"a {r['prompt_tokens']}-token prompt", "",
             "| | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(fn(p) for _, p in cols) + " |")

    row("step p50 (ms)", lambda p: _fmt(p.get("p50")))
    row("step p90 (ms)", lambda p: _fmt(p.get("p90")))
    row("effective TFLOP/s per GPU", lambda p: _fmt(flops / (p["p50"] * 1e-3) / 1e12 / tp, ".0f") if p.get("p50") else "-")
    row("p50 / JAX p50", lambda p: _fmt(p["p50"] / jx["p50"], ".3f") if p.get("p50") and jx.get("p50") else "-")
    host = [jx] + [v.get("host_step_ms", {}) for v in modes.values()]
    lines.append("| host wall p50 (ms) | " + " | ".join(_fmt(h.get("p50")) for h in host) + " |")
    breakdowns = [(_label(m), v["breakdown"]) for m, v in modes.items() if "components_ms" in v.get("breakdown", {})]
    if "components_ms" in jax_r.get("breakdown", {}):
        breakdowns.insert(0, ("JAX", jax_r["breakdown"]))
    if breakdowns:
        lines += ["", "Device time by component (PyTorch: torch.profiler over eager runs of the step's body, by "
                  "scope; JAX: characters_jax.measure.profile):", ""] + _breakdown_rows(breakdowns)
    lines.append("")
    if jax_r:
        lines.append(f"- JAX: {jax_r.get('timing', jax_r.get('error'))}; reset steps "
                     f"{jax_r.get('reset_step_ms') or 'none in the window'}")
    if "error" in torch_r:
        lines.append(f"- PyTorch: {torch_r['error']}")
    for m, v in modes.items():
        if "error" in v:
            lines.append(f"- {_label(m)}: {v['error']}")
            continue
        mask = ("with the slot mask" if v.get("timed_steps_masked")
                else "without a mask (every slot valid: the best case for PyTorch; the JAX step masks)")
        lines.append(f"- {_label(m)}: {v.get('timing')}; timed steps {mask}; SDPA backend {v.get('attention_backend')} "
                     f"(timings ms {v.get('attention_timings_ms')}); masked warm-up steps p50 "
                     f"{_fmt(v.get('masked_warmup_step_ms', {}).get('p50'))} ms; CUDA graphs {v.get('graphs')}, "
                     f"Inductor {v.get('compiled')}; fast accumulation {v.get('fast_accum')}; peak memory {_fmt(v.get('peak_memory_gib'))} GiB")
        lines += [f"- {_label(m)}: {note}" for note in v.get("notes", [])]
    lines += [f"- {note}" for note in r.get("notes", [])]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="characters-57b", help="config name (configs/NAME.toml) or path")
    p.add_argument("--steps", type=int, default=30, help="timed steps per side (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps after the first (default ring_frames + 1: the ring full)")
    p.add_argument("--scales", choices=SCALES + ("both",), default="row", help="PyTorch FP8 activation scales: per row (CUTLASS), per tensor (cuBLASLt), or both one after the other")
    p.add_argument("--share", type=int, default=1, help="one GPU's share of tp = N (num_heads / N, mlp_dim / N), run at tp = 1")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: JAX on N GPUs here, torch in N processes (NCCL)")
    p.add_argument("--side", choices=("both", "jax", "torch"), default="both")
    p.add_argument("--mask", choices=("when-needed", "always"), default="when-needed",
                   help="PyTorch: drop the slot mask once every slot is valid (when-needed), or keep it")
    p.add_argument("--attention", choices=("auto",) + tuple(SDPA_BACKENDS), default="auto", help="PyTorch SDPA backend (auto: the fastest measured)")
    p.add_argument("--no-compile", action="store_true", help="PyTorch: eager elementwise work")
    p.add_argument("--no-graphs", action="store_true", help="PyTorch: no CUDA graph (eager step)")
    p.add_argument("--no-fast-accum", action="store_true", help="PyTorch: _scaled_mm with use_fast_accum=False")
    p.add_argument("--profile-steps", type=int, default=2, help="PyTorch profile breakdown over N runs of the step (0: none)")
    p.add_argument("--jax-profile", default=None, metavar="DIR", help="also trace 2 JAX steps into DIR for its breakdown")
    p.add_argument("--cpu", action="store_true", help="PyTorch on the CPU (smoke runs of small configs)")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="also append the markdown table to FILE (e.g. benchmarks/RESULTS.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "torch_step"), help="directory for the JSON and markdown")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    err = lambda msg: print(f"torch_step: {msg}", file=sys.stderr)  # noqa: E731
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.side != "jax" and torch is None:
        err(f"torch is not importable ({TORCH_IMPORT_ERROR}); --side jax runs the JAX step alone")
        return 2
    from characters_jax.config import ConfigError, load_config
    from characters_jax.measure import upkeep

    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if args.share < 1 or args.tp < 1:
            raise ValueError("--share and --tp must be >= 1")
        if args.share > 1 and args.tp > 1:
            raise ValueError("--share runs one GPU's share at tp = 1: give --share or --tp, not both")
        cfg = load_config(args.config)
        if args.share > 1:
            cfg = cfg.share_of_tp(args.share)
        cfg.validate_tp(args.tp)
    except (ConfigError, ValueError) as e:
        err(str(e))
        return 2
    if args.warmup is None:
        args.warmup = cfg.cache.ring_frames + 1
    inputs = session_inputs(cfg, 1, args.seed)
    command = "python benchmarks/torch_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"config": cfg.name, "tp": args.tp, "share": args.share, "command": command,
              "step_flops": upkeep.step_flops(cfg), "timed_steps": args.steps, "warmup": args.warmup,
              "prompt_tokens": len(inputs.prompt),
              "notes": ["JAX first (then its arrays and backends freed), PyTorch after it "
                        + ("in the same process" if args.tp == 1 else f"in {args.tp} spawned processes (NCCL)")
                        + f" (XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')})"]
              if args.side == "both" else [],
              "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                      "XLA_PYTHON_CLIENT_ALLOCATOR", "NCCL_NVLS_ENABLE", "XLA_FLAGS")}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"torch_step_{cfg.name}_tp{args.tp}"

    def save(final: bool = False) -> None:
        """Writes the JSON and markdown as they stand (after each side and mode: a run cut
        short keeps what it measured)."""
        finish(result, args.tp)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))
        table = markdown_report(result)
        (out / f"{stem}.md").write_text(table)
        if final:
            print(table)
            print(f"wrote {out / stem}.json and .md")
            if args.results:
                append_results(pathlib.Path(args.results), table, result.get("device", "?"))
                print(f"appended the table to {args.results}")

    failed = []
    if args.side in ("both", "jax"):
        log(f"[jax] {cfg.name} at tp={args.tp}")
        result["jax"] = _guarded("jax", failed, log, run_jax_side, cfg, inputs, args, log)
        free_jax(log)
        save()
    if args.side in ("both", "torch"):
        log(f"[torch] {cfg.name} at tp={args.tp}")

        def partial(torch_result):
            result["torch"] = torch_result
            save()

        if args.tp == 1:
            result["torch"] = _guarded("torch", failed, log, run_torch_side, cfg, inputs, args, log, 0, None, partial)
        else:
            payload = {"cfg": cfg, "inputs": inputs, "args": vars(args), "cpu": args.cpu}
            result["torch"] = _guarded("torch", failed, log, run_ranks, args.tp, "bench", payload)
    save(final=True)
    finite = [result.get("jax", {}).get("latent_finite", True)] + [
        v.get("latent_finite", True) for v in result.get("torch", {}).get("modes", {}).values()]
    for side in failed:
        err(f"the {side} side failed: {result[side]['error']}")
    mode_errors = {m: v["error"] for m, v in result.get("torch", {}).get("modes", {}).items() if "error" in v}
    for m, e in mode_errors.items():
        err(f"the torch side's {m} activation scales failed: {e}")
    return 0 if all(finite) and not failed and not mode_errors else 1


def finish(result: dict, tp: int) -> None:
    """Adds the derived figures: device, effective TFLOP/s per GPU, PyTorch p50 / JAX p50."""
    result["device"] = result.get("torch", {}).get("device") or ", ".join(result.get("jax", {}).get("devices", [])) or "-"
    jx = result.get("jax", {}).get("step_ms", {})
    for v in result.get("torch", {}).get("modes", {}).values():
        p = v.get("step_ms", {})
        if p.get("p50"):
            v["effective_tflops_per_gpu"] = result["step_flops"] / (p["p50"] * 1e-3) / 1e12 / tp
        if p.get("p50") and jx.get("p50"):
            v["torch_over_jax_p50"] = p["p50"] / jx["p50"]
    if jx.get("p50"):
        result["jax"]["effective_tflops_per_gpu"] = result["step_flops"] / (jx["p50"] * 1e-3) / 1e12 / tp


def _guarded(side: str, failed: list, log, fn, *args) -> dict:
    """fn(*args), or {"error": ...} with the traceback logged (the other side's results and
    the files are still written; out of memory on the torch side says what to try)."""
    import traceback

    try:
        return fn(*args)
    except Exception as e:  # reported in the JSON and on stderr; main returns 1
        log(traceback.format_exc())
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if side == "torch" and "out of memory" in str(e).lower():
            msg += (" (if JAX's memory did not return to the driver, run --side jax and --side torch in two "
                    "processes)")
        failed.append(side)
        return {"error": msg}


if __name__ == "__main__":
    sys.exit(main())
