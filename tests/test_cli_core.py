"""`characters-jax bench` and `init-checkpoint` as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from characters_jax.weights.dit import restore_params, save_params
from characters_jax.config import load_config
from characters_jax.engine.step import Engine
from characters_jax.parallel.sharding import make_mesh

ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONUNBUFFERED": "1"}


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "characters_jax.cli", *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory):
    out = {}
    for mode in ("ring", "launch"):
        path = tmp_path_factory.mktemp("bench") / f"{mode}.json"
        proc = cli("bench", "--config", "tiny", "--tp", "4", "--set", f"cache.mode={mode}", "--steps", "50", "--json", str(path))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "cache upkeep" in proc.stdout and "p99" in proc.stdout
        out[mode] = json.loads(path.read_text())
    return out


def test_bench_reports_percentiles_reset_and_fps(bench_results):
    r = bench_results["ring"]
    assert r["tp"] == 4 and r["mode"] == "ring" and r["latent_finite"]
    assert set(r["step_ms"]) >= {"p50", "p90", "p99", "max"}
    assert r["step_ms"]["p50"] <= r["step_ms"]["p90"] <= r["step_ms"]["p99"] <= r["step_ms"]["max"]
    assert len(r["reset_step_ms"]) == 1  # 53 steps cross one reset (step 47)
    assert r["fps"] > 0 and r["compile_s"] > 0


def test_ring_spends_a_smaller_share_in_cache_upkeep_than_launch(bench_results):
    ring, launch = bench_results["ring"], bench_results["launch"]
    print(f"cache upkeep share: ring {ring['cache_upkeep_share']:.3f}, launch {launch['cache_upkeep_share']:.3f}")
    assert ring["cache_upkeep_share"] < launch["cache_upkeep_share"]


def test_bench_rejects_bad_arguments():
    proc = cli("bench", "--config", "tiny", "--tp", "3")
    assert proc.returncode == 2 and "model.num_heads" in proc.stderr
    proc = cli("bench", "--config", "nope")
    assert proc.returncode == 2 and "not found" in proc.stderr
    # A Pallas attention kernel asked for by name where it cannot run (tiny: head_dim 16,
    # no Hopper GPU here), and unknown names: a message naming the option and its values,
    # no traceback, before any parameter is initialised.
    proc = cli("bench", "--config", "tiny", "--set", "engine.attention=pallas", "--steps", "1")
    assert proc.returncode == 2 and "head_dim 128" in proc.stderr and "Traceback" not in proc.stderr
    for key, value, field, allowed in (("engine.attention", "flash", "engine.attention", "cudnn"),
                                       ("engine.reduce", "nccl", "engine.reduce", "ppermute")):
        proc = cli("bench", "--config", "tiny", "--set", f"{key}={value}", "--steps", "1")
        assert proc.returncode == 2 and field in proc.stderr and repr(value) in proc.stderr, proc.stderr
        assert allowed in proc.stderr and "Traceback" not in proc.stderr and "[bench]" not in proc.stderr


def test_init_checkpoint_then_restore_at_another_tp(tmp_path):
    out = tmp_path / "ckpt"
    proc = cli("init-checkpoint", "--config", "tiny", "--tp", "4", "--out", str(out), "--set", "seed=7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = cli("init-checkpoint", "--config", "tiny", "--tp", "4", "--out", str(out))
    assert proc.returncode == 2 and "already exists" in proc.stdout
    cfg = load_config("tiny")
    restored = restore_params(out, Engine(cfg, make_mesh(2)))
    fresh = Engine(cfg, make_mesh(4)).init_params(jax.random.key(7))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.mesh.size == 2


def test_save_restore_round_trip(tmp_path):
    cfg = load_config("tiny")
    engine = Engine(cfg, make_mesh(4))
    params = engine.init_params(jax.random.key(1))
    save_params(tmp_path / "p", params)
    back = restore_params(tmp_path / "p", engine)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


def test_generator_runs_from_a_checkpoint(tmp_path):
    """DiTGenerator(checkpoint=...) serves the saved weights: same latents as the same seed."""
    import jax.numpy as jnp

    from characters_jax.engine.generator import DiTGenerator

    cfg = load_config("tiny")
    engine = Engine(cfg, make_mesh(4))
    save_params(tmp_path / "ck", engine.init_params(jax.random.key(7)))
    image = np.random.RandomState(0).randn(cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels).astype(np.float32)
    audio = jnp.ones((cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim))
    outs = []
    for gen in (DiTGenerator(cfg, tp=2, checkpoint=str(tmp_path / "ck")), DiTGenerator(cfg, tp=2, seed=7)):
        gen.start_session(image, list(b"hi"), seed=1)
        outs.append(np.asarray(gen.step(audio)))
    np.testing.assert_array_equal(outs[0], outs[1])
