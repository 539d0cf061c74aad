"""The gate's latent distance on 4 virtual CPU devices (tiny config at tp=1, its tp=2 run a
reference perturbation; bf16 activations as in the serving configs, random weights of seed 0,
4 steps): honest variants (the ppermute reduction at tp=2) are within the
reference's run-to-run spread, deliberately broken ones (a wrong RoPE offset, a mis-scaled
FP8 cache) are flagged; the gate sizes the GPU pool before JAX starts its backend."""

import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import load_config
from characters_jax.gate import harness as H
from characters_jax.gate import report as rep
from characters_jax.gate.distance import Divergence, Spread, judge, psnr, rel_l2
from characters_jax.gate.options import GateOptions, LatentOptions
from characters_jax.gate.runs import nudge_ulp, reference_plan
from characters_jax.model.rope import rope_angles, rope_frequencies, rotate

STEPS = 4
SETTINGS = H.Settings(config=load_config("tiny", ["model.dtype=bfloat16"]), metrics=("latent",), tp=1,
                      gate=GateOptions(runs=3, quiet=True), latent=LatentOptions(steps=STEPS, decoder="small"))


@pytest.fixture(scope="module")
def harness():
    bench = H.prepare(SETTINGS)
    plan, base, reference = H.run_reference(bench)
    return bench, plan, base, reference


def verdict(harness, record):
    """(the latent distance's distance.Verdict of the record's row, the result)."""
    bench, plan, base, reference = harness
    result = H.evaluate(bench, plan, base, reference, [record])
    row = result.rows[0]
    return (row.judgements["latent"].detail[0] if row.status == "ran" else None), result


def test_reference_spread_is_real_and_small(harness):
    bench, plan, base, reference = harness
    s = H.evaluate(bench, plan, base, reference, []).bands["latent"]
    assert [r.kind for r in plan] == ["base", "ulp", "tp"]
    assert 1e-5 < s.latent_mean <= s.latent_worst < 1e-2  # bf16 rounding, not chaos
    assert 40 < s.psnr_worst <= s.psnr_mean < 150
    assert np.isfinite(base.evaluations["latent"].latents).all()


@pytest.mark.parametrize("name", ["ring-bf16", "ring-fp8", "ppermute@tp2"])
def test_honest_variants_are_within_spread(harness, name):
    bench, _, base, _ = harness
    row, result = verdict(harness, H.run_variant(bench, name, base))
    s = result.bands["latent"]
    print(f"{name}: mean {row.latent_mean:.2e} worst {row.latent_worst:.2e} vs spread {s.latent_mean:.2e}")
    assert row.ok and row.leaves_band_at is None


def test_wrong_rope_offset_is_flagged(harness, monkeypatch):
    """Ring keys rotated one frame late: every relative time distance is off by one."""
    bench, _, base, _ = harness
    write = kvc.write
    m = bench.config.model
    freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)

    def late_write(layout, cache, layer, offset, k, v, rope):
        if layout.mode == "ring":  # one frame more: rotations compose additively
            k = rotate(k, rope_angles(jnp.tile(jnp.array([[1, 0, 0]]), (k.shape[0], 1)), freqs))
        return write(layout, cache, layer, offset, k, v, rope)

    monkeypatch.setattr(kvc, "write", late_write)
    row, result = verdict(harness, H.run_variant(bench, "ring-bf16", base))
    assert not row.mean_ok and not row.worst_ok
    assert row.leaves_band_at is not None and result.failed == ["ring-bf16"]


def test_misscaled_fp8_cache_is_flagged(harness, monkeypatch):
    """K/V quantized with a scale 10% off the one attention dequantizes with."""
    bench, _, base, _ = harness
    quantize = kvc.quantize
    monkeypatch.setattr(kvc, "quantize", lambda x, scale: quantize(x, scale * 1.1))
    row, result = verdict(harness, H.run_variant(bench, "ring-fp8", base))
    assert not row.ok and row.leaves_band_at is not None
    assert result.failed == ["ring-fp8"]


def test_unavailable_variants_are_skipped_with_a_note(harness):
    bench, _, base, _ = harness
    record = H.run_variant(bench, "fused-reduce", base)
    assert not record.ran and "Hopper" in record.status
    from pallas_kernels import fp8_row_quantize
    if not fp8_row_quantize.is_supported():  # a named kernel that cannot run: its reason
        kernels = H.run_variant(bench, "quant-kernels", base)
        assert not kernels.ran and "engine.kernels 'quant'" in kernels.status, kernels.status
    _, result = verdict(harness, record)
    assert result.failed == []  # not run is not failed
    assert "not run here" in rep.table(result)


def test_outputs(harness, tmp_path):
    bench, plan, base, reference = harness
    result = H.evaluate(bench, plan, base, reference, [])
    text = rep.table(result)
    assert "reference variation" in text and "| ref tp=2 |" in text  # the tp perturbation's row
    paths = rep.write(result, str(tmp_path / "n"), plot_png=False)
    data = json.loads(paths[1].read_text())
    assert len(data["bands"]["latent"]["band"]) == STEPS and data["failed"] == []
    pytest.importorskip("matplotlib")
    rep.plot(result, tmp_path / "n.png")
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


def test_fp8_grid_snap_makes_weight_quantization_exact(harness):
    """The reference's snapped weights and the FP8 variant's e4m3 values x scale are equal
    bit for bit (the FP8 variants run the same model); unsnapped weights are not."""
    import jax

    from characters_jax.gate import runs as R

    bench = harness[0]
    params = bench.engine.init_params(jax.random.key(0))  # the reference's draw, before its snap
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
    from characters_jax.gate import runs as R

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


POOL_SCRIPT = textwrap.dedent("""
    import sys
    from jax._src import xla_bridge
    from characters_jax.serving import placement
    from characters_jax.cli import main

    original = placement.size_generator_pool

    def checked(cfg, tp):
        print("CALL", xla_bridge.backends_are_initialized(), cfg.model.num_blocks, tp, flush=True)
        original(cfg, tp)
        sys.exit(17)  # what follows is the run the other tests check

    placement.size_generator_pool = checked
    main(["gate", "latent", "--config", "tiny", "--tp", "2", "--set", "model.num_blocks=1", "--set", "gate.quiet=true"])
""")


def test_the_gate_sizes_the_pool_before_the_backend_starts():
    """As `bench` does: the GPU pool from the memory plan of the config the gate runs (here
    with one block, at tp=2), before JAX starts its backend; checked on the CPU, where the
    plan sets no pool, by the order in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["CALL False 1 2"], proc.stdout  # called once, with no backend yet


def test_every_setting_of_the_gate_is_a_key_of_its_tables(capsys):
    """What were the gate's flags are keys (`--set`): the run's length and reference runs, the
    verdict's rule, the decoder, the held-out clips and the drift reach the settings, the
    model's own (depth, dtype, seed) reach the config; a retired flag is refused."""
    from characters_jax.cli import build_parser
    from characters_jax.gate.commands import settings_from_args

    items = ["latent.steps=7", "gate.runs=5", 'gate.perturb=["ulp", "seed"]', "gate.variation=rms", "gate.factor=3",
             "gate.floor=1e-5", "gate.ref_cache_dtype=float32", "gate.time_budget_s=60", "gate.quiet=true",
             "latent.decoder=none", "latent.float_weights=true", "clips.count=4", "clips.seconds=3",
             "clips.plans_dir=/tmp/plans", "lipsync.drift_clips=1", "lipsync.drift_seconds=12",
             "lipsync.drift_window_s=3", "model.num_blocks=1", "model.dtype=bfloat16", "seed=4"]
    argv = ["gate", "latent,lipsync", "--config", "tiny", "--checkpoint", "w", "--variants", "ring-fp8,production@tp2"]
    s = settings_from_args(build_parser().parse_args(argv + [a for i in items for a in ("--set", i)]))
    assert s.metrics == ("latent", "lipsync") and s.variants == ("ring-fp8", "production@tp2") and s.checkpoint == "w"
    assert s.gate == GateOptions(runs=5, perturb=("ulp", "seed"), variation="rms", factor=3.0, floor=1e-5,
                                 ref_cache_dtype="float32", time_budget_s=60.0, quiet=True)
    assert s.latent == LatentOptions(steps=7, decoder="none", float_weights=True)
    assert (s.clips.count, s.clips.seconds, s.clips.plans_dir) == (4, 3.0, "/tmp/plans")
    assert (s.lipsync.drift_clips, s.lipsync.drift_seconds, s.lipsync.drift_window_s) == (1, 12.0, 3.0)
    assert (s.config.model.num_blocks, s.config.model.dtype, s.config.seed) == (1, "bfloat16", 4)
    for retired in ("--steps", "--runs", "--factor", "--dtype", "--blocks", "--metric", "--json", "--quiet"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["gate", "latent", "--config", "tiny", retired, "1"])
    capsys.readouterr()
