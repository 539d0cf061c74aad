"""An activation's last elementwise step and its per-row FP8 quantization in one pass
(Pallas, Triton), and the reference.

With FP8 weights and per-row activation scales, every GEMM input is quantized row by row.
XLA compiles each such chain into two row-reduction kernels that both read the activation
(the elementwise prologue and the row maximum; the prologue again and the quantization)
and a third that pads the FP8 rows to the stacked GEMM's multiple of 8 (BUILD_NOTES,
"Per-row activation scales"). This kernel reads the activation once, keeps each row in
registers, and writes the e4m3 values for ``rows_out`` rows (rows from M on are zero: the
pad costs nothing) and one scale per row (0 for the padding rows, which the GEMMs then
scale to 0). Three prologues (``PROLOGUES``):

  'norm'  the block input: h = rms_norm(x) * (1 + scale) + shift (adaLN), the norm rounded
          to x.dtype, h rounded to x.dtype (``numerics.modulated_norm``, the model's);
  'gelu'  the MLP hidden: h = gelu(y) in float32, rounded to y.dtype (``numerics.mlp_hidden``,
          the model's), read straight from the up GEMM's (row-padded) output;
  'none'  h = x (e.g. the attention output).

then scale = max(amax(h), 1e-12) / 448 and values = clip(h * (1 / scale)) -> e4m3, as
``numerics.quantize_activation(per_row=True)``. ``reference`` is that model code.

Layout: a program handles ``rows_per_program`` rows; a row is split into chunks of
``chunk`` lanes (a power of two; the last chunk masked), all loaded up front and kept in
registers, so a thread holds only its share of the real row, not of the row rounded up to
a power of two (9216 lanes -> 16384: 44% of the registers masked).

Shapes and dtypes:
  x      [Mx, D] bfloat16 (or float32), Mx >= M: rows from M on are not read
  shift  [D]     float32 (adaLN shift), scale [D] float32 (adaLN scale)  ('norm' only)
  out    (values [rows_out, D] float8_e4m3fn, row_scale [rows_out] float32), rows_out >= M
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device
from pallas_kernels.numerics import (AMAX_FLOOR, FP8, FP8_MAX, gelu_tanh, mlp_hidden,
                                     modulated_norm, quantize_activation)

IMPLS = ("auto", "pallas", "reference", "interpret")
PROLOGUES = ("norm", "gelu", "none")
KERNEL_NAME = "fp8_row_quantize"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the kernel covers the rows: ``rows_per_program`` rows per program (a power of
    two), each row in chunks of ``chunk`` lanes (a power of two; None: the row's next power
    of two, one chunk), ``num_warps`` warps per program. The row stays in registers, read
    once."""

    rows_per_program: int = 1
    chunk: int | None = 2048
    num_warps: int = 8

    def __post_init__(self):
        for name in ("rows_per_program", "chunk", "num_warps"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"Layout.{name} must be a power of two, got {v}")

    def chunk_for(self, d: int) -> int:
        from jax.experimental import pallas as pl

        full = pl.next_power_of_2(d)
        return full if self.chunk is None else min(self.chunk, full)


# The default (BUILD_NOTES, "Every GEMM input quantized by one kernel", "The row-quantize
# kernel's layout"): at 757 x 9216 in the tp=4 share's step 15.8 us a call on an H200,
# against 20.1 for Layout(1, None, 8); within ~5% of the best layout tried at every shape.
DEFAULT_LAYOUT = Layout()


def is_supported() -> bool:
    """The Triton kernel's e4m3 conversion needs an NVIDIA GPU of compute capability 8.9+."""
    return device.has_fp8_conversion()


def _prologue_ref(prologue: str, x, shift, scale, eps):
    if prologue == "norm":
        return modulated_norm(x, shift, scale, eps)
    if prologue == "gelu":
        return mlp_hidden(x)
    return x


def reference(x, shift=None, scale=None, *, eps: float = 0.0, rows: int | None = None,
              rows_out: int | None = None, prologue: str = "norm"):
    """The model's math on the first ``rows`` (default all) rows of x: (values [rows_out, D]
    e4m3, row_scale [rows_out] f32), rows past ``rows`` zero."""
    m = rows or x.shape[0]
    rows_out = rows_out or m
    q, s = quantize_activation(_prologue_ref(prologue, x[:m], shift, scale, eps), per_row=True)
    pad = rows_out - m
    return jnp.pad(q, ((0, pad), (0, 0))), jnp.pad(s, (0, pad))


def _kernel(x_ref, *refs, m: int, d: int, rows_out: int, layout: Layout, chunk: int,
            prologue: str, eps: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if prologue == "norm":
        shift_ref, scale_ref, q_ref, s_ref = refs
    else:
        q_ref, s_ref = refs
    r = layout.rows_per_program
    row_ids = pl.program_id(0) * r + jnp.arange(r)
    valid = row_ids < m  # [r]
    dtype = x_ref.dtype
    n_chunks = -(-d // chunk)
    memo = {}  # (kind, chunk) -> values: the row stays in registers

    def each(fn, init):
        """fn(i, acc) folded over the chunks, unrolled over values loaded once."""
        for i in range(n_chunks):
            init = fn(i, init)
        return init

    def lanes(i):
        # A chunk's lane indices (not a slice: the last chunk's lanes past D are masked,
        # and a slice may not run past the array) and their mask.
        cols = i * chunk + jnp.arange(chunk)
        return cols, cols < d

    def remembered(kind, fn):
        """fn(i) once per chunk: the row stays in registers."""
        def once(i):
            if (kind, i) not in memo:
                memo[(kind, i)] = fn(i)
            return memo[(kind, i)]
        return once

    @functools.partial(remembered, "x")
    def x_of(i):
        cols, inside = lanes(i)
        x = plt.load(x_ref.at[row_ids[:, None], cols[None, :]],
                     mask=valid[:, None] & inside[None, :], other=0.0)
        return x.astype(jnp.float32)

    rstd = None
    if prologue == "norm":
        sq = each(lambda i, acc: acc + jnp.sum(jnp.square(x_of(i)), axis=1),
                  jnp.zeros((r,), jnp.float32))
        rstd = jax.lax.rsqrt(sq / d + eps)[:, None]

    @functools.partial(remembered, "h")
    def h_of(i):
        """The prologue's h [r, chunk] float32 (its x.dtype rounding kept), 0 in masked
        lanes and rows past M."""
        cols, inside = lanes(i)
        h = x_of(i)
        if prologue == "norm":
            shift = plt.load(shift_ref.at[cols], mask=inside, other=0.0)
            gain = plt.load(scale_ref.at[cols], mask=inside, other=0.0)
            normed = (h * rstd).astype(dtype).astype(jnp.float32)
            h = (normed * (1.0 + gain[None, :]) + shift[None, :]).astype(dtype).astype(jnp.float32)
        elif prologue == "gelu":
            h = gelu_tanh(h).astype(dtype).astype(jnp.float32)
        return jnp.where(valid[:, None] & inside[None, :], h, 0.0)

    amax = each(lambda i, acc: jnp.maximum(acc, jnp.max(jnp.abs(h_of(i)), axis=1)),
                jnp.zeros((r,), jnp.float32))
    s = jnp.maximum(amax, AMAX_FLOOR) / FP8_MAX  # [r]
    inv = (1.0 / s)[:, None]
    stored = row_ids < rows_out

    def store(i, carry):
        cols, inside = lanes(i)
        q = jnp.clip(h_of(i) * inv, -FP8_MAX, FP8_MAX).astype(FP8)
        plt.store(q_ref.at[row_ids[:, None], cols[None, :]], q,
                  mask=stored[:, None] & inside[None, :])
        return carry

    each(store, 0)
    plt.store(s_ref.at[row_ids], jnp.where(valid, s, 0.0), mask=stored)


def _pallas(x, shift, scale, *, m: int, rows_out: int, prologue: str, eps: float,
            layout: Layout, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    d = x.shape[1]
    r = layout.rows_per_program
    kernel = functools.partial(_kernel, m=m, d=d, rows_out=rows_out, layout=layout,
                               chunk=layout.chunk_for(d), prologue=prologue, eps=eps)
    operands = (x,) + ((shift.astype(jnp.float32), scale.astype(jnp.float32))
                       if prologue == "norm" else ())
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows_out, r),),
        out_shape=(jax.ShapeDtypeStruct((rows_out, d), FP8),
                   jax.ShapeDtypeStruct((rows_out,), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=layout.num_warps),
        interpret=interpret,
        name=KERNEL_NAME,
    )(*operands)


def row_quantize(x, shift=None, scale=None, *, prologue: str, eps: float = 0.0,
                 rows: int | None = None, rows_out: int | None = None, impl: str = "auto",
                 layout: Layout | None = None):
    """x [Mx, D] -> (values [rows_out, D] e4m3, row_scale [rows_out] f32) of the prologue
    (module docstring) on x's first ``rows`` rows (default Mx); rows_out (default ``rows``)
    >= rows, rows past ``rows`` zero with scale 0. shift, scale [D]: 'norm' only.

    impl: 'auto' (the Triton kernel on a GPU that has it, else the reference) | 'pallas' |
    'reference' | 'interpret' (the kernel under the Pallas interpreter, CPU).
    layout: the kernel's ``Layout`` (default ``DEFAULT_LAYOUT``)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; expected one of {PROLOGUES}")
    if x.ndim != 2:
        raise ValueError(f"want x [M, D]; got {x.shape}")
    if prologue == "norm":
        if (shift is None or scale is None or shift.shape != (x.shape[1],)
                or scale.shape != (x.shape[1],)):
            raise ValueError(f"the 'norm' prologue wants shift, scale [{x.shape[1]}]; got "
                             f"{getattr(shift, 'shape', None)}, {getattr(scale, 'shape', None)}")
    elif shift is not None or scale is not None:
        raise ValueError(f"shift and scale are for the 'norm' prologue, not {prologue!r}")
    m = rows or x.shape[0]
    if not 1 <= m <= x.shape[0]:
        raise ValueError(f"rows={rows} must be in [1, {x.shape[0]}]")
    rows_out = rows_out or m
    if rows_out < m:
        raise ValueError(f"rows_out={rows_out} is below the rows quantized ({m})")
    if impl == "auto":
        impl = "pallas" if is_supported() else "reference"
    if impl == "reference":
        return reference(x, shift, scale, eps=eps, rows=m, rows_out=rows_out, prologue=prologue)
    return _pallas(x, shift, scale, m=m, rows_out=rows_out, prologue=prologue, eps=eps,
                   layout=layout or DEFAULT_LAYOUT, interpret=impl == "interpret")
