"""The fused qkv -> (Q's e4m3 parts, the cache's new K/V rows) kernel: under the
interpreter against a float64 emulation of the program's roundings and against the model's
code, the CUDA lowering (one Triton call, the caches aliased), the GPU, and the engine."""

import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from characters_jax.model.rope import rope_angles, rope_frequencies
from pallas_kernels import fp8_qkv_prepare as qp

F8 = jnp.float8_e4m3fn
EPS = 1e-6


def _problem(seed, t=21, ty=24, heads=3, d=128, layers=2, slots=64, offset=30, layer=1):
    ks = jax.random.split(jax.random.key(seed), 7)
    qkv = (jax.random.normal(ks[0], (ty, heads * 3 * d)) * 2).astype(jnp.bfloat16)
    qkv = qkv.at[t:].set(jnp.nan)  # padding rows: never read
    gains = 1 + 0.1 * jax.random.normal(ks[1], (2, d))
    pos = jax.random.randint(ks[2], (t, 3), 0, 40)
    cos, sin = rope_angles(pos, rope_frequencies(d, (16, 24, 24), 10000.0))
    k_scale = jax.random.uniform(ks[3], (heads,), minval=0.02, maxval=0.04)
    v_scale = jax.random.uniform(ks[4], (heads,), minval=0.005, maxval=0.02)
    ck = (jax.random.normal(ks[5], (layers, slots, heads, d)) * 50).astype(F8)
    cv = (jax.random.normal(ks[6], (layers, slots, heads, d)) * 50).astype(F8)
    return (qkv, gains[0], gains[1], cos, sin, k_scale, v_scale, ck, cv, jnp.int32(layer),
            jnp.int32(offset)), dict(t=t, heads=heads, eps=EPS)


def _emulation(qkv, q_gain, k_gain, cos, sin, k_scale, v_scale, t, heads):
    """float64 on the host with the program's bf16 roundings (norm, gain product, rotation):
    (Q's dequantized value [t, H, D], row scales [t, H], K and V e4m3 as float32)."""
    bf16 = ml_dtypes.bfloat16
    rnd = lambda a: a.astype(bf16).astype(np.float64)  # noqa: E731
    d = cos.shape[1] * 2
    x = np.asarray(qkv[:t], np.float64).reshape(t, heads, 3, d)
    c, s = (np.asarray(a, np.float64)[:, None, :] for a in (cos, sin))

    def norm_rope(y, gain):
        rstd = 1 / np.sqrt((y * y).mean(-1, keepdims=True) + EPS)
        g = rnd(rnd(y * rstd) * rnd(np.asarray(gain, np.float64)))
        a, b = g[..., : d // 2], g[..., d // 2:]
        return np.concatenate([rnd(a * c - b * s), rnd(a * s + b * c)], -1)

    q, k, v = norm_rope(x[:, :, 0], q_gain), norm_rope(x[:, :, 1], k_gain), x[:, :, 2]
    rs = np.maximum(np.abs(q).max(-1), 1e-30) / 448.0
    e4 = lambda a: np.clip(a, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # noqa: E731
    return (q, rs, e4(k / np.asarray(k_scale, np.float64)[:, None]),
            e4(v / np.asarray(v_scale, np.float64)[:, None]))


def _check(out, args, kw, seed, tol_frac=2e-3, loose=False):
    """Against the emulation: Q's scales (exactly but for rare float32 differences; within
    a bf16 step if loose), Q to its two-part e4m3 precision, the new K/V rows, and every
    other cache row untouched."""
    q8, ck, cv = out
    qkv, qg, kg, cos, sin, k_scale, v_scale, ck0, cv0, layer, offset = args
    t, heads = kw["t"], kw["heads"]
    q, rs, k8, v8 = _emulation(qkv, qg, kg, cos, sin, k_scale, v_scale, t, heads)
    got_rs = np.asarray(q8.row_scale, np.float64)
    assert np.isfinite(got_rs).all(), seed
    if loose:
        np.testing.assert_allclose(got_rs, rs, rtol=1e-2, err_msg=str(seed))
    else:
        assert (np.abs(got_rs / rs - 1) > 1e-6).mean() < 0.05, seed
    deq = np.asarray(q8.dequantize(), np.float64)
    err = np.abs(deq - q).max() / np.abs(q).max()
    assert err <= (2 ** -5 if loose else 2 ** -7), (seed, err)  # hi + lo: ~2^-8 each
    lo, hi = int(offset), int(offset) + t
    # K is rotated: a one-ulp flip of a bf16 input (|a| <= sqrt(2) x the head's largest
    # rotated value) moves a cancelling a*c - b*s by up to 2^-7 x sqrt(2) of the head's
    # largest value, far beyond its own rtol when the result is small. V is only scaled.
    k_atol = 2.0 ** -6 * np.abs(k8).max(-1, keepdims=True)
    for got, old, want, atol in ((ck, ck0, k8, k_atol), (cv, cv0, v8, 0.0)):
        g, o = np.asarray(got, np.float32), np.asarray(old, np.float32)
        new = g[int(layer), lo:hi]
        assert (new != want).mean() < tol_frac, seed
        bound = 0.13 * np.abs(want) + np.maximum(atol, 0.5 if loose else 0.0)
        bad = np.abs(new - want) > bound
        assert not bad.any(), (seed, np.argwhere(bad)[:4], new[bad][:4], want[bad][:4])
        rest = np.ones(g.shape[:2], bool)
        rest[int(layer), lo:hi] = False
        np.testing.assert_array_equal(g[rest], o[rest])  # nothing else written


@pytest.mark.parametrize("heads_per_program", [32, 2], ids=["one_group", "two_groups"])
def test_kernel_in_interpreter_matches_the_programs_roundings(monkeypatch, heads_per_program):
    """3 heads in one program, or in groups of 2 (the second group half masked); the
    layer's scales given as they are, or as [L, H] stacks read at the layer."""
    monkeypatch.setattr(qp, "HEADS_PER_PROGRAM", heads_per_program)
    seed = 201
    args, kw = _problem(seed)
    out = jax.jit(lambda *a: qp.prepare_qkv(*a, impl="interpret", **kw))(*args)
    _check(out, args, kw, seed)
    assert out[0].shape == (21, 3, 128) and len(out[0].parts) == 2
    layer = int(args[9])
    stacks = [jnp.zeros((2, 3)).at[layer].set(a) + jnp.zeros((2, 3)).at[1 - layer].set(9.0)
              for a in args[5:7]]  # the other layer's scales: wrong on purpose
    out2 = jax.jit(lambda *a: qp.prepare_qkv(*a, impl="interpret", **kw))(
        *args[:5], *stacks, *args[7:])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out2)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_attention_scales_written_with_q(impl):
    """With any_valid, Q comes with the attention kernel's scales operand [H, 2, Tq']:
    ``fp8_attention.attention_scales`` of its own row scales and the layer's K/V scales
    (read from the [L, H] stacks), the kernel's bit for bit, its padding columns (107 of 128 here: more
    than one per token) zero; Q's parts and the caches as without it."""
    from pallas_kernels.fp8_attention import attention_scales

    seed = 202
    args, kw = _problem(seed)
    layer = int(args[9])
    stacks = [jnp.full((2, 3), 9.0).at[layer].set(a) for a in args[5:7]]
    args = (*args[:5], *stacks, *args[7:])
    plain = jax.jit(lambda *a: qp.prepare_qkv(*a, impl=impl, **kw))(*args)
    for any_valid in (1.0, 0.0):
        out = jax.jit(lambda *a: qp.prepare_qkv(*a, impl=impl, any_valid=jnp.float32(any_valid),
                                                **kw))(*args)
        want = attention_scales(out[0].row_scale, args[5][layer], args[6][layer],
                                jnp.float32(any_valid), 128)
        got = np.asarray(out[0].scales)
        assert got.shape == (3, 2, 128) and np.isfinite(got).all()
        # The kernel bit for bit; XLA may reassociate the reference's products (one ulp).
        np.testing.assert_allclose(got, np.asarray(want), rtol=0 if impl == "interpret" else 2.4e-7,
                                   atol=0, err_msg=str(seed))
        assert not got[:, :, 21:].any() and (got[:, 1, :21] != 0).all() == bool(any_valid)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(dataclasses.replace(out[0], scales=None))
                        + list(out[1:])):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_attention_takes_the_scales_q_carries():
    """The attention's operand preparation uses a QuantizedQ's scales as they are (no XLA
    op of its own), equal to what it makes without them; a wrong shape is refused."""
    from pallas_kernels import fp8_attention as fa
    from pallas_kernels.fp8_attention import operands

    q = jax.random.normal(jax.random.key(203), (37, 2, 128))
    ks, vs = jnp.array([0.03, 0.02]), jnp.array([0.01, 0.02])
    valid = jnp.arange(256) < 200
    q8 = fa.quantize_q(q)
    made = operands.prepare_operands(q8, ks, vs, valid, 128)[1]
    carried = dataclasses.replace(q8, scales=fa.attention_scales(q8.row_scale, ks, vs, 1.0, 128))
    np.testing.assert_array_equal(np.asarray(made), np.asarray(carried.scales))
    jaxpr = jax.make_jaxpr(lambda s: operands.prepare_operands(
        dataclasses.replace(q8, scales=s), ks, vs, fa.slot_mask(valid), 128)[1])(
            carried.scales)
    assert jaxpr.jaxpr.outvars[0] is jaxpr.jaxpr.invars[0]  # passed through untouched
    with pytest.raises(ValueError, match="scales"):
        operands.prepare_operands(dataclasses.replace(q8, scales=carried.scales[:, :, :64]),
                                  ks, vs, valid, 128)


def test_reference_is_the_models_code_close_to_the_kernel():
    """The reference (the model's and cache's own functions) agrees with the kernel but for
    the bf16 roundings XLA's CPU code may skip (excess precision)."""
    seed = 204
    args, kw = _problem(seed, heads=2, offset=0, layer=0)
    ref = jax.jit(lambda *a: qp.prepare_qkv(*a, impl="reference", **kw))(*args)
    out = jax.jit(lambda *a: qp.prepare_qkv(*a, impl="interpret", **kw))(*args)
    _check(ref, args, kw, seed, tol_frac=0.05, loose=True)
    np.testing.assert_allclose(np.asarray(out[0].dequantize()), np.asarray(ref[0].dequantize()),
                               rtol=2e-2, atol=2e-2 * float(jnp.abs(ref[0].dequantize()).max()))


def test_bad_input_is_rejected():
    args, kw = _problem(0)
    with pytest.raises(ValueError, match="impl"):
        qp.prepare_qkv(*args, impl="cuda", **kw)
    with pytest.raises(ValueError, match="qkv"):
        qp.prepare_qkv(args[0][:, :100], *args[1:], **kw)
    with pytest.raises(ValueError, match="caches"):
        qp.prepare_qkv(*args[:7], args[7].astype(jnp.bfloat16), *args[8:], **kw)
    with pytest.raises(ValueError, match="k_scale"):
        qp.prepare_qkv(*args[:5], args[5][:2], *args[6:], **kw)
    with pytest.raises(ValueError, match="cos"):
        qp.prepare_qkv(*args[:3], args[3][:5], *args[4:], **kw)


@pytest.mark.parametrize("h,groups", [(18, 1), (72, 3)])
def test_lowers_for_cuda_as_one_triton_kernel_updating_the_caches_in_place(monkeypatch, h,
                                                                            groups):
    """At tp=4's shapes (757 tokens of 760 rows, 18 heads, a 60-layer cache) and tp=1's 72
    heads: one Triton call, a program per token and group of 32 heads, both caches aliased
    to its outputs."""
    import jax.experimental.pallas.triton as plt
    from jax._src.pallas.triton import pallas_call_registration as reg

    info = plt.get_gpu_info_from_version(plt.GpuVersion.H100)
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: info)
    t, d, cache = 757, 128, (60, 5788, h, 128)
    s = jax.ShapeDtypeStruct
    args = (s((760, h * 3 * d), jnp.bfloat16), s((d,), jnp.float32), s((d,), jnp.float32),
            s((t, d // 2), jnp.float32), s((t, d // 2), jnp.float32), s((h,), jnp.float32),
            s((h,), jnp.float32), s(cache, F8), s(cache, F8), s((), jnp.int32), s((), jnp.int32))
    text = jax.jit(lambda *a: qp.prepare_qkv(*a, t=t, heads=h, eps=EPS, impl="pallas"),
                   donate_argnums=(7, 8)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # The engine's form: the cache's [L, H] scale stacks, read at the layer in the kernel.
    stacks = (s((60, h), jnp.float32),) * 2
    text2 = jax.jit(lambda *a: qp.prepare_qkv(*a, t=t, heads=h, eps=EPS, impl="pallas"),
                    donate_argnums=(7, 8)).trace(*args[:5], *stacks, *args[7:]).lower(
                        lowering_platforms=("cuda",)).as_text()
    assert "dynamic_slice" not in text2 and "concatenate" not in text2
    assert f"tensor<60x{h}xf32>" in [ln for ln in text2.splitlines() if "custom_call" in ln][0]
    # With any_valid (the engine's steps): the attention's scales come out of the same call.
    text3 = jax.jit(lambda *a: qp.prepare_qkv(*a[:11], t=t, heads=h, eps=EPS, any_valid=a[11],
                                              impl="pallas"),
                    donate_argnums=(7, 8)).trace(*args[:5], *stacks, *args[7:], s((), jnp.float32)).lower(
                        lowering_platforms=("cuda",)).as_text()
    calls3 = [ln for ln in text3.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls3) == 1 and f"tensor<{h}x2x768xf32>" in calls3[0]
    assert "stablehlo.pad" not in text3 and calls3[0].count("operand_index") == 2
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 1 and "triton" in calls[0] and "grid_x = 757" in calls[0]
    assert f"grid_y = {groups}" in calls[0]
    assert "output_operand_aliases" in calls[0] and calls[0].count("operand_index") == 2
    assert "dynamic_update_slice" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [18, 72])
def test_kernel_on_gpu_matches_the_programs_roundings(heads):
    """tp=4's 18 heads (one group) and tp=1's 72 (three)."""
    if not qp.is_supported():
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9+")
    seed = 205
    args, kw = _problem(seed, t=757, ty=760, heads=heads, layers=3, slots=1600, offset=700,
                        layer=2)
    jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32)).block_until_ready()
    out = jax.jit(lambda *a: qp.prepare_qkv(*a, impl="pallas", any_valid=jnp.float32(1), **kw))(*args)
    _check(out, args, kw, seed)
    from pallas_kernels.fp8_attention import attention_scales
    want = attention_scales(out[0].row_scale, args[5], args[6], jnp.float32(1), 128)
    np.testing.assert_allclose(np.asarray(out[0].scales), np.asarray(want), rtol=1e-7, atol=0)


def test_engine_steps_with_the_kernel_match_the_models_code(monkeypatch, engine_latents):
    """The 'qkv' kernel in the engine's steps at tp=2 (the kernel under the interpreter in
    place of the GPU; the reference attention, allowed to take its Q for the test): the
    latents of the model's code, to the e4m3 split of Q. Prefill keeps the model's code."""
    from characters_jax.config import ConfigError, load_config
    from characters_jax.engine import options as st
    from characters_jax.engine.generator import DiTGenerator

    cfg = load_config("tiny").replace(model={"weight_dtype": "fp8", "dtype": "bfloat16"})
    with_qkv = lambda kernels: cfg.replace(engine={"kernels": kernels, "attention": "reference"})  # noqa: E731
    with pytest.raises(ConfigError, match="attention"):
        DiTGenerator(with_qkv("qkv"), tp=2)
    gen, base = engine_latents(with_qkv("none"))
    assert not gen.engine.options.qkv
    monkeypatch.setattr(st, "QKV_PREP_ATTENTION", ("reference",))
    monkeypatch.setattr(qp, "is_supported", lambda: True)
    real, traced = qp.prepare_qkv, []
    monkeypatch.setattr(qp, "prepare_qkv", lambda *a, **k: traced.append(k["t"]) or real(
        *a, **{**k, "impl": "interpret"}))
    gen, fused = engine_latents(with_qkv("qkv"))
    assert gen.engine.options.qkv
    assert traced and set(traced) == {cfg.video.tokens_per_frame + cfg.model.audio_tokens_per_step}
    assert np.isfinite(fused).all()
    diff = np.linalg.norm(fused - base) / np.linalg.norm(base)
    print(f"fused qkv vs the model's code: {diff:.2e}")  # 0 on CPU: the same roundings
    assert diff < 2e-2
