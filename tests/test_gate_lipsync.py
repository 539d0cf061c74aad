"""The gate on the trained talking model (CPU, 4 virtual devices, float32, tp=1 with a tp=2
reference run), its lipsync and
fidelity metrics on the same runs: planted bugs (a RoPE offset one frame late, an FP8 cache
quantized with 4x the scale attention dequantizes with) move the mean lip-sync confidence far
outside the reference's run-to-run variation and fail, a colour shift of the decoded frames
fails fidelity, a repeat of the reference path passes; the command's exit statuses and error
messages. Few short clips (3 x 2 s, seed 0), no drift clips, the strictest band (ulp, tp)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from characters_jax.cache import kv_cache as kvc  # noqa: E402
from characters_jax.cli import main as cli  # noqa: E402
from characters_jax.config import load_config  # noqa: E402
from characters_jax.gate import harness as H  # noqa: E402
from characters_jax.gate import report as rep  # noqa: E402
from characters_jax.gate.options import ClipOptions, GateOptions, LipsyncOptions  # noqa: E402
from characters_jax.gate.variation import Variation  # noqa: E402
from characters_jax.model.rope import rope_angles, rope_frequencies, rotate  # noqa: E402

CHECKPOINT = "checkpoints/talking"
SEED = 0  # the config's: plans, noise seeds
COLOUR_SHIFT = 12  # /255, added to every decoded frame of one run


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    plans = tmp_path_factory.mktemp("plans")
    settings = H.Settings(config=load_config("talking", [f"seed={SEED}"]), metrics=("lipsync", "fidelity"),
                          checkpoint=CHECKPOINT, tp=1,
                          gate=GateOptions(runs=3, perturb=("ulp", "tp"), quiet=True),  # the strictest band
                          clips=ClipOptions(count=3, seconds=2.0, plans_dir=str(plans)),
                          lipsync=LipsyncOptions(drift_clips=0))
    bench = H.prepare(settings)
    return bench, H.run_reference(bench)


def result_of(gate, variants):
    bench, (plan, base, reference) = gate
    return H.evaluate(bench, plan, base, reference, variants)


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


def rerun(gate, name: str) -> H.RunRecord:
    """The reference path once more, its outputs measured against the base run."""
    bench, (_, base, _) = gate
    outputs = bench.workload.run(bench.engine, bench.params)
    return H.RunRecord(name, "ran", H.measure(bench, outputs, base.evaluations))


@pytest.fixture(scope="module")
def planted(gate):
    """(a repeat of the reference path, the RoPE bug in ring-bf16, the scale bug in production)."""
    bench = gate[0]
    base = gate[1][1]
    honest = rerun(gate, "repeat")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kvc, "write", late_rope_write(bench.config))
        rope_bug = H.run_variant(bench, "ring-bf16", base)
    with pytest.MonkeyPatch.context() as m:
        quantize = kvc.quantize
        m.setattr(kvc, "quantize", lambda x, scale: quantize(x, scale * 4))
        scale_bug = H.run_variant(bench, "production", base)
    return honest, rope_bug, scale_bug


def test_reference_runs_and_variation(gate):
    _, (plan, base, reference) = gate
    assert [r.kind for r in plan] == ["base", "ulp", "tp"]
    confidence = base.evaluations["lipsync"].values["lipsync"]
    assert confidence.shape == (3,) and np.isfinite(confidence).all()
    assert confidence.mean() > 0.3, f"seed {SEED}: the trained model should lip-sync"
    result = result_of(gate, [])
    print("prepare and reference runs:", {k: round(v, 1) for k, v in result.seconds.items()})
    v = result.bands["lipsync"]["lipsync"]
    assert 0 < v.value < 0.01, f"seed {SEED}: run-to-run variation of the mean confidence {v.value}"


def test_planted_bugs_fail_and_a_repeat_passes(gate, planted):
    result = result_of(gate, list(planted))
    ok, rope, scale = result.rows
    tol = result.bands["lipsync"]["lipsync"].tolerance
    print(f"seed {SEED}: tolerance {tol:.2e}; repeat {ok.figures['lipsync']:+.2e}, RoPE bug {rope.figures['lipsync']:+.3f}, "
          f"scale bug {scale.figures['lipsync']:+.3f}; fidelity: tolerance "
          f"{result.bands['fidelity']['fidelity'].tolerance:.2e}, RoPE bug {rope.figures['fidelity']:+.2f}, "
          f"scale bug {scale.figures['fidelity']:+.2f}")
    assert ok.verdict == "pass" and ok.ok["lipsync"] and ok.ok["fidelity"]
    assert rope.figures["lipsync"] < -10 * tol and rope.ok["lipsync"] is False and rope.verdict == "FAIL"
    assert scale.figures["lipsync"] < -10 * tol and scale.ok["lipsync"] is False and scale.verdict == "FAIL"
    # the exit-status rule: a failing default-path variant (production) fails the command
    assert result.failed_default_path == ["production"]
    assert result_of(gate, list(planted[:2])).failed_default_path == []
    md = rep.markdown(result)
    assert "| ring-bf16 |" in md and "FAIL" in md and "passes when" in md


def test_a_colour_shift_fails_fidelity(gate, monkeypatch):
    """Every decoded frame of one run 12/255 brighter: fidelity fails it, far outside its
    variation; the latents are the reference's, so the latent distance is 0."""
    bench = gate[0]
    vae = bench.workload.vae
    decode = vae.decode_stream
    monkeypatch.setattr(vae, "decode_stream", lambda z: np.clip(decode(z).astype(np.int16) + COLOUR_SHIFT, 0, 255)
                        .astype(np.uint8))
    shifted = result_of(gate, [rerun(gate, "colour shift")]).rows[0]
    tol = result_of(gate, []).bands["fidelity"]["fidelity"].tolerance
    print(f"colour shift: fidelity {shifted.figures['fidelity']:+.2f} (tolerance {tol:.2e}), "
          f"lip sync {shifted.figures['lipsync']:+.4f}")
    assert shifted.figures["fidelity"] > 5 and shifted.figures["fidelity"] > 10 * tol
    assert shifted.ok["fidelity"] is False and shifted.verdict == "FAIL"
    assert shifted.figures["latent_mean"] == 0.0


def test_rows_that_cannot_run_here_are_listed(gate, tmp_path):
    bench, (_, base, _) = gate
    rows = [H.run_variant(bench, n, base) for n in ("fused-reduce", "fp8-attention", "production@tp8")]
    assert [r.status.startswith("not run here") for r in rows] == [True, True, True]
    result = result_of(gate, rows)
    assert [r.verdict for r in result.rows] == [r.status for r in rows] and result.failed == []
    paths = rep.write(result, str(tmp_path / "gate"), plot_png=False)
    data = json.loads(paths[1].read_text())
    assert [v["name"] for v in data["variants"]] == ["fused-reduce", "fp8-attention", "production@tp8"]
    assert "not run here" in paths[0].read_text()


def test_the_command_prints_the_table_and_exits_1_when_production_fails(gate, planted, monkeypatch, tmp_path, capsys):
    """`characters-jax gate` around the harness: the table, the files of --out, exit 1 when the
    default path fails and 0 when it does not."""
    for variants, want in ((list(planted), 1), ([planted[0], planted[1]], 0)):
        monkeypatch.setattr(H, "run", lambda settings, on_progress=None, v=variants: result_of(gate, v))
        assert cli(["gate", "lipsync,fidelity", "--config", "talking", "--checkpoint", CHECKPOINT,
                    "--out", str(tmp_path / "g")]) == want
        out = capsys.readouterr().out
        assert "| repeat |" in out and "default path failed: " + ("production" if want else "none") in out
        assert (tmp_path / "g.md").is_file() and (tmp_path / "g.json").is_file()


def test_variation_rules():
    d = [0.002, -0.004, 0.001]
    assert Variation.of(d, "max", 2.0).tolerance == pytest.approx(0.008)
    assert Variation.of(d, "rms", 1.0).value == pytest.approx(np.sqrt((4 + 16 + 1) / 3) * 1e-3)
    v = Variation.of([0.0, 0.0], "max", 2.0, floor=1e-6)
    assert v.within(5e-7) and not v.within(2e-6)
    with pytest.raises(ValueError, match="unknown variation rule"):
        Variation.of(d, "median")


BASE = ["gate", "lipsync", "--config", "talking"]


@pytest.mark.parametrize("extra, message", [
    ([], "lipsync needs --checkpoint"),
    (["--checkpoint", "/nonexistent/weights"], "does not exist"),
    (["--checkpoint", CHECKPOINT, "--set", "clips.count=1"], "clips.count: must be >= 2"),
    (["--checkpoint", CHECKPOINT, "--set", "gate.runs=2"], "gate.runs: must be >= 3"),
    (["--checkpoint", CHECKPOINT, "--variants", "ring-fp8,warp-drive"], "unknown variant 'warp-drive'"),
    (["--checkpoint", CHECKPOINT, "--variants", "production@2"], "@tpN"),
    (["--checkpoint", CHECKPOINT, "--set", 'gate.perturb=["ulp", "cosmic-rays"]'], "unknown perturbation"),
    (["--checkpoint", CHECKPOINT, "--set", "clips.seconds=0.5"], "too short"),
    (["--checkpoint", CHECKPOINT, "--set", "gate.warp=1"], "gate.warp: unknown key"),
])
def test_bad_arguments_exit_2_with_a_reason(extra, message, capsys):
    assert cli(BASE + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_metric_exits_2(capsys):
    assert cli(["gate", "lipsync,vibes", "--config", "talking", "--checkpoint", CHECKPOINT]) == 2
    assert "unknown metric(s) ['vibes']" in capsys.readouterr().err


def test_weights_for_another_config_exit_2(capsys, tmp_path):
    args = ["gate", "lipsync", "--config", "small", "--checkpoint", CHECKPOINT, "--set", f"clips.plans_dir={tmp_path}",
            "--set", "gate.quiet=true"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "does not fit --config small" in err and "decoder.channels" in err
