"""`train decoder`: the VAE's decoder fine-tuned on longer streams from a weights directory,
the encoder (the DiT's latent space) held fixed; the stage resumes from its checkpoint.
Seeds: settings seed 0, the weights directory's parameters from init seeds 0 and 5."""

import dataclasses

import jax
import numpy as np

from characters_jax.weights.directory import LatentStats, open_weights, save_weights
from characters_jax.train.finetune import load_trained, tune_decoder
from characters_jax.train.pipeline import pure
from characters_jax.train.state_io import StageStore
from characters_jax.train.vae_train import Vae
from test_train_pipeline import mini_config, mini_settings


def _weights(tmp_path, cfg):
    from characters_jax.train.dit_train import init_dit

    c = cfg.model.latent_channels
    stats = LatentStats(np.zeros(c, np.float32), np.ones(c, np.float32))
    save_weights(tmp_path / "start", cfg, pure(init_dit(cfg, 5)[1]), pure(Vae(cfg).initial), stats, store_dtype=None)
    return open_weights(tmp_path / "start", cfg)


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_decoder_learns_longer_streams_and_the_encoder_stays(tmp_path):
    cfg = mini_config()
    s = mini_settings(vae={"chunks": 3, "pool_span": 16, "max_steps": 6, "ema_decay": 0.0})
    _, vae, params = load_trained(_weights(tmp_path, cfg), cfg)
    before = jax.tree.map(np.asarray, params)
    lines = []
    store = StageStore(tmp_path / "decoder")
    for max_steps in (3, 6):
        run = dataclasses.replace(s, vae=dataclasses.replace(s.vae, loop=dataclasses.replace(s.vae.loop,
                                                                                                max_steps=max_steps)))
        decoder, record = tune_decoder(cfg, run, vae, params, store, 600.0, lines.append)
        assert store.steps()[-1] == max_steps
    assert any("resuming at step 3" in line for line in lines)
    assert record["chunks"] == 3 and [r[0] for r in record["history"]][-1] == 6
    assert _same(params["encoder"], before["encoder"])  # held fixed
    assert not _same(decoder, before["decoder"])  # trained
    cols = record["history_columns"]
    loss = np.asarray([r[cols.index("loss")] for r in record["history"]])
    assert np.all(np.isfinite(loss)) and "mouth_aux" not in cols
