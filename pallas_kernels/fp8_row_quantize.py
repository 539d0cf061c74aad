"""RMS norm, modulation and per-row FP8 quantization in one pass (Pallas, Triton), reference.

Every parallel block starts with ``h = rms_norm(x) * (1 + scale) + shift`` on the residual
x [M, D] and, with FP8 weights and per-row activation scales, quantizes h row by row for the
qkv and MLP-up GEMMs. XLA compiles that into two row-reduction kernels that each read x
(the norm and the row maximum; the norm again and the quantization) and a third that pads
the FP8 rows from 757 to the stacked GEMM's multiple of 8: ~49 MB of traffic per block pass
at d = 9216, against ~21 MB for one read of x and one write of the FP8 values
(BUILD_NOTES, "Per-row activation scales").

This kernel does it in one pass: one program per output row, the whole row in registers
(``block`` = the next power of two of D lanes, masked), so x is read once (Pallas's Triton
backend, which jax 0.11 marks deprecated in favour of Mosaic GPU); it writes
the e4m3 values for ``rows_out`` rows (rows from M on are zero: the pad costs nothing) and
the row's scale (0 for the padding rows, which the stacked GEMM then scales to 0).

The arithmetic is the model's, in the same order and dtypes: ``reference`` is the model's
own ``modulated_norm`` then ``fp8_linear.quantize_activation(per_row=True)`` (the norm in
float32 rounded to x.dtype, the modulation in float32 rounded to x.dtype, the row's
absolute maximum, scale = max(amax, 1e-12) / 448, values = clip(h * (1 / scale)) -> e4m3).

Shapes and dtypes:
  x      [M, D]  bfloat16 (or float32)
  shift  [D]     float32 (adaLN shift), scale [D] float32 (adaLN scale; h uses 1 + scale)
  out    (values [rows_out, D] float8_e4m3fn, row_scale [rows_out] float32), rows_out >= M
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from characters_jax.parallel.fp8_linear import AMAX_FLOOR, FP8_DTYPE as FP8, FP8_MAX

IMPLS = ("auto", "pallas", "reference", "interpret")
KERNEL_NAME = "fp8_row_quantize"


def is_supported() -> bool:
    """The Triton kernel's e4m3 conversion needs an NVIDIA GPU of compute capability 8.9+."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 8.9
    except ValueError:
        return False


def reference(x, shift, scale, *, eps: float, rows_out: int | None = None):
    """The model's math: (values [rows_out, D] e4m3, row_scale [rows_out] f32), rows past M
    zero."""
    from characters_jax.model.dit import modulated_norm
    from characters_jax.parallel.fp8_linear import quantize_activation

    m = x.shape[0]
    rows_out = rows_out or m
    q, s = quantize_activation(modulated_norm(x, shift, scale, eps), per_row=True)
    pad = rows_out - m
    return jnp.pad(q, ((0, pad), (0, 0))), jnp.pad(s, (0, pad))


def _kernel(x_ref, shift_ref, scale_ref, q_ref, s_ref, *, m: int, d: int, block: int,
            eps: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    row = pl.program_id(0)
    valid = row < m
    src = jnp.minimum(row, m - 1)
    cols = jnp.arange(block)
    inside = cols < d
    x = plt.load(x_ref.at[src, cols], mask=inside, other=0.0)
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(xf * xf) / d + eps)
    normed = (xf * rstd).astype(x.dtype).astype(jnp.float32)
    shift = plt.load(shift_ref.at[cols], mask=inside, other=0.0)
    gain = plt.load(scale_ref.at[cols], mask=inside, other=0.0)
    h = (normed * (1.0 + gain) + shift).astype(x.dtype).astype(jnp.float32)
    h = jnp.where(inside & valid, h, 0.0)
    s = jnp.maximum(jnp.max(jnp.abs(h)), AMAX_FLOOR) / FP8_MAX
    q = jnp.clip(h * (1.0 / s), -FP8_MAX, FP8_MAX).astype(FP8)
    plt.store(q_ref.at[row, cols], q, mask=inside)
    s_ref[row] = jnp.where(valid, s, 0.0)


def default_num_warps(d: int) -> int:
    """Warps per program (one row): the row's power-of-two lanes / 1024, 1 to 8. (At
    757 x 9216 on an H200, 8 warps took 26.0-26.3 us a call, 16 took 28.7-29.2, 2 and 4
    26.5-30.8: BUILD_NOTES, "The block input as one kernel".)"""
    from jax.experimental import pallas as pl

    return min(max(pl.next_power_of_2(d) // 1024, 1), 8)


def _pallas(x, shift, scale, *, eps, rows_out, interpret: bool, num_warps: int | None = None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    m, d = x.shape
    block = pl.next_power_of_2(d)
    kernel = functools.partial(_kernel, m=m, d=d, block=block, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(rows_out,),
        out_shape=(jax.ShapeDtypeStruct((rows_out, d), FP8),
                   jax.ShapeDtypeStruct((rows_out,), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=num_warps or default_num_warps(d)),
        interpret=interpret,
        name=KERNEL_NAME,
    )(x, shift.astype(jnp.float32), scale.astype(jnp.float32))


def norm_modulate_quantize(x, shift, scale, *, eps: float, rows_out: int | None = None,
                           impl: str = "auto", num_warps: int | None = None):
    """x [M, D], shift/scale [D] -> (values [rows_out, D] e4m3, row_scale [rows_out] f32):
    rows_out (default M) >= M; rows past M are zero with scale 0.

    impl: 'auto' (the Triton kernel on a GPU that has it, else the reference) | 'pallas' |
    'reference' | 'interpret' (the kernel under the Pallas interpreter, CPU).
    num_warps: warps per program (default ``default_num_warps``)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if x.ndim != 2 or shift.shape != (x.shape[1],) or scale.shape != (x.shape[1],):
        raise ValueError(f"want x [M, D] and shift, scale [D]; got {x.shape}, {shift.shape}, "
                         f"{scale.shape}")
    rows_out = rows_out or x.shape[0]
    if rows_out < x.shape[0]:
        raise ValueError(f"rows_out={rows_out} is below M={x.shape[0]}")
    if impl == "auto":
        impl = "pallas" if is_supported() else "reference"
    if impl == "reference":
        return reference(x, shift, scale, eps=eps, rows_out=rows_out)
    return _pallas(x, shift, scale, eps=eps, rows_out=rows_out, interpret=impl == "interpret",
                   num_warps=num_warps)
