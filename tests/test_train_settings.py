"""Training settings: the shipped files load; overrides apply; a bad key or value names itself."""

import pytest

from characters_jax.config import ConfigError, load_config
from characters_jax.train.settings import load_settings


@pytest.mark.parametrize("name", ["talking", "cpu-smoke"])
def test_shipped_settings_load_and_name_their_config(name):
    s = load_settings(name)
    load_config(s.config)
    assert 0 < s.budget.vae + s.budget.eval < 0.6
    assert s.data.heldout_clips >= s.eval.clips


def test_overrides_reach_nested_settings():
    s = load_settings("talking", ["dit.batch=8", "vae.lr=2e-3", "vae.max_steps=5", "eval.random_baseline=false"])
    assert (s.dit.batch, s.vae.optim.lr, s.vae.loop.max_steps, s.eval.random_baseline) == (8, 2e-3, 5, False)


@pytest.mark.parametrize("override, match", [
    ("dit.bogus=1", r"dit\.bogus: unknown key"),
    ("vae.batch=\"big\"", r"vae\.batch: expected int"),
    ("nosuch.key=1", r"nosuch: unknown table or key"),
    ("dit.batch", r"expected TABLE\.KEY=VALUE"),
])
def test_bad_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_settings("talking", [override])
