"""FP8 (e4m3) linear layers with weights stored (N, K), K-major.

The weights of every projection are kept as ``float8_e4m3fn`` with a float32
dequantization scale (per tensor, or per output channel).  Activations are
quantized on the device with a scale computed from their absolute maximum (never
read by the host): per tensor (``act_scale='tensor'``), or per row (``'row'``: one
scale per token, from that row's maximum; the reduction stays inside the row, so it
fuses with the row's normalization instead of needing a pass over the whole tensor
first, and the product's row m is scaled by it after the GEMM).  The product is one ``dot_general`` on the two
FP8 operands contracting K of both, so the (N, K) weight is consumed as stored
(no transpose) and XLA on NVIDIA GPUs emits its cuBLASLt FP8 GEMM.

The scales are applied after the GEMM: the FP8 dot writes f32, then one multiply by
x_scale * w_scale (scalar, or [N] per channel) and a convert (the post-scaled form;
BUILD_NOTES, "tried and rejected", has the dequantize-pattern form).

Shapes and dtypes:
  ``Fp8Weight.values``  [N, K] float8_e4m3fn
  ``Fp8Weight.scale``   []  float32 (per tensor) or [N] float32 (per channel)
  ``Fp8Activation``     values [..., K] float8_e4m3fn, scale [] or [...] float32 (per row)
  ``linear(x, w)``      x [..., K] -> [..., N] in ``out_dtype`` (default x.dtype)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import fp8_gemm_stacked
from pallas_kernels.fp8_gemm_stacked import Product, stacked_fp8_matmul
from pallas_kernels.numerics import FP8 as FP8_DTYPE, FP8_MAX, quantize_activation, row_broadcast as _row_broadcast

# How activations are scaled for FP8: one scale per tensor, or one per row (token).
ACT_SCALES = ("tensor", "row")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight [N, K] (N output features, K-major) and its dequant scale.

    ``values.astype(f32) * scale[..., None]`` approximates the float weight.

    Stacked form (``layer`` set): ``values`` is a stack [L, N, K] over the blocks and
    ``scale`` [L]; the weight is block ``layer`` (a traced int32 scalar, e.g. the layer
    scan's index), read in place by ``pallas_kernels.fp8_gemm_stacked`` instead of being
    sliced out (XLA copies such a slice for every GEMM).
    """

    values: jax.Array  # [N, K] (or [L, N, K]) float8_e4m3fn
    scale: jax.Array  # [] or [N] (or [L]) float32
    layer: jax.Array | None = None  # [] int32 in the stacked form

    @property
    def stacked(self) -> bool:
        return self.layer is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """[N, K] of the (selected) weight."""
        return self.values.shape[-2:]

    @property
    def per_channel(self) -> bool:
        return self.scale.ndim == (2 if self.stacked else 1)

    @property
    def layer_scale(self) -> jax.Array:
        """The selected block's scale: scale[layer] in the stacked form, else scale."""
        if not self.stacked:
            return self.scale
        return jax.lax.dynamic_index_in_dim(self.scale, self.layer, 0, keepdims=False)

    def at_layer(self) -> "Fp8Weight":
        """The selected block's weight as a plain [N, K] Fp8Weight (an XLA slice)."""
        if not self.stacked:
            return self
        take = lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)  # noqa: E731
        return Fp8Weight(values=take(self.values), scale=self.layer_scale)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [N, K] this FP8 weight stands for."""
        w = self.at_layer()
        scale = w.scale[:, None] if w.per_channel else w.scale
        return (w.values.astype(jnp.float32) * scale).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Activation:
    """Activations already quantized: ``values.astype(f32) * scale[..., None]`` ~ x
    (scale [] per tensor, or [...] one per row; for 2-D values [M, K] a per-row scale may
    cover only the first R <= M rows, the rest being zero padding: ``row_scales``).

    Lets a caller quantize before it pads rows (an FP8 pad fuses into the quantization's
    convert; a pad of the float activations is a copy of twice the bytes in front of the
    amax reduction), then hand the result to ``stacked_linear``.
    """

    values: jax.Array  # [..., K] float8_e4m3fn
    scale: jax.Array  # [] or [...] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def per_row(self) -> bool:
        return self.scale.ndim > 0

    def row_scales(self) -> jax.Array:
        """The scale, per-row scales padded with zeros to the rows of ``values``."""
        s = self.scale
        if s.ndim == 1 and s.shape[0] < self.values.shape[0]:
            s = jnp.pad(s, (0, self.values.shape[0] - s.shape[0]))
        return s

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * _row_broadcast(self.row_scales())).astype(dtype)


def check_act_scale(act_scale: str) -> str:
    if act_scale not in ACT_SCALES:
        raise ValueError(f"unknown activation scale {act_scale!r}; expected one of {ACT_SCALES}")
    return act_scale


def quantize(x, act_scale: str = "tensor") -> Fp8Activation:
    """x [..., K] float (or an Fp8Activation, returned as it is) -> Fp8Activation."""
    if isinstance(x, Fp8Activation):
        return x
    return Fp8Activation(*quantize_activation(x, per_row=check_act_scale(act_scale) == "row"))


def fp8_dot(x_fp8: jax.Array, w_fp8: jax.Array, out_dtype) -> jax.Array:
    """x_fp8 [M, K] . w_fp8 [N, K] -> [M, N], contracting K of both (the weight is not transposed)."""
    return jax.lax.dot_general(
        x_fp8,
        w_fp8,
        dimension_numbers=(((x_fp8.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=out_dtype,
    )


def linear(x, w, out_dtype=None, *, act_scale: str = "tensor") -> jax.Array:
    """y = x @ w.T for x [..., K] and w an ``Fp8Weight`` or a float [N, K] array.

    Args:
      x: activations [..., K] (bf16 or f32), or an ``Fp8Activation`` (FP8 weights only;
        then out_dtype is required).
      w: ``Fp8Weight`` (values [N, K] e4m3, scale [] or [N]) or a float [N, K].
      out_dtype: dtype of the result (default x.dtype).
      act_scale: how float x is quantized for FP8 weights: 'tensor' | 'row'.
    Returns:
      [..., N] in ``out_dtype``.
    """
    if isinstance(x, Fp8Activation) and out_dtype is None:
        raise ValueError("linear of an Fp8Activation needs out_dtype")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if not isinstance(w, Fp8Weight):
        if isinstance(x, Fp8Activation):
            raise ValueError("an Fp8Activation needs an Fp8Weight")
        y = jax.lax.dot_general(
            x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        return y.astype(out_dtype)
    if w.stacked:
        return _stacked_linear(x, w, out_dtype, act_scale=act_scale)
    xq = quantize(x, act_scale)
    y = fp8_dot(xq.values, w.values, jnp.float32)
    return (y.astype(jnp.float32) * _row_broadcast(xq.row_scales()) * w.scale).astype(out_dtype)


def _stacked_operands(x, w: Fp8Weight, act_scale: str):
    """(x's e4m3 values [M, K], the kernel's scale, its row scales or None) for a stacked
    weight: per row, the stack's scales whole (the kernel reads the layer's: no slice
    kernel per call) and x's rows'; per tensor, x's scale times the layer's."""
    xq = quantize(x, act_scale)
    values = xq.values.reshape(-1, xq.shape[-1])
    if xq.per_row:
        return values, w.scale, xq.scale.reshape(-1)
    return values, xq.scale * w.layer_scale, None


def _stacked_linear(x, w: Fp8Weight, out_dtype, addend=None, act_scale: str = "tensor",
                    lead=None) -> jax.Array:
    """x [..., K] @ (block `w.layer` of the stack).T (+ lead's product) (+ addend [..., N]),
    the weight read in place."""
    if w.per_channel or (lead is not None and lead[1].per_channel):
        raise ValueError("the stacked FP8 GEMM takes per-tensor scales")
    if fp8_gemm_stacked.is_supported() and not (
            stacked_gemm_runs_kernel(w) and (lead is None or stacked_gemm_runs_kernel(lead[1]))):
        # A GPU where the kernel runs but this shape does not tile (e.g. N = 8064 at tp=4):
        # XLA's FP8 GEMM on the sliced layer, not the float32 reference.
        y = linear(x, w.at_layer(), jnp.float32, act_scale=act_scale)
        if lead is not None:
            y = y + linear(lead[0], lead[1].at_layer(), jnp.float32, act_scale=act_scale)
        if addend is not None:
            y = y + addend.astype(jnp.float32)
        return y.astype(out_dtype)
    values, scale, rows = _stacked_operands(x, w, act_scale)
    gemm_dtype = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
    if addend is not None:
        addend = addend.reshape(-1, addend.shape[-1])
    if lead is not None:
        lead_values, lead_scale, lead_rows = _stacked_operands(*lead, act_scale)
        lead = Product(lead_values, lead[1].values, lead_scale, lead_rows)
    y = stacked_fp8_matmul(values, w.values, w.layer, scale, out_dtype=gemm_dtype,
                           addend=addend, row_scale=rows, lead=lead)
    return y.reshape(*x.shape[:-1], -1).astype(out_dtype)


def stacked_linear(x, w: Fp8Weight, out_dtype=None, addend=None, act_scale: str = "tensor",
                   lead=None) -> jax.Array:
    """x [..., K] @ w.T (+ lead_x @ lead_w.T) + addend for a stacked per-tensor ``Fp8Weight``
    (``w.layer`` set).

    lead: None or a pair (lead_x [..., K1], lead_w: a stacked Fp8Weight [L, N, K1] at the
    same layer), quantized like x: its product is summed in the same stream-K kernel
    (``pallas_kernels.fp8_gemm_stacked``'s ``lead``), one kernel for both.

    x: float activations (quantized here, per ``act_scale``: 'tensor' | 'row'), or an
    ``Fp8Activation`` (then out_dtype is required). The block's weight is read in place from the stack
    (``pallas_kernels.fp8_gemm_stacked``; its reference elsewhere) and ``addend`` ([..., N],
    optional) is added to the float32 product before the one rounding to ``out_dtype``
    (default x.dtype): in the kernel's epilogue, which reads it in the GEMM's output dtype
    (bf16 for bf16 out, else f32).
    """
    if not w.stacked:
        raise ValueError("stacked_linear takes a stacked Fp8Weight (layer set)")
    if isinstance(x, Fp8Activation) and out_dtype is None:
        raise ValueError("stacked_linear of an Fp8Activation needs out_dtype")
    if lead is not None and not (lead[1].stacked and lead[1].values.shape[:2] == w.values.shape[:2]
                                 and lead[0].shape[:-1] == x.shape[:-1]):
        raise ValueError(f"lead must be (x [..., K1], a stacked Fp8Weight [L, N, K1]) with x's "
                         f"rows and w's [L, N] = {w.values.shape[:2]}")
    return _stacked_linear(x, w, jnp.dtype(out_dtype or x.dtype), addend, act_scale, lead)


def stacked_gemm_runs_kernel(w: Fp8Weight) -> bool:
    """Whether ``stacked_linear`` with this (stacked) weight runs the Pallas kernel here."""
    n, k = w.values.shape[-2:]
    return (w.values.dtype == FP8_DTYPE and fp8_gemm_stacked.fits(n, k)
            and fp8_gemm_stacked.is_supported())


def flops(m: int, k: int, n: int) -> int:
    """Floating-point operations of one [m, k] x [k, n] product."""
    return 2 * m * k * n
