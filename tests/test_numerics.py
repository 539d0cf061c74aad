"""The numerics harness on 4 virtual CPU devices (tiny config, bf16 activations as in the
serving configs): honest variants are within the reference's run-to-run spread, deliberately
broken ones (a wrong RoPE offset, a mis-scaled FP8 cache) are flagged."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from characters_jax.cache import kv_cache as kvc
from characters_jax.model.rope import rope_angles, rope_frequencies, rotate
from characters_jax.numerics import harness as H
from characters_jax.numerics import report as rep
from characters_jax.numerics.metrics import Divergence, Spread, judge, psnr, rel_l2
from characters_jax.numerics.runs import nudge_ulp, reference_plan

SETTINGS = H.Settings(config="tiny", tp=4, steps=6, runs=4, dtype="bfloat16", verbose=False)


@pytest.fixture(scope="module")
def harness():
    setup = H.prepare(SETTINGS)
    return setup, H.run_reference(setup)


def verdict(harness, traj):
    setup, ref = harness
    report = H.evaluate(setup, ref, [traj])
    return report.rows[0], report


def test_reference_spread_is_real_and_small(harness):
    _, ref = harness
    s = ref.spread
    assert [r.kind for r in ref.plan] == ["base", "ulp", "tp", "ulp"]
    assert 1e-5 < s.latent_mean <= s.latent_worst < 1e-2  # bf16 rounding, not chaos
    assert 40 < s.psnr_worst <= s.psnr_mean < 150
    assert np.isfinite(ref.base.latents).all()


@pytest.mark.parametrize("name", ["ring-bf16", "ring-fp8", "ppermute"])
def test_honest_variants_are_within_spread(harness, name):
    setup, ref = harness
    row, _ = verdict(harness, H.run_variant(setup, name, ref.base_frames))
    print(f"{name}: mean {row.latent_mean:.2e} worst {row.latent_worst:.2e} vs spread {ref.spread.latent_mean:.2e}")
    assert row.ok and row.leaves_band_at is None


def test_wrong_rope_offset_is_flagged(harness, monkeypatch):
    """Ring keys rotated one frame late: every relative time distance is off by one."""
    setup, ref = harness
    write = kvc.write
    m = setup.config.model
    freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)

    def late_write(layout, cache, layer, offset, k, v, rope):
        if layout.mode == "ring":  # one frame more: rotations compose additively
            k = rotate(k, rope_angles(jnp.tile(jnp.array([[1, 0, 0]]), (k.shape[0], 1)), freqs))
        return write(layout, cache, layer, offset, k, v, rope)

    monkeypatch.setattr(kvc, "write", late_write)
    row, report = verdict(harness, H.run_variant(setup, "ring-bf16", ref.base_frames))
    assert not row.mean_ok and not row.worst_ok
    assert row.leaves_band_at is not None and report.flagged == ["ring-bf16"]


def test_misscaled_fp8_cache_is_flagged(harness, monkeypatch):
    """K/V quantized with a scale 10% off the one attention dequantizes with."""
    setup, ref = harness
    quantize = kvc.quantize
    monkeypatch.setattr(kvc, "quantize", lambda x, scale: quantize(x, scale * 1.1))
    row, report = verdict(harness, H.run_variant(setup, "ring-fp8", ref.base_frames))
    assert not row.ok and row.leaves_band_at is not None
    assert report.flagged == ["ring-fp8"]


def test_unavailable_variants_are_skipped_with_a_note(harness):
    setup, ref = harness
    traj = H.run_variant(setup, "fused-reduce", ref.base_frames)
    assert traj.skipped and "Hopper" in traj.note
    from pallas_kernels import fp8_row_quantize
    if not fp8_row_quantize.is_supported():  # a named kernel that cannot run: its reason
        kernels = H.run_variant(setup, "quant-kernels", ref.base_frames)
        assert kernels.skipped and "engine.kernels 'quant'" in kernels.note, kernels.note
    row, report = verdict(harness, traj)
    assert report.flagged == []  # skipped is not flagged
    assert "skipped" in rep.table(report)


def test_outputs(harness, tmp_path):
    setup, ref = harness
    report = H.evaluate(setup, ref, [])
    text = rep.table(report)
    assert "reference spread" in text and "ref tp=1" in text
    rep.write_json(report, tmp_path / "n.json")
    data = json.loads((tmp_path / "n.json").read_text())
    assert len(data["spread"]["band"]) == SETTINGS.steps and data["flagged"] == []
    pytest.importorskip("matplotlib")
    rep.plot(report, tmp_path / "n.png")
    assert (tmp_path / "n.png").stat().st_size > 10_000


def test_nudge_is_one_ulp():
    x = np.random.RandomState(0).randn(1000).astype(jnp.bfloat16).astype(np.float32)
    y = nudge_ulp(x, jnp.bfloat16, seed=1)
    ulp = np.abs(np.spacing(x.astype(jnp.bfloat16)).astype(np.float32))
    d = np.abs(y - x)
    assert (d > 0).all() and (d <= ulp * 1.0001).all() and (d >= ulp * 0.4999).all()
    assert np.array_equal(nudge_ulp(np.zeros(3, np.float32), jnp.float32, 0), np.zeros(3))


def test_reference_plan_and_verdict_logic():
    plan = reference_plan(6, tp=2, num_heads=72, devices=2, repeat=True)
    assert [(r.kind, r.tp) for r in plan] == [("base", 2), ("ulp", 2), ("tp", 1), ("repeat", 2), ("ulp", 2), ("ulp", 2)]
    base = np.ones((4, 2, 2, 3), np.float32)
    assert np.allclose(rel_l2(base * 1.01, base), 0.01) and psnr(base, base).max() == 150.0
    spread = Spread.of([Divergence(np.full(4, 1e-3), None)], factor=2.0, floor=1e-6)
    assert judge("a", Divergence(np.full(4, 1.9e-3), None), spread).ok
    late = judge("b", Divergence(np.array([1e-3, 1e-3, 3e-3, 1e-3]), None), spread)
    assert late.mean_ok and not late.worst_ok and late.leaves_band_at == 2


def test_identical_reference_runs_do_not_shrink_the_spread():
    """A GPU repeat that happens to be bit-identical is determinism, not spread."""
    perturbed = Divergence(np.full(5, 2e-3), np.full(5, 48.0))
    identical = Divergence(np.zeros(5), np.full(5, 150.0))
    s = Spread.of([perturbed, identical], factor=2.0, floor=1e-6)
    assert s.latent_mean == pytest.approx(2e-3) and s.psnr_mean == pytest.approx(48.0)
    only_identical = Spread.of([identical], factor=2.0, floor=1e-6)
    assert only_identical.latent_worst == 0.0 and only_identical.band.min() == 1e-6


def test_fp8_grid_snap_makes_weight_quantization_exact():
    """The reference's snapped weights and the FP8 variant's e4m3 values x scale are equal
    bit for bit (the FP8 variants run the same model); unsnapped weights are not."""
    import jax

    from characters_jax.config import load_config
    from characters_jax.numerics import runs as R

    engine = R.make_engine(R.reference_config(load_config("tiny"), "bf16"), 1)
    params = engine.init_params(jax.random.key(0))
    snapped = R.snap_to_fp8_grid(params)
    flat = lambda p: {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(p)[0]}
    before, after = flat(params), flat(snapped)
    weights = [k for k in after if R._block_weight_key(k)]
    assert len(weights) == 4  # qkv, out, up, down
    for key in after:
        if key not in weights:
            np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(before[key]))
            continue
        values, scale = R.fp8_grid_quantize(after[key])
        s = np.asarray(scale)
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)  # powers of two
        back = np.asarray(values.astype(jnp.float32) * scale[:, None, None])
        np.testing.assert_array_equal(back, np.asarray(after[key], np.float32))
        assert not np.array_equal(np.asarray(after[key]), np.asarray(before[key]))


def test_variants_reach_the_engine_options():
    """Each variant's engine runs what the variant names; the production variant runs the
    config's [engine] table as given (here with an override)."""
    from characters_jax.config import load_config
    from characters_jax.numerics import runs as R

    tiny = load_config("tiny")
    ref = R.reference_config(tiny, "bf16")
    assert (ref.engine.attention, ref.engine.reduce, ref.engine.kernels) == ("reference", "psum", "none")
    for name, want in (("stacked-gemm-row", ("psum", "gemm")), ("ppermute", ("ppermute", "none"))):
        opts = R.make_engine(R.variant_config(ref, R.VARIANTS[name]), 1).options
        assert (opts.reduce, opts.kernels) == want, name
    given = tiny.replace(engine={"reduce": "ppermute"}, cache={"dtype": "bf16"})
    prod = R.variant_config(ref, R.VARIANTS["production"], given)
    assert prod.engine == given.engine and prod.cache == given.cache
    assert prod.model.weight_dtype == "fp8"
