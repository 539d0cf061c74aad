"""`train all` end to end on CPU at a miniature scale: every stage runs, both losses fall, the
weights directory loads through the serving path's checks, the evaluation writes its
table; a stage resumes from its checkpoint. Seeds: settings seed 0, data seeds 0."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from characters_jax.config import load_config
from characters_jax.weights.directory import open_weights
from characters_jax.weights.dit import dit_checkpoint
from characters_jax.train.settings import settings_from_dict

MINI = dict(video={"height": 32, "width": 48, "spatial_compression": 16}, decoder={"channels": (8, 8, 8)},
            model={"num_blocks": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64,
                   "latent_channels": 4, "rope_split": (4, 2, 2)})


def mini_config():
    return load_config("tiny").replace(**MINI)


def mini_settings(**stages):
    loop = {"log_every": 1, "plan_after": 100, "save_every_s": 3600.0}
    raw = {
        "seed": 0,
        "budget": {"deadline_s": 900.0, "vae": 0.3, "eval": 0.2},
        "data": {"train_clips": 6, "clip_seconds": 2.0, "heldout_clips": 2, "heldout_seconds": 2.0,
                 "session_seconds": 3.0, "sessions": 2, "workers": 2, "shard_size": 3, "min_train_clips": 6},
        # a pool of few faces: the few steps see the same ones again
        "vae": {"batch": 4, "chunks": 1, "lr": 3e-3, "warmup_steps": 3, "max_steps": 14, "pool_identities": 2,
                "pool_motions": 2, "pool_span": 8, "still_fraction": 0.0, **loop},
        "dit": {"batch": 4, "lr": 3e-3, "warmup_steps": 3, "max_steps": 14, **loop},
        "eval": {"clips": 2, "random_baseline": False, "window_s": 1.4},
    }
    for k, v in stages.items():
        raw[k].update(v)
    return settings_from_dict(raw)


def _losses(stage: dict) -> np.ndarray:
    cols = stage["history_columns"]
    return np.asarray([row[cols.index("loss")] for row in stage["history"]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from characters_jax.train.pipeline import train_all

    out = tmp_path_factory.mktemp("train")
    summary = train_all(mini_config(), mini_settings(), out, log=lambda m: None)
    return out, summary


def test_train_all_runs_every_stage_and_the_losses_fall(trained):
    out, summary = trained
    for name in ("vae", "dit"):
        loss = _losses(summary["stages"][name])
        assert len(loss) >= 10 and np.all(np.isfinite(loss))
        assert loss[-3:].mean() < 0.85 * loss[:3].mean(), (name, loss)
    assert summary["stages"]["latents"]["clips"] == 6 and summary["stages"]["latents"]["steps_per_clip"] == 12
    assert json.loads((out / "summary.json").read_text())["stages"]["dit"]["steps"] == 14
    result = json.loads((out / "eval" / "eval.json").read_text())
    assert set(result["table"]) == {"ground truth", "ground truth, shuffled", "through the VAE", "generated",
                                   "generated, shuffled"}
    assert "| generated |" in (out / "eval" / "eval.md").read_text()
    drift = result["drift"]  # two 3 s sessions, first and last 1.4 s of each
    assert drift["sessions"] == 2 and len(drift["per_session"]) == 2
    for window in ("first", "last"):
        assert all(np.isfinite(drift[window][k]) for k in ("confidence", "ground_truth_confidence"))
    assert "Drift over 2 sessions of 3 s" in (out / "eval" / "eval.md").read_text()


def test_weights_load_through_the_start_up_checks(trained):
    out, _ = trained
    cfg = mini_config()
    w = open_weights(out / "weights", cfg)
    assert w.stats.mean.shape == (cfg.model.latent_channels,)
    assert dit_checkpoint(out / "weights", cfg).endswith("dit")
    with open(out / "weights.tar", "rb") as fh:
        assert fh.read(1)


def test_a_stage_resumes_from_its_checkpoint(tmp_path):
    """The DiT stage stopped at step 4 continues there (shapes as the pipeline's: its
    program comes from the compilation cache)."""
    from characters_jax.train.dit_train import train_dit
    from characters_jax.train.latents import DitData
    from characters_jax.train.state_io import StageStore

    cfg = mini_config()
    rs = np.random.RandomState(0)
    t_img, c = cfg.video.tokens_per_frame, cfg.model.latent_channels
    n, steps, pad = 6, 12, cfg.cache.prompt_buckets[1]
    f32 = lambda *shape: jax.numpy.asarray(rs.randn(*shape), "float32")  # noqa: E731
    data = DitData(latents=f32(n, steps, t_img, c), audio=f32(n, steps, 9, cfg.model.audio_feature_dim),
                   ref=f32(n, t_img, c), prompt=jax.numpy.zeros((n, pad), "int32"),
                   prompt_len=jax.numpy.asarray([0, 3, 8, 16, 1, 2], "int32"),
                   token_weight=jax.numpy.ones((t_img,), "float32"))
    store = StageStore(tmp_path / "dit")
    s = mini_settings().dit
    lines = []
    for max_steps in (4, 7):
        settings = dataclasses.replace(s, loop=dataclasses.replace(s.loop, max_steps=max_steps))
        _, _, record = train_dit(cfg, settings, data, store, 600.0, lines.append)
        assert store.steps()[-1] == max_steps
    assert any("resuming at step 4" in line for line in lines)
    assert [r[0] for r in record["history"]] == [2, 3, 4, 6, 7]  # both runs (a run's first step: compile)
