"""benchmarks/run.py and the kernel benchmarks on CPU: the share of tp = N as a config, the
ablation's runs as the bench parses them (one engine option apart), the torch hook's skip,
bad arguments refused before any run, and two benchmarks' CPU checks end to end."""

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import run  # noqa: E402


def test_share_config_cuts_heads_and_mlp_only(tmp_path):
    from characters_jax.config import load_config

    base = load_config("characters-57b")
    path = run.share_config(run.config_path("characters-57b", run.ROOT), 4, tmp_path / "share.toml")
    share = load_config(str(path))
    assert share.name == "characters-57b-share-of-tp4"
    assert (share.model.num_heads, share.model.mlp_dim) == (18, 8064)
    restored = share.replace(model={"num_heads": 72, "mlp_dim": 32256})
    assert dataclasses.replace(restored, name=base.name) == base
    with pytest.raises(ValueError, match="does not split 5 ways"):
        run.share_config(run.config_path("characters-57b", run.ROOT), 5, tmp_path / "bad.toml")


def _bench_parser():
    from characters_jax.measure import bench

    p = argparse.ArgumentParser()
    bench.register(p.add_subparsers())
    return p


def test_ablation_runs_parse_and_change_one_option_each(tmp_path, capsys):
    from characters_jax.config.arguments import config_from_args

    assert run.main(["ablation", "--tp", "2", "--dry-run", "--out", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[ablation_")]
    assert [ln.split("]")[0][1:] for ln in lines] == [f"ablation_{n}" for n, _, _ in run.ABLATION]
    parser = _bench_parser()
    engines = []
    for ln in lines:
        argv = ln.split(" ", 3)[3].split()
        args = parser.parse_args(argv[argv.index("bench"):])
        c = config_from_args(args)
        assert c.bench.warmup == 3 and c.bench.progress == 10
        engines.append((c.cache.mode, c.engine.attention, c.engine.reduce, c.engine.kernels))
    for before, after in zip(engines, engines[1:]):
        assert sum(a != b for a, b in zip(before, after)) == 1, (before, after)
    assert engines[-1] == ("ring", "pallas", "pallas", "auto")


def test_ablation_at_tp1_has_no_fused_reduction(tmp_path, capsys):
    assert run.main(["ablation", "--config", "tiny", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[ablation_fused]" not in out and "[ablation_gemm]" in out


def test_torch_suite_skips_with_a_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run, "HERE", tmp_path)  # no torch_step.py here
    assert run.main(["torch", "--config", "tiny", "--out", str(tmp_path)]) == 0
    assert "torch_step.py is not in this tree" in capsys.readouterr().out
    (tmp_path / "torch_step.py").write_text("def main(argv):\n    raise AssertionError('not to be called')\n")
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
    assert run.main(["torch", "--config", "tiny", "--out", str(tmp_path)]) == 0
    assert "torch is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["step", "--set", "engine.reduce=bogus"], "engine.reduce"),
    (["step", "--set", "bench.warmups=1"], "bench.warmups: unknown key"),
    (["share", "--tp", "5"], "not divisible by the tensor-parallel size 5"),
    (["step", "--config", "no-such-config"], "no-such-config"),
])
def test_bad_arguments_fail_before_any_run(argv, message, tmp_path, capsys):
    assert run.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_attention_and_reduction_benchmarks_on_cpu(tmp_path, monkeypatch):
    import bench_attention
    import bench_gemm_allreduce

    assert bench_attention.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["reference"]["rel_err"] == 0.0
    assert 0 < by_impl["xla"]["rel_err"] < 0.05  # bf16 K/V against the float32 reference
    for name in ("NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE"):  # set by main: restored after
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    assert bench_gemm_allreduce.main(["--smoke", "--methods", "psum,ppermute", "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "gemm_allreduce.json").read_text())["rows"]}
    assert rows["psum"]["rel_err"] == pytest.approx(rows["ppermute"]["rel_err"], rel=1e-3)
    assert rows["psum"]["rel_err"] < 0.05 and rows["psum_alone"]["us"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_gate_run_parses_and_names_known_variants(tp, tmp_path, capsys):
    """The suite's command line parses as `characters-jax gate` and gives the settings it asks
    for (its --set items reach the gate's tables and the config); a bad gate key exits 2."""
    from characters_jax.gate import commands, runs

    assert run.main(["gate", "--tp", str(tp), "--dry-run", "--out", str(tmp_path), "--set", "gate.runs=3"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[gate]"))
    argv = line.split(" ", 3)[3].split()
    p = argparse.ArgumentParser()
    commands.register(p.add_subparsers())
    args = p.parse_args(argv[argv.index("gate"):])
    variants = args.variants.split(",")
    assert set(variants) <= set(runs.VARIANTS)
    assert ("fused-reduce" in variants) == (tp > 1)
    settings = commands.settings_from_args(args)
    assert settings.metrics == ("latent",) and settings.tp == tp and settings.config.model.num_blocks == 4
    assert (settings.latent.steps, settings.latent.decoder, settings.gate.runs) == (20, "small", 3)  # the caller's last
    assert run.main(["gate", "--dry-run", "--out", str(tmp_path), "--set", "gate.runs=1"]) == 2
    assert "gate.runs: must be >= 2" in capsys.readouterr().err
