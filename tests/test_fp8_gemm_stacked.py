"""Stacked-weight FP8 GEMM: reference vs float math, the Pallas kernel under the Mosaic GPU
interpreter (CPU), the CUDA lowering without a weight slice, GPU exactness."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import fp8_gemm_stacked as st
from pallas_kernels import fp8_gemm_stream_k as sk

FP8 = jnp.float8_e4m3fn


def _operands(seed, m, n, k, layers):
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x8 = (jax.random.normal(kx, (m, k)) * 16).astype(FP8)
    w8 = (jax.random.normal(kw, (layers, n, k)) * 16).astype(FP8)
    scale = jnp.float32(jax.random.uniform(ks, (), minval=0.5, maxval=2.0) / 4096)
    assert np.abs(np.asarray(x8, np.float32)).min() < np.abs(np.asarray(x8, np.float32)).max()
    return x8, w8, scale


def _exact(x8, w8, layer, scale):
    """float64 numpy: x @ w[clamp(layer)].T * scale."""
    layer = min(max(int(layer), 0), w8.shape[0] - 1)
    return (np.asarray(x8, np.float64) @ np.asarray(w8[layer], np.float64).T) * float(scale)


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_reference_matches_float_math():
    seed = 11
    x8, w8, scale = _operands(seed, 45, 96, 64, 5)
    layer = 1 + seed % 4  # never 0
    ref = _exact(x8, w8, layer, scale)
    assert np.abs(ref).max() > 0
    ref_fn = jax.jit(st.reference, static_argnames="out_dtype")
    out32 = ref_fn(x8, w8, jnp.int32(layer), scale, out_dtype=jnp.float32)
    assert out32.shape == (45, 96) and out32.dtype == jnp.float32
    assert _rel_err(out32, ref) < 1e-6, seed
    out = ref_fn(x8, w8, jnp.int32(layer), scale)
    assert out.dtype == jnp.bfloat16 and _rel_err(out, ref) < 4e-3, seed
    # A different layer gives a different product (the index is really used).
    assert _rel_err(out, _exact(x8, w8, layer - 1, scale)) > 0.5


def test_auto_is_reference_on_cpu_and_bad_input_is_rejected():
    x8, w8, scale = _operands(1, 16, 256, 128, 2)
    out = st.stacked_fp8_matmul(x8, w8, jnp.int32(1), scale)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
        st.reference(x8, w8, jnp.int32(1), scale), np.float32))
    with pytest.raises(ValueError, match="unknown impl"):
        st.stacked_fp8_matmul(x8, w8, 0, scale, impl="cublas")
    with pytest.raises(ValueError, match="does not fit tiles"):
        st.stacked_fp8_matmul(x8[:, :96], w8[:, :, :96], 0, scale, impl="pallas")
    with pytest.raises(ValueError, match="K mismatch"):
        st.stacked_fp8_matmul(x8[:, :64], w8, 0, scale)


def test_kernel_in_interpreter_inside_scan():
    """The Pallas kernel (Mosaic GPU interpreter) in a lax.scan over the layers: the traced
    scan index picks each layer; M = 37 is neither a multiple of the tile nor of 8."""
    seed = 12
    m, n, k, layers = 37, 256, 256, 3
    x8, w8, scale = _operands(seed, m, n, k, layers)

    @jax.jit
    def run(x8, w8, scale):
        def body(carry, layer):
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scale, impl="interpret")
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, scale)
    assert out.shape == (layers, m, n) and out.dtype == jnp.bfloat16
    for layer in range(layers):
        ref = _exact(x8, w8, layer, scale)
        assert np.isfinite(np.asarray(out[layer], np.float32)).all()
        assert _rel_err(out[layer], ref) < 4e-3, (seed, layer)
        # Same numbers as the reference up to its own bf16 rounding.
        same = st.reference(x8, w8, jnp.int32(layer), scale)
        assert _rel_err(out[layer], np.asarray(same, np.float64)) < 4e-3, (seed, layer)


@pytest.mark.parametrize("m,n,k,layers,layer,config", [
    (70, 256, 256, 3, 9, None),  # out of range: clamped to L - 1
    (40, 384, 256, 2, 1, None),  # N % 256 != 0 (tp=4 MLP-up): pick_config -> NARROW_CONFIG
    # Per-row scales: the last M tile's copy past the 133 real rows' scales bounded (zeros)
    (136, 1024, 256, 2, 1, (None, 133)),
    (40, 384, 256, 2, 0, (None, 37)),  # fewer scales than one tile: padded
], ids=["clamped_layer", "narrow", "rows_bounded", "rows_padded"])
def test_kernel_in_interpreter_matches_reference(m, n, k, layers, layer, config):
    seed = 13
    x8, w8, scale = _operands(seed, m, n, k, layers)
    config, r = config if isinstance(config, tuple) else (config, None)
    rows = (None if r is None else
            jax.random.uniform(jax.random.key(seed + 1), (r,), minval=0.25, maxval=4.0))
    fn = jax.jit(lambda x, w, l, s, rows: st.stacked_fp8_matmul(
        x, w, l, s, impl="interpret", config=config, row_scale=rows))
    out = fn(x8, w8, jnp.int32(layer), scale, rows)
    assert out.shape == (m, n)
    exact = _exact(x8, w8, layer, scale)
    if rows is not None:
        exact = exact * np.pad(np.asarray(rows, np.float64), (0, m - r))[:, None]
        assert not np.asarray(out[r:], np.float32).any()
    assert _rel_err(out, exact) < 4e-3, seed


@pytest.mark.parametrize("config,rows", [(None, False), (None, True)],
                         ids=["per_tensor", "per_row"])
def test_per_layer_scales_read_at_the_layer_in_interpreter(config, rows):
    """scale as the stack's [L] (distinct per layer): the kernel reads the layer's, the
    same as the scalar scale of that layer, under a scan over the layers."""
    seed = 14
    m, n, k, layers = 40, 512, 256, 3
    x8, w8, scale = _operands(seed, m, n, k, layers)
    stack = scale * jnp.array([0.5, 1.0, 2.0], jnp.float32)
    r = jax.random.uniform(jax.random.key(seed + 1), (m,), minval=0.5, maxval=2.0) if rows else None

    def run(scales):
        def body(c, layer):
            return c, st.stacked_fp8_matmul(x8, w8, layer, scales, impl="interpret",
                                            config=config, row_scale=r)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = jax.jit(run)(stack)
    for layer in range(layers):
        want = _exact(x8, w8, layer, stack[layer])
        if rows:
            want = want * np.asarray(r, np.float64)[:, None]
        assert _rel_err(out[layer], want) < 4e-3, (seed, layer)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, st.NARROW_CONFIG], ids=["default", "narrow"])
def test_per_layer_scales_read_at_the_layer_on_gpu(config):
    """On the GPU at M = 757 with per-row x: the [L] scale stack read in the kernel at each
    layer of a scan (distinct scales per layer), NaN-poisoned memory."""
    if not st.is_supported():
        pytest.skip("needs an NVIDIA Hopper GPU")
    seed = 15
    m, layers = 757, 3
    n = 8064 if config is st.NARROW_CONFIG else 2048
    x8, w8, scale = _operands(seed, m, n, 1024, layers)
    stack = scale * jnp.array([0.5, 1.0, 2.0], jnp.float32)
    r = jax.random.uniform(jax.random.key(seed + 1), (m,), minval=0.5, maxval=2.0)
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()

    @jax.jit
    def run(stack, r):
        def body(c, layer):
            return c, st.stacked_fp8_matmul(x8, w8, layer, stack, impl="pallas", config=config,
                                            row_scale=r)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(stack, r)
    assert np.isfinite(np.asarray(out, np.float32)).all(), seed
    for layer in range(layers):
        want = _exact(x8, w8, layer, stack[layer]) * np.asarray(r, np.float64)[:, None]
        assert _rel_err(out[layer], want) < 4e-3, (seed, layer)


def test_per_layer_scales_need_no_slice_when_lowered_for_cuda():
    """The scanned GEMM with the [L] scale stack (per-row x): lowered for CUDA, the stack
    reaches the kernel whole: no slice of it per layer (a kernel of its own on the GPU)."""
    def run(x8, w8, scales, rows):
        def body(carry, layer):
            y = st.stacked_fp8_matmul(x8, w8, layer, scales, impl="pallas", row_scale=rows)
            return carry + y[0, 0].astype(jnp.float32), None
        return lax.scan(body, jnp.float32(0), jnp.arange(4, dtype=jnp.int32))[0]

    args = (jax.ShapeDtypeStruct((757, 256), FP8), jax.ShapeDtypeStruct((4, 512, 256), FP8),
            jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((757,), jnp.float32))
    text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
        debug_info=False)
    call = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    assert len(call) == 1 and "tensor<4xf32>" in call[0].rsplit(":", 1)[-1].split("->")[0]
    assert not [ln for ln in text.splitlines()
                if "dynamic_slice" in ln and "tensor<4xf32>" in ln], "a slice of the scales"
    with pytest.raises(ValueError, match="scale"):
        st.stacked_fp8_matmul(jnp.zeros((8, 256), FP8), jnp.zeros((4, 512, 256), FP8),
                              jnp.int32(0), jnp.ones((3,)))


_F8_3D = re.compile(r"tensor<\d+x\d+x\d+xf8E4M3FN>")


def _lower_scan(impl, m=757, n=512, k=256, layers=4, config=None, rows=False):
    def run(x8, w8, scale, *row_scale):
        def body(carry, layer):
            y = st.stacked_fp8_matmul(x8, w8, layer, scale, impl=impl, config=config,
                                      row_scale=row_scale[0] if rows else None)
            return carry + y[0, 0].astype(jnp.float32), None
        return lax.scan(body, jnp.float32(0), jnp.arange(layers, dtype=jnp.int32))[0]

    args = (jax.ShapeDtypeStruct((m, k), FP8), jax.ShapeDtypeStruct((layers, n, k), FP8),
            jax.ShapeDtypeStruct((), jnp.float32))
    if rows:
        args += (jax.ShapeDtypeStruct((m,), jnp.float32),)
    return jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
        debug_info=False)


def _weight_slices(text):
    """StableHLO ops that take a slice/gather of a rank-3 FP8 array (the stacked weight)."""
    ops = ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.gather", "stablehlo.copy")
    return [ln for ln in text.splitlines()
            if any(op in ln for op in ops) and _F8_3D.search(ln.split(":", 1)[-1])]


def test_kernel_lowers_for_cuda_without_weight_slice():
    """Lowered for CUDA (no GPU needed): the scanned step hands the whole [L, N, K] stack
    to the Mosaic GPU custom call and nothing slices or copies it outside."""
    text = _lower_scan("pallas")
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    assert len(calls) == 1
    assert "tensor<4x512x256xf8E4M3FN>" in calls[0].rsplit(":", 1)[-1]  # the stack itself
    assert _weight_slices(text) == []
    # The check does see the slice where there is one: the XLA path has it.
    assert _weight_slices(_lower_scan("reference"))


@pytest.mark.parametrize("n,k", [(13824, 9216), (9216, 4608), (16128, 9216), (9216, 16128),
                                 (8064, 9216), (9216, 10752)])
def test_lowers_at_characters_57b_shapes(n, k):
    """qkv / out / up / down per GPU at tp = 2, 60 layers (the down stack is 8.9 GB: the
    layer offset exceeds 32 bits), and tp = 4's MLP-up (N = 8064: the narrow tiles) and
    tp = 3's MLP-down; abstract shapes, nothing allocated."""
    text = _lower_scan("pallas", m=757, n=n, k=k, layers=60)
    assert f"tensor<60x{n}x{k}xf8E4M3FN>" in text and "mosaic_gpu" in text
    assert _weight_slices(text) == []


@pytest.mark.gpu
@pytest.mark.parametrize("config,n", [(None, 384),  # N = 384: NARROW_CONFIG
                                      # 240 tiles of 4 K steps over 132 blocks
                                      (None, 10240),
                                      (st.Config(tile_n=64, stages=4), 10240),
                                      (None, 512)])  # 12 tiles, 12 blocks
def test_kernel_on_gpu_inside_scan(config, n):
    if not st.is_supported():
        pytest.skip("needs an NVIDIA Hopper GPU")
    seed = 16
    m, k, layers = 757, 512, 4
    x8, w8, scale = _operands(seed, m, n, k, layers)
    # Poison freed memory so unwritten output elements show as NaN.
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()

    @jax.jit
    def run(x8, w8, scale):
        def body(carry, layer):
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scale, impl="pallas",
                                                config=config)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, scale)
    assert np.isfinite(np.asarray(out, np.float32)).all(), seed
    for layer in range(layers):
        assert _rel_err(out[layer], _exact(x8, w8, layer, scale)) < 4e-3, (seed, layer)


def test_addend_epilogue_in_interpreter_inside_scan():
    """The epilogue addend (TMA load of the addend's sub-tile into the output buffer, f32
    add, one rounding) under the Mosaic GPU interpreter: a lax.scan over 3 layers with
    distinct weights and distinct addends, two persistent blocks that each take several
    tiles (M = 136: two M tiles, the second partly out of bounds; N = 512: two N tiles)."""
    seed = 17
    m, n, k, layers = 136, 512, 256, 3
    x8, w8, scale = _operands(seed, m, n, k, layers)
    add = jax.random.normal(jax.random.key(seed + 1), (layers, m, n), jnp.float32) * 30

    @jax.jit
    def run(x8, w8, scale, add):
        def body(carry, layer):
            a = lax.dynamic_index_in_dim(add, layer, 0, keepdims=False).astype(jnp.bfloat16)
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scale, impl="interpret", addend=a)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, scale, add)
    assert out.shape == (layers, m, n) and out.dtype == jnp.bfloat16
    for layer in range(layers):
        a = np.asarray(add[layer].astype(jnp.bfloat16), np.float64)
        ref = _exact(x8, w8, layer, scale) + a
        assert np.isfinite(np.asarray(out[layer], np.float32)).all()
        assert _rel_err(out[layer], ref) < 4e-3, (seed, layer)
        # Not the product alone, not another layer's addend.
        assert _rel_err(out[layer], _exact(x8, w8, layer, scale)) > 0.1
        other = np.asarray(add[(layer + 1) % layers].astype(jnp.bfloat16), np.float64)
        assert _rel_err(out[layer], _exact(x8, w8, layer, scale) + other) > 0.1
        # The reference path: same result, f32 addend.
        same = st.reference(x8, w8, jnp.int32(layer), scale, addend=add[layer].astype(jnp.bfloat16))
        assert _rel_err(out[layer], np.asarray(same, np.float64)) < 4e-3


def test_addend_shape_is_checked_and_lowers_for_cuda():
    x8, w8, scale = _operands(2, 40, 256, 128, 2)
    with pytest.raises(ValueError, match="addend"):
        st.stacked_fp8_matmul(x8, w8, 0, scale, addend=jnp.zeros((40, 128), jnp.bfloat16))
    args = (jax.ShapeDtypeStruct((757, 256), FP8), jax.ShapeDtypeStruct((4, 512, 256), FP8),
            jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((757, 512), jnp.float32))
    text = jax.jit(lambda x, w, s, a: st.stacked_fp8_matmul(x, w, 1, s, impl="pallas", addend=a)
                   ).trace(*args).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
    call = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    assert len(call) == 1
    operands = call[0].rsplit(":", 1)[-1].split("->")[0]
    assert "tensor<760x512xbf16>" in operands  # the addend, read as the output dtype, 760 rows
    assert "tensor<4x512x256xf8E4M3FN>" in operands


@pytest.mark.gpu
@pytest.mark.parametrize("config,n,k,num_sms,with_rows", [
    # 30 slabs of 8 K steps over 22 teams of 6 blocks, so slabs are cut and the owner's
    # piece is added onto its neighbour's with the addend
    (None, 7680, 1024, None, False),
    # per-row scales of x (both pieces of a cut tile scaled; the narrow tiling at tp=4's
    # MLP-up width)
    (None, 7680, 1024, None, True),
    (st.NARROW_CONFIG, 8064, 1024, None, True)],
    ids=["default", "rows", "narrow_rows"])
def test_addend_epilogue_on_gpu_inside_scan(config, n, k, num_sms, with_rows):
    """The addend epilogue on the hardware (one GPU, no peers: isolated from the fused
    kernel's multi-GPU protocol). M = 757, 3 layers with distinct weights and addends,
    NaN-poisoned memory."""
    if not st.is_supported():
        pytest.skip("needs an NVIDIA Hopper GPU")
    seed = 18
    m, layers = 757, 3
    if config is None:
        assert st.pick_config(n, k) == st.STREAM_K_CONFIG
    x8, w8, scale = _operands(seed, m, n, k, layers)
    add = (jax.random.normal(jax.random.key(seed + 1), (layers, m, n), jnp.float32) * 30
           ).astype(jnp.bfloat16)
    rows = (jax.random.uniform(jax.random.key(seed + 2), (m,), minval=0.25, maxval=4.0)
            if with_rows else None)
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()

    @jax.jit
    def run(x8, w8, scale, add, rows):
        def body(carry, layer):
            a = lax.dynamic_index_in_dim(add, layer, 0, keepdims=False)
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scale, impl="pallas", addend=a,
                                                config=config, num_sms=num_sms, row_scale=rows)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, scale, add, rows)
    assert np.isfinite(np.asarray(out, np.float32)).all(), seed
    for layer in range(layers):
        product = _exact(x8, w8, layer, scale)
        if with_rows:
            product = product * np.asarray(rows, np.float64)[:, None]
        ref = product + np.asarray(add[layer], np.float64)
        assert _rel_err(out[layer], ref) < 4e-3, (seed, layer)


def test_pick_config_by_n():
    """128 x 256 tiles wherever N tiles by 256 (every characters-57b projection at tp = 1,
    2, 3), 128 x 128 where it does not (MLP-up at tp = 4: N = 8064); M does not matter."""
    for n, k in ((13824, 9216), (9216, 4608), (16128, 9216), (9216, 16128), (32256, 9216),
                 (9216, 10752), (6912, 9216)):
        assert st.pick_config(n, k) == st.STREAM_K_CONFIG, (n, k)
    assert st.pick_config(8064, 9216) == st.NARROW_CONFIG
    assert st.fits(8064, 9216) and not st.fits(8064, 9216, st.STREAM_K_CONFIG)
    assert not st.fits(8000, 9216)


def test_tiling_fits_shared_memory_for_any_output_dtype():
    """The block's shared memory as the Mosaic GPU compiler counted it on an H200 for the
    talking config's float32 GEMMs with the 4-stage tiles (262,224 bytes; 263,256 with row
    scales and a lead product: both over the 232,448-byte limit), and the tiling picked for
    a float32 output keeps every block under the limit; bf16 keeps the measured tiles."""
    import jax.numpy as jnp

    from pallas_kernels import gemm_common as gc

    assert gc.smem_bytes(st.STREAM_K_CONFIG, jnp.float32, row_scales=False, lead=False) == 262224
    assert gc.smem_bytes(st.STREAM_K_CONFIG, jnp.float32) == 263256
    for n, k in ((768, 256), (256, 256), (1024, 256), (256, 1024), (384, 256), (27648, 9216), (8064, 9216)):
        for dtype in (jnp.float32, jnp.bfloat16):
            c = st.pick_config(n, k, dtype)
            assert gc.smem_bytes(c, dtype) <= gc.SMEM_LIMIT_BYTES, (n, k, dtype, c)
            assert c.stages >= 3, c
    assert st.pick_config(768, 256, jnp.bfloat16) == st.STREAM_K_CONFIG
    assert st.pick_config(8064, 9216, jnp.bfloat16) == st.NARROW_CONFIG
    assert st.pick_config(768, 256, jnp.float32).stages == 3
    assert st.pick_config(384, 256, jnp.float32).stages == 5


@pytest.mark.parametrize("n,k,teams", [(13824, 9216, 22), (9216, 4608, 22), (16128, 9216, 22),
                                       (9216, 16128, 22), (8064, 9216, 22), (512, 768, 2),
                                       (9216, 4608, 36), (9216, 4608, 1)])
def test_stream_k_plan_covers_every_step_once(n, k, teams):
    """The stream-K schedule at the characters-57b shapes (tp = 2, tp = 4's MLP-up on the
    narrow tiles; 22 teams of 6 blocks on 132 SMs) and small ones: every K step of every
    weight slab in exactly one team's range, in order; a slab is cut at most once, between
    neighbours, the owner's last segment holding its first step and the next team's first
    segment the rest."""
    config = st.pick_config(n, k)
    m_iters, slabs, k_iters = -(-760 // config.tile_m), n // (2 * config.tile_n), k // config.tile_k
    assert sk.num_teams(m_iters, slabs, 132) == min(22, slabs)
    plan = sk.plan(slabs, k_iters, teams)
    covered = np.zeros((slabs, k_iters), np.int32)
    for c, segs in enumerate(plan):
        assert sum(ke - kb for _, kb, ke in segs) >= k_iters  # a range holds a slab's worth
        for j, (t, kb, ke) in enumerate(segs):
            assert 0 <= kb < ke <= k_iters
            covered[t, kb:ke] += 1
            if kb > 0:  # a partial: the team's first segment, its slab owned by team c - 1
                assert j == 0 and plan[c - 1][-1] == (t, 0, kb)
            if ke < k_iters:  # a cut slab's owner: the team's last segment
                assert j == len(segs) - 1 and plan[c + 1][0] == (t, ke, k_iters)
    assert (covered == 1).all()
    assert sk.has_partials(slabs, k_iters, teams) == any(
        kb > 0 for segs in plan for _, kb, _ in segs)
    with pytest.raises(ValueError, match="teams"):
        x = jax.ShapeDtypeStruct((760, k), FP8)
        w = jax.ShapeDtypeStruct((2, n, k), FP8)
        jax.eval_shape(lambda x, w: sk.kernel(
            x, w, jnp.zeros((64, 64)), None, jnp.zeros((1,), jnp.int32), out_dtype=jnp.bfloat16,
            config=config, teams=slabs + 1), x, w)


@pytest.mark.parametrize("m,n,k,num_sms,config,with_addend,with_rows", [
    # 2 M x 3 N tiles (the second M tile partly past M), 6 K steps, 2 teams of 2 blocks
    (136, 768, 768, 4, st.Config(), False, False),
    # the addend, per-row scales of x (both pieces of a cut tile scaled)
    (136, 768, 768, 4, st.STREAM_K_CONFIG, True, True),
    # 1 M tile x 4 slabs of 4 K steps on 3 teams of one block: cut twice
    (120, 512, 512, 3, st.Config(tile_n=64, stages=4), False, False),
    (40, 256, 256, 2, st.Config(), False, False),  # one tile: one block, no cut
    (133, 768, 768, 4, st.STREAM_K_CONFIG, False, True),  # 133 scales for 136 rows (bounded)
])
def test_stream_k_in_interpreter_matches_reference(m, n, k, num_sms, config, with_addend,
                                                    with_rows):
    """The stream-K kernel under the Mosaic GPU interpreter, inside a scan over 2 layers:
    the one pipeline across tile boundaries, a cut tile's later piece stored by one block
    and the owner's piece added onto it by the previous team's block, the addend. (The
    interpreter runs blocks in turn, the pieces' writers first, without the semaphores,
    and adds by reading the piece.)"""
    seed = 19
    layers = 2
    x8, w8, scale = _operands(seed, m, n, k, layers)
    add = ((jax.random.normal(jax.random.key(seed + 1), (layers, m, n)) * 30).astype(jnp.bfloat16)
           if with_addend else None)
    rows = (jax.random.uniform(jax.random.key(seed + 2), (m,), minval=0.25, maxval=4.0)
            if with_rows else None)
    m_iters, slabs = -(-(-(-m // 8) * 8) // config.tile_m), n // (2 * config.tile_n)
    teams = sk.num_teams(m_iters, slabs, num_sms)
    assert sk.has_partials(slabs, k // config.tile_k, teams) == (teams > 1)

    @jax.jit
    def run(x8, w8, scale, add):
        def body(carry, layer):
            a = None if add is None else lax.dynamic_index_in_dim(add, layer, 0, keepdims=False)
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scale, impl="interpret",
                                                config=config, addend=a, num_sms=num_sms,
                                                row_scale=rows)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, scale, add)
    assert out.shape == (layers, m, n)
    for layer in range(layers):
        ref = _exact(x8, w8, layer, scale)
        if with_rows:
            unscaled = ref
            ref = ref * np.asarray(rows, np.float64)[:, None]
            assert _rel_err(out[layer], unscaled) > 0.1  # the rows' scales were applied
        if with_addend:
            ref = ref + np.asarray(add[layer], np.float64)
        assert np.isfinite(np.asarray(out[layer], np.float32)).all()
        assert _rel_err(out[layer], ref) < 4e-3, (seed, layer)


def test_stream_k_lowers_at_characters_57b_shapes():
    """The four tp = 2 projections with the 128 x 256 tiles, and 128 x 128 tiles with 4
    stages, 60 layers: lowered for CUDA within the shared memory (4 stages of 128 x 256
    tiles fit, the scale being a scalar; 5 do not), no weight slice."""
    # (Shared memory depends on the tiling, not on N or K: the other tiling at one shape.)
    for config, shapes in ((st.STREAM_K_CONFIG, ((13824, 9216), (9216, 4608), (16128, 9216),
                                                 (9216, 16128))),
                           (st.Config(tile_n=64, stages=4), ((16128, 9216),))):
        for n, k in shapes:
            text = _lower_scan("pallas", m=757, n=n, k=k, layers=60, config=config)
            assert "fp8_gemm_stream_k" in text and _weight_slices(text) == []
    # Per-row scales (512 bytes of shared memory more) at two tp = 4 shapes, the narrow
    # tiling at MLP-up's N = 8064 one of them: they still fit, and reach the kernel.
    for n, k in ((9216, 2304), (8064, 9216)):
        text = _lower_scan("pallas", m=757, n=n, k=k, layers=60, rows=True)
        call = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
        assert len(call) == 1 and "tensor<757xf32>" in call[0].rsplit(":", 1)[-1].split("->")[0]
    with pytest.raises(Exception, match="shared memory"):
        _lower_scan("pallas", n=9216, k=4608, config=st.Config(stages=5))


@pytest.mark.parametrize("m,n,k1,k,num_sms,config,with_rows,with_addend", [
    # 1 M tile x 4 slabs of 2 + 2 K steps on 3 teams: an owner's cut segment wholly in
    # lead's steps, a partial crossing from lead's steps to x's, one wholly in x's
    (120, 512, 256, 256, 3, st.NARROW_CONFIG, True, False),
    # 2 M tiles (133 real rows: the padding rows' scales are 0) x 3 slabs of 2 + 4 steps
    (133, 768, 256, 512, 4, st.STREAM_K_CONFIG, True, True),
    # per-tensor scales (a scalar ratio at the switch)
    (136, 768, 512, 256, 4, st.STREAM_K_CONFIG, False, False),
])
def test_lead_product_in_interpreter_matches_reference(m, n, k1, k, num_sms, config, with_rows,
                                                       with_addend):
    """A leading product (attention-out before MLP-down) in the same stream-K accumulator,
    under the interpreter in a scan over 2 layers: per-layer scale stacks of both, per-row
    scales of both (the accumulator rescaled where the K steps switch operands), the
    addend; against float64 with each product scaled by its own scales."""
    seed = 20
    layers = 2
    x8, w8, _ = _operands(seed, m, n, k, layers)
    lx8, lw8, _ = _operands(seed + 1, m, n, k1, layers)
    keys = jax.random.split(jax.random.key(seed + 2), 5)
    scales = jax.random.uniform(keys[0], (layers,), minval=0.5, maxval=2.0) / 4096
    lscales = jax.random.uniform(keys[1], (layers,), minval=4.0, maxval=16.0) / 4096
    rows = lrows = None
    if with_rows:  # lead's rows ~30x x's: the switch's rescale matters
        rows = jax.random.uniform(keys[2], (m,), minval=0.1, maxval=1.0)
        lrows = jax.random.uniform(keys[3], (m,), minval=3.0, maxval=30.0)
    add = ((jax.random.normal(keys[4], (layers, m, n)) * 30).astype(jnp.bfloat16)
           if with_addend else None)

    @jax.jit
    def run(x8, w8, lx8, lw8, add):
        def body(carry, layer):
            a = None if add is None else add[layer]
            lead = st.Product(lx8, lw8, lscales, lrows)
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scales, impl="interpret",
                                                config=config, addend=a, num_sms=num_sms,
                                                row_scale=rows, lead=lead)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, lx8, lw8, add)
    r = np.ones(m) if rows is None else np.asarray(rows, np.float64)
    lr = np.ones(m) if lrows is None else np.asarray(lrows, np.float64)
    for layer in range(layers):
        main = _exact(x8, w8, layer, scales[layer]) * r[:, None]
        first = _exact(lx8, lw8, layer, lscales[layer]) * lr[:, None]
        want = main + first + (0 if add is None else np.asarray(add[layer], np.float64))
        assert np.isfinite(np.asarray(out[layer], np.float32)).all(), seed
        assert _rel_err(out[layer], want) < 4e-3, (seed, layer)
        # Without lead's product (or with it unscaled) the error would be 10x the bound.
        assert np.linalg.norm(first) > 0.04 * np.linalg.norm(want)
    # The reference path agrees (it is what 'auto' runs on the CPU).
    ref = st.stacked_fp8_matmul(x8, w8, 1, scales, row_scale=rows, impl="reference",
                                addend=None if add is None else add[1],
                                lead=st.Product(lx8, lw8, lscales, lrows))
    assert _rel_err(ref, np.asarray(out[1], np.float64)) < 4e-3


def test_lead_product_is_checked():
    x8, w8 = jnp.zeros((64, 256), FP8), jnp.zeros((2, 256, 256), FP8)
    ok = st.Product(jnp.zeros((64, 128), FP8), jnp.zeros((2, 256, 128), FP8), jnp.ones((2,)))
    for bad, match in ((ok._replace(x=jnp.zeros((32, 128), FP8)), "rows"),
                       (ok._replace(w=jnp.zeros((2, 512, 128), FP8)), "N"),
                       (ok._replace(row_scale=jnp.ones((64,))), "per-row")):
        with pytest.raises(ValueError, match=match):
            st.stacked_fp8_matmul(x8, w8, 0, jnp.ones((2,)), lead=bad, impl="interpret")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lead_product_lowers_at_characters_57b_shapes(tp):
    """attention-out (K1 = 9216 / tp) leading MLP-down (K = 32256 / tp), per-row scales of
    both and the [60] scale stacks, lowered for CUDA in a scan: one Mosaic call that takes
    both weight stacks whole, nothing sliced (the one-accumulator path: run_state)."""
    k1, k, n = 9216 // tp, 32256 // tp, 9216

    def run(x8, w8, lx8, lw8, scales, rows):
        def body(carry, layer):
            y = st.stacked_fp8_matmul(x8, w8, layer, scales, impl="pallas", row_scale=rows,
                                      lead=st.Product(lx8, lw8, scales, rows))
            return carry + y[0, 0].astype(jnp.float32), None
        return lax.scan(body, jnp.float32(0), jnp.arange(60, dtype=jnp.int32))[0]

    f8 = lambda *s: jax.ShapeDtypeStruct(s, FP8)  # noqa: E731
    text = jax.jit(run).trace(
        f8(757, k), f8(60, n, k), f8(757, k1), f8(60, n, k1),
        jax.ShapeDtypeStruct((60,), jnp.float32), jax.ShapeDtypeStruct((757,), jnp.float32),
    ).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    assert len(calls) == 1
    operands = calls[0].rsplit(":", 1)[-1].split("->")[0]
    assert f"tensor<60x{n}x{k}xf8E4M3FN>" in operands and f"tensor<60x{n}x{k1}xf8E4M3FN>" in operands
    assert _weight_slices(text) == []


@pytest.mark.gpu
@pytest.mark.parametrize("with_rows", [True, False], ids=["per_row", "per_tensor"])
@pytest.mark.parametrize("k1,k", [(2304, 8064), (4608, 16128)], ids=["tp4", "tp2"])
def test_lead_product_on_gpu_inside_scan(with_rows, k1, k):
    """attention-out leading MLP-down at the characters-57b per-GPU shapes (N 9216, M 757),
    3 layers in a scan, on the GPU (the one-accumulator path: run_state, the rescale at the
    switch), against float64 with each product's own scales; memory poisoned with NaN."""
    if not st.is_supported():
        pytest.skip("needs an NVIDIA Hopper GPU")
    seed = 21
    m, n, layers = 757, 9216, 3
    x8, w8, _ = _operands(seed, m, n, k, layers)
    lx8, lw8, _ = _operands(seed + 1, m, n, k1, layers)
    keys = jax.random.split(jax.random.key(seed + 2), 4)
    scales = jax.random.uniform(keys[0], (layers,), minval=0.5, maxval=2.0) / 65536
    lscales = jax.random.uniform(keys[1], (layers,), minval=4.0, maxval=16.0) / 65536
    rows = jax.random.uniform(keys[2], (m,), minval=0.1, maxval=1.0) if with_rows else None
    lrows = jax.random.uniform(keys[3], (m,), minval=3.0, maxval=30.0) if with_rows else None
    jax.device_put(jnp.full((256 << 20,), jnp.nan, jnp.float32)).block_until_ready()

    @jax.jit
    def run(x8, w8, lx8, lw8):
        def body(carry, layer):
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scales, impl="pallas",
                                                row_scale=rows,
                                                lead=st.Product(lx8, lw8, lscales, lrows))
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    @jax.jit
    def run_chained(x8, w8, lx8, lw8):
        def body(carry, layer):
            o = st.stacked_fp8_matmul(lx8, lw8, layer, lscales, impl="pallas", row_scale=lrows)
            return carry, st.stacked_fp8_matmul(x8, w8, layer, scales, impl="pallas",
                                                row_scale=rows, addend=o)
        return lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    out = run(x8, w8, lx8, lw8)
    assert np.isfinite(np.asarray(out, np.float32)).all(), seed
    chained = run_chained(x8, w8, lx8, lw8)
    r = np.ones(m) if rows is None else np.asarray(rows, np.float64)
    lr = np.ones(m) if lrows is None else np.asarray(lrows, np.float64)
    for layer in range(layers):
        want = (_exact(x8, w8, layer, scales[layer]) * r[:, None]
                + _exact(lx8, lw8, layer, lscales[layer]) * lr[:, None])
        # One K loop of K1 + K steps: at tp=2 (20,736) the error measured 4.3-5.1e-3 on an
        # H200 (single GEMMs: 2.5-3.5e-3; the FP8 wgmma's accumulation over more steps
        # onto lead's larger sum). Bounded by the chained form's on the same data;
        # a wrong or missing tile, or an unscaled lead, gives >= 5e-2.
        err, err_chained = _rel_err(out[layer], want), _rel_err(chained[layer], want)
        print(f"layer {layer}: joined {err:.2e}, chained {err_chained:.2e}")
        assert err < min(8e-3, max(4e-3, 2.0 * err_chained)), (seed, layer, err, err_chained)
