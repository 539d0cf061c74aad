"""The fused norm + modulation + per-row FP8 quantization: kernel (interpreter on CPU, GPU)
against its reference (the model's own math), the reference against a float64 emulation,
the CUDA lowering, and the block and engine wiring."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from characters_jax.model.dit import modulated_norm
from pallas_kernels import fp8_row_quantize as rq

EPS = 1e-6


def _inputs(seed, m, d, dtype=jnp.bfloat16):
    """x [m, d] with rows spanning 10^-3 .. 10 in size, adaLN shift/scale [d]."""
    kx, ks, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, d)) * jnp.logspace(-3, 1, m)[:, None]
    return (x.astype(dtype), jax.random.normal(ks, (d,)) * 0.1,
            jax.random.normal(kg, (d,)) * 0.1)


def _assert_close_to_reference(q, s, rq_, rs_, m, seed):
    """Scales to float32 rounding, e4m3 values equal but for rare one-step roundings (the
    kernel sums a row's squares chunk by chunk, XLA in its own order), every real row
    reaching the top of e4m3, padding rows zero."""
    q32, r32 = np.asarray(q, np.float32), np.asarray(rq_, np.float32)
    np.testing.assert_allclose(np.asarray(s), np.asarray(rs_), rtol=1e-6, err_msg=str(seed))
    assert (q32 != r32).mean() < 1e-3, seed
    np.testing.assert_allclose(q32, r32, rtol=0.13, atol=2 ** -9, err_msg=str(seed))
    np.testing.assert_allclose(np.abs(q32[:m]).max(1), 448.0)
    assert not q32[m:].any() and not np.asarray(s)[m:].any()


# Layouts: the default; one chunk of the row's next power of two (the first version); two
# rows per program with chunks smaller than the row, the last one masked.
LAYOUTS = [rq.DEFAULT_LAYOUT, rq.Layout(1, None, 8), rq.Layout(2, 64, 4)]
LAYOUT_IDS = ["default", "one_chunk", "two_rows"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("m,d,rows_out", [(37, 200, 40), (16, 128, 16)])
def test_kernel_in_interpreter_matches_reference(m, d, rows_out, layout):
    """Under the Pallas interpreter: the reference's values, padding rows zero with scale
    0, D not a power of two (masked lanes)."""
    seed = 301
    x, shift, scale = _inputs(seed, m, d)
    q, s = jax.jit(lambda x, a, b: rq.row_quantize(
        x, a, b, prologue="norm", eps=EPS, rows_out=rows_out, impl="interpret", layout=layout))(x, shift, scale)
    rq_, rs_ = rq.reference(x, shift, scale, eps=EPS, rows_out=rows_out)
    assert q.shape == (rows_out, d) and q.dtype == jnp.float8_e4m3fn and s.shape == (rows_out,)
    _assert_close_to_reference(q, s, rq_, rs_, m, seed)


@pytest.mark.parametrize("prologue", ["gelu", "none"])
@pytest.mark.parametrize("layout", LAYOUTS[::2], ids=LAYOUT_IDS[::2])
def test_gelu_and_plain_prologues_in_interpreter(prologue, layout):
    """The MLP hidden (GELU of up's output, whose rows past M are padding and not read:
    here NaN) and a plain activation, against the model's math."""
    seed = 302
    m, d, rows_y, rows_out = 37, 200, 40, 40
    y = (jax.random.normal(jax.random.key(seed), (rows_y, d)) * 3).astype(jnp.bfloat16)
    y = y.at[m:].set(jnp.nan)
    q, s = jax.jit(lambda y: rq.row_quantize(y, prologue=prologue, rows=m, rows_out=rows_out,
                                             impl="interpret", layout=layout))(y)
    rq_, rs_ = rq.reference(y, rows=m, rows_out=rows_out, prologue=prologue)
    assert q.shape == (rows_out, d) and s.shape == (rows_out,)
    assert np.isfinite(np.asarray(s)).all()
    _assert_close_to_reference(q, s, rq_, rs_, m, seed)
    if prologue == "gelu":  # GELU's negative lobe: no value below -0.17 * scale
        from characters_jax.model.dit import mlp_hidden
        h = np.asarray(mlp_hidden(y[:m]), np.float32)
        assert h.min() > -0.171 and (np.asarray(q[:m], np.float32) < 0).any()


def test_bad_input_is_rejected():
    x, shift, scale = _inputs(0, 8, 64)
    with pytest.raises(ValueError, match="rows_out"):
        rq.row_quantize(x, shift, scale, prologue="norm", eps=EPS, rows_out=4)
    with pytest.raises(ValueError, match="shift"):
        rq.row_quantize(x, shift[:10], scale, prologue="norm", eps=EPS)
    with pytest.raises(ValueError, match="impl"):
        rq.row_quantize(x, shift, scale, prologue="norm", eps=EPS, impl="cuda")
    with pytest.raises(ValueError, match="prologue"):
        rq.row_quantize(x, prologue="silu")
    with pytest.raises(ValueError, match="'norm' prologue"):
        rq.row_quantize(x, shift, scale, prologue="gelu")
    with pytest.raises(ValueError, match="rows="):
        rq.row_quantize(x, prologue="gelu", rows=9)
    with pytest.raises(ValueError, match="power of two"):
        rq.Layout(rows_per_program=3)
    assert rq.row_quantize(x, shift, scale, prologue="norm", eps=EPS)[0].shape == (8, 64)  # auto on CPU


@pytest.mark.parametrize("prologue,rows_in,d,layout,grid", [
    ("norm", 757, 9216, rq.DEFAULT_LAYOUT, 760),
    ("norm", 757, 9216, rq.Layout(4, 1024, 8), 190),
    ("gelu", 760, 8064, rq.DEFAULT_LAYOUT, 760),  # tp=4's MLP hidden, read from up's 760 rows
    ("none", 757, 2304, rq.DEFAULT_LAYOUT, 760)])  # tp=4's attention output
def test_lowers_for_cuda_as_one_triton_kernel(monkeypatch, prologue, rows_in, d, layout, grid):
    """At characters-57b's shapes (757 rows -> 760): one Triton custom call, a program per
    rows_per_program output rows (the Triton lowering asks for the GPU's info: an H100's is
    given)."""
    import jax.experimental.pallas.triton as plt
    from jax._src.pallas.triton import pallas_call_registration as reg

    info = plt.get_gpu_info_from_version(plt.GpuVersion.H100)
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: info)
    args = [jax.ShapeDtypeStruct((rows_in, d), jnp.bfloat16)]
    if prologue == "norm":
        args += [jax.ShapeDtypeStruct((d,), jnp.float32)] * 2
    text = jax.jit(lambda x, *ab: rq.row_quantize(
        x, *ab, prologue=prologue, eps=EPS, rows=757, rows_out=760, impl="pallas",
        layout=layout)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 1 and "triton" in calls[0] and f"grid_x = {grid}" in calls[0]
    assert f"tensor<760x{d}xf8E4M3FN>" in calls[0] and "tensor<760xf32>" in calls[0]


def test_block_with_the_kernels_as_its_inputs(monkeypatch):
    """A characters Block with FP8 weights and per-row scales, as a one-device prefill runs it:
    with the 'quant' kernels making its GEMMs' inputs (``KernelOps``; the kernels under the
    interpreter, 21 -> 24 padded rows, sliced off after the GEMMs and the reduction) it gives
    the output of XLA's fusions (``ReferenceOps``), within FP8's rounding."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from characters_jax.cache import kv_cache as kvc
    from characters_jax.config import ModelConfig
    from characters_jax.engine.block_ops import KernelOps, ReferenceOps, frame_context
    from characters_jax.model.dit import Block
    from characters_jax.model.rope import rope_frequencies
    from characters_jax.parallel.sharding import make_mesh

    cfg = ModelConfig(d_model=64, num_heads=2, head_dim=16, mlp_dim=128, weight_dtype="fp8",
                      dtype="bfloat16", activation_scale="row")
    block = Block(cfg, rngs=nnx.Rngs(303))
    t = 21
    layout = kvc.CacheLayout(mode="ring", dtype="fp8", num_blocks=1, num_heads=2, head_dim=16,
                             sink_slots=t, tokens_per_step=t, ring_frames=1)
    freqs = rope_frequencies(16, cfg.rope_split, cfg.rope_theta)
    positions = jnp.stack([jnp.zeros(t, jnp.int32), jnp.arange(t) // 5, jnp.arange(t) % 5], 1)
    valid = jnp.arange(layout.slots) < t
    frame = frame_context(positions, jnp.int32(0), valid, jnp.zeros((layout.slots, 3), jnp.int32),
                          freqs, token_valid=jnp.ones((t,), bool))
    x = jax.random.normal(jax.random.key(304), (t, 64)).astype(jnp.bfloat16)
    shared = jax.random.normal(jax.random.key(3), (3, 64)) * 0.1
    common = dict(layout=layout, freqs=freqs, attention_impl="reference", reduce_method="psum",
                  out_dtype="bfloat16", act_scale="row", prefill=True)

    def run(ops):
        body = lambda x, shared, cache, frame: block(x, shared, ops, cache, frame, jnp.int32(0))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=make_mesh(1), in_specs=P(), out_specs=P(),
                                     check_vma=False))(x, shared, kvc.empty_cache(layout), frame)

    real, prologues = rq._pallas, []
    monkeypatch.setattr(rq, "_pallas", lambda *a, **k: prologues.append(k["prologue"]) or real(
        *a, **{**k, "interpret": True}))
    base, base_cache = run(ReferenceOps(**common))
    assert not prologues
    fused, fused_cache = run(KernelOps(**common, quant=True))
    assert prologues == ["norm", "gelu", "none"]
    assert fused.shape == base.shape == (t, 64)
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(base, np.float32),
                               rtol=2e-2, atol=2e-2)
    assert np.asarray(fused - x, np.float32).any()
    for a, b in ((fused_cache.k_scale, base_cache.k_scale), (fused_cache.v_scale, base_cache.v_scale)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2)


def test_engine_kernel_resolution():
    """engine.kernels: 'auto' takes the 'quant' kernels where they apply (FP8 weights with
    per-row activation scales) and run (an NVIDIA GPU with the e4m3 conversion); named
    where they cannot, a ConfigError says what is missing; 'none' turns them off."""
    from characters_jax.config import ConfigError, load_config
    from characters_jax.engine.options import resolve_engine

    tiny = load_config("tiny")
    row = tiny.replace(model={"weight_dtype": "fp8", "activation_scale": "row"})
    assert resolve_engine(row).quant == rq.is_supported()
    assert not resolve_engine(tiny.replace(model={"weight_dtype": "fp8"})).quant
    assert not resolve_engine(row.replace(engine={"kernels": "none"})).quant
    with pytest.raises(ConfigError, match="activation_scale"):
        resolve_engine(tiny.replace(model={"weight_dtype": "fp8"}, engine={"kernels": "quant"}))
    if not rq.is_supported():
        with pytest.raises(ConfigError, match="compute capability"):
            resolve_engine(row.replace(engine={"kernels": "quant"}))


def _host_emulation(x, shift, scale, eps=EPS):
    """float64 on the host with the program's two bf16 roundings (the norm's and h's):
    (values [M, D] float32 on the e4m3 grid, scales [M])."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    xf = np.asarray(x, np.float64)
    rstd = 1.0 / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps)
    normed = (xf * rstd).astype(bf16).astype(np.float64)
    h = (normed * (1.0 + np.asarray(scale, np.float64)) + np.asarray(shift, np.float64))
    h = h.astype(bf16).astype(np.float64)
    s = np.maximum(np.abs(h).max(-1), rq.AMAX_FLOOR) / rq.FP8_MAX
    q = np.clip(h / s[:, None], -rq.FP8_MAX, rq.FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32), s


def test_host_emulation_is_the_reference():
    """The host emulation the GPU test trusts agrees with the CPU reference (bit for bit but
    for rare one-step roundings of float32 vs float64)."""
    x, shift, scale = _inputs(305, 33, 200)
    q, s = rq.reference(x, shift, scale, eps=EPS)
    hq, hs = _host_emulation(x, shift, scale)
    assert (np.abs(np.asarray(s) / hs - 1) > 1e-6).mean() < 0.1
    assert (np.asarray(q, np.float32) != hq).mean() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [rq.DEFAULT_LAYOUT, rq.Layout(1, None, 8),
                                    rq.Layout(4, 1024, 8)],
                         ids=["default", "one_chunk", "four_rows"])
@pytest.mark.parametrize("m,d", [(757, 9216), (40, 2304)])
def test_kernel_on_gpu_matches_reference(m, d, layout):
    """On the GPU at the model's shape, NaN-poisoned memory first, against the host's float64
    emulation of the program (the norm and h rounded to bf16, as written): scales and e4m3
    values equal but for rare one-step roundings. XLA's own GPU program is not the yardstick
    here: it keeps float32 where the program rounds to bf16 (excess precision), so its
    scales differ by up to ~1%; that is checked loosely."""
    if not rq.is_supported():
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9+")
    seed = 306
    x, shift, scale = _inputs(seed, m, d)
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()
    rows_out = -(-m // 8) * 8
    q, s = jax.jit(lambda x, a, b: rq.row_quantize(
        x, a, b, prologue="norm", eps=EPS, rows_out=rows_out, impl="pallas", layout=layout))(x, shift, scale)
    q32, s32 = np.asarray(q, np.float32), np.asarray(s, np.float64)
    assert np.isfinite(q32).all() and np.isfinite(s32).all(), seed
    assert not q32[m:].any() and not s32[m:].any()
    hq, hs = _host_emulation(x, shift, scale)
    assert (np.abs(s32[:m] / hs - 1) > 1e-6).mean() < 0.02, seed
    assert (q32[:m] != hq).mean() < 2e-3, seed
    _, xla_s = jax.jit(lambda x, a, b: rq.reference(x, a, b, eps=EPS))(x, shift, scale)
    np.testing.assert_allclose(s32[:m], np.asarray(xla_s), rtol=1.5e-2, err_msg=str(seed))
    deq = q32[:m] * s32[:m, None]
    ref = np.asarray(modulated_norm(x, shift, scale, EPS), np.float64)
    for r in (0, m // 2, m - 1):
        assert np.linalg.norm(deq[r] - ref[r]) / np.linalg.norm(ref[r]) < 5e-2, (seed, r)


@pytest.mark.gpu
@pytest.mark.parametrize("prologue,d", [("gelu", 8064), ("gelu", 16128), ("none", 2304)])
@pytest.mark.parametrize("layout", [rq.DEFAULT_LAYOUT, rq.Layout(4, 1024, 8)],
                         ids=["default", "four_rows"])
def test_gelu_and_plain_prologues_on_gpu(prologue, d, layout):
    """The MLP hidden from up's 760-row output (its padding rows NaN, never read) and the
    attention output, on the GPU against a float64 host emulation (GELU rounded to bf16)."""
    import ml_dtypes

    if not rq.is_supported():
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9+")
    seed = 307
    m, rows_out = 757, 760
    y = (jax.random.normal(jax.random.key(seed), (rows_out, d)) * 3).astype(jnp.bfloat16)
    y = y.at[m:].set(jnp.nan)
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()
    q, s = jax.jit(lambda y: rq.row_quantize(y, prologue=prologue, rows=m, rows_out=rows_out,
                                             impl="pallas", layout=layout))(y)
    q32, s32 = np.asarray(q, np.float32), np.asarray(s, np.float64)
    assert np.isfinite(q32).all() and np.isfinite(s32).all(), seed
    assert not q32[m:].any() and not s32[m:].any()
    h = np.asarray(y[:m], np.float64)
    if prologue == "gelu":
        h = h * 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        h = h.astype(ml_dtypes.bfloat16).astype(np.float64)
    hs = np.maximum(np.abs(h).max(-1), rq.AMAX_FLOOR) / rq.FP8_MAX
    hq = np.clip(h / hs[:, None], -rq.FP8_MAX, rq.FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    assert (np.abs(s32[:m] / hs - 1) > 1e-6).mean() < 0.02, seed
    # The GPU's tanh differs from float64's in the last float32 bits: a bf16 rounding of
    # GELU flips now and then, and an e4m3 value with it (0.23% of them in one GELU run
    # at 8064): each by one e4m3 step at most.
    hq32 = hq.astype(np.float32)
    assert (q32[:m] != hq32).mean() < (5e-3 if prologue == "gelu" else 2e-3), seed
    assert (np.abs(q32[:m] - hq32) <= 0.126 * np.abs(hq32) + 2.0 ** -9).all(), seed


def test_engine_step_with_the_kernel_matches_xla(monkeypatch, engine_latents):
    """The engine's 'quant' kernels (all three), prefill and steps at tp=2
    (the kernels under the interpreter in place of the GPU, inside the step's shard_map,
    their padded FP8 rows through the row-parallel reduction): the same latents as
    XLA's per-row quantization, to FP8 rounding (the kernel rounds the norm to bf16 as the
    program says; XLA's CPU code does too, so they agree closely)."""
    from characters_jax.config import load_config

    cfg = load_config("tiny").replace(model={"weight_dtype": "fp8", "dtype": "bfloat16",
                                             "activation_scale": "row"})
    gen, xla = engine_latents(cfg.replace(engine={"kernels": "none"}))
    assert not gen.engine.options.quant
    monkeypatch.setattr(rq, "is_supported", lambda: True)
    real_pallas = rq._pallas
    monkeypatch.setattr(rq, "_pallas", lambda *a, **k: real_pallas(*a, **{**k, "interpret": True}))
    gen, fused = engine_latents(cfg.replace(engine={"kernels": "quant"}))
    assert gen.engine.options.quant
    assert np.isfinite(fused).all()
    diff = np.linalg.norm(fused - xla) / np.linalg.norm(xla)
    print(f"kernel vs XLA block input: {diff:.2e}")
    assert diff < 1e-3
