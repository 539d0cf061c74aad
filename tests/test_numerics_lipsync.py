"""The lip-sync gate on the trained talking model (CPU, 4 virtual devices, float32): planted
bugs (a RoPE offset one frame late, an FP8 cache quantized with 4x the scale attention
dequantizes with) move the mean lip-sync confidence far outside the reference's run-to-run
variation and fail, a repeat of the reference path passes; exit statuses and
error messages of the command. Few short clips (3 x 2 s, seed 0), no drift clips."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from characters_jax.cache import kv_cache as kvc  # noqa: E402
from characters_jax.cli import main as cli  # noqa: E402
from characters_jax.config import load_config  # noqa: E402
from characters_jax.model.rope import rope_angles, rope_frequencies, rotate  # noqa: E402
from characters_jax.numerics import gate_report as rep  # noqa: E402
from characters_jax.numerics import lipsync_gate as G  # noqa: E402
from characters_jax.numerics.quality import Variation  # noqa: E402

CHECKPOINT = "checkpoints/talking"
SEED = 0


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    plans = tmp_path_factory.mktemp("plans")
    settings = G.GateSettings(config=load_config("talking"), checkpoint=CHECKPOINT, tp=2, runs=3, clips=3,
                              seconds=2.0, drift_clips=0, seed=SEED, plans_dir=str(plans), verbose=False,
                              perturb=("ulp", "tp"))  # the strictest band: 3 short clips, no seed runs
    setup = G.prepare(settings)
    return setup, G.run_reference(setup)


def result_of(gate, variants):
    setup, (plan, base, reference) = gate
    return G.evaluate(setup, plan, base, reference, variants)


def late_rope_write(cfg):
    """kv_cache.write with ring keys rotated one frame late (every relative time distance off by one)."""
    write = kvc.write
    m = cfg.model
    freqs = rope_frequencies(m.head_dim, m.rope_split, m.rope_theta)

    def late_write(layout, cache, layer, offset, k, v, rope):
        if layout.mode == "ring":
            k = rotate(k, rope_angles(jnp.tile(jnp.array([[1, 0, 0]]), (k.shape[0], 1)), freqs))
        return write(layout, cache, layer, offset, k, v, rope)

    return late_write


def test_reference_runs_and_variation(gate):
    setup, (plan, base, reference) = gate
    assert [r.kind for r in plan] == ["base", "ulp", "tp"]
    assert base.clips.confidence.shape == (3,) and np.isfinite(base.clips.confidence).all()
    assert base.clips.confidence.mean() > 0.3, f"seed {SEED}: the trained model should lip-sync"
    result = result_of(gate, [])
    v = result.variations["lipsync"]
    assert 0 < v.value < 0.01, f"seed {SEED}: run-to-run variation of the mean confidence {v.value}"


def test_planted_bugs_fail_and_a_repeat_passes(gate, monkeypatch):
    setup, _ = gate
    clips, drift = G._run(setup, "repeat", setup.engine, setup.params)  # the reference path once more
    honest = G.RunResult("repeat", "ran", clips, drift)
    with monkeypatch.context() as m:
        m.setattr(kvc, "write", late_rope_write(setup.config))
        rope_bug = G.run_variant(setup, "ring-bf16")
    with monkeypatch.context() as m:
        quantize = kvc.quantize
        m.setattr(kvc, "quantize", lambda x, scale: quantize(x, scale * 4))
        scale_bug = G.run_variant(setup, "production")
    result = result_of(gate, [honest, rope_bug, scale_bug])
    ok, rope, scale = result.rows
    tol = result.variations["lipsync"].tolerance
    print(f"seed {SEED}: tolerance {tol:.2e}; repeat {ok.diffs['lipsync']:+.2e}, RoPE bug {rope.diffs['lipsync']:+.3f}, "
          f"scale bug {scale.diffs['lipsync']:+.3f}")
    assert ok.verdict == "pass" and ok.ok["lipsync"]
    assert rope.diffs["lipsync"] < -10 * tol and rope.ok["lipsync"] is False and rope.verdict == "FAIL"
    assert scale.diffs["lipsync"] < -10 * tol and scale.ok["lipsync"] is False and scale.verdict == "FAIL"
    # the exit-status rule: a failing default-path variant (production) fails the command
    assert result.failed_default_path == ["production"]
    assert result_of(gate, [honest, rope_bug]).failed_default_path == []
    md = rep.markdown(result)
    assert "| ring-bf16 |" in md and "FAIL" in md and "passes when" in md


def test_rows_that_cannot_run_here_are_listed(gate, tmp_path):
    setup, _ = gate
    rows = [G.run_variant(setup, n) for n in ("fused-reduce", "fp8-attention", "production@tp8")]
    assert [r.status.startswith("not run here") for r in rows] == [True, True, True]
    result = result_of(gate, rows)
    assert [r.verdict for r in result.rows] == [r.status for r in rows] and result.failed == []
    paths = rep.write(result, str(tmp_path / "gate"), plot_png=False)
    data = json.loads(paths[1].read_text())
    assert [v["name"] for v in data["variants"]] == ["fused-reduce", "fp8-attention", "production@tp8"]
    assert "not run here" in paths[0].read_text()


def test_variation_rules():
    d = [0.002, -0.004, 0.001]
    assert Variation.of(d, "max", 2.0).tolerance == pytest.approx(0.008)
    assert Variation.of(d, "rms", 1.0).value == pytest.approx(np.sqrt((4 + 16 + 1) / 3) * 1e-3)
    v = Variation.of([0.0, 0.0], "max", 2.0, floor=1e-6)
    assert v.within(5e-7) and not v.within(2e-6)
    with pytest.raises(ValueError, match="unknown variation rule"):
        Variation.of(d, "median")


BASE = ["numerics", "--metric", "lipsync", "--config", "talking", "--quiet"]


@pytest.mark.parametrize("extra, message", [
    ([], "needs --checkpoint"),
    (["--checkpoint", "/nonexistent/weights"], "does not exist"),
    (["--checkpoint", CHECKPOINT, "--clips", "1"], "--clips must be >= 2"),
    (["--checkpoint", CHECKPOINT, "--runs", "2"], "--runs must be >= 3"),
    (["--checkpoint", CHECKPOINT, "--variants", "ring-fp8,warp-drive"], "unknown variant 'warp-drive'"),
    (["--checkpoint", CHECKPOINT, "--variants", "production@2"], "@tpN"),
    (["--checkpoint", CHECKPOINT, "--perturb", "ulp,cosmic-rays"], "unknown perturbation"),
    (["--checkpoint", CHECKPOINT, "--seconds", "0.5"], "too short"),
])
def test_bad_arguments_exit_2_with_a_reason(extra, message, capsys):
    assert cli(BASE + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_weights_for_another_config_exit_2(capsys, tmp_path):
    args = ["numerics", "--metric", "lipsync", "--config", "small", "--checkpoint", CHECKPOINT, "--quiet",
            "--plans", str(tmp_path)]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "does not fit --config small" in err and "decoder.channels" in err
