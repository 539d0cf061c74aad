import pathlib

import pytest

from characters_jax.config import ConfigError, load_config


@pytest.mark.parametrize("name", ["tiny", "small", "characters-57b"])
def test_bundled_configs_load(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert cfg.cache_slots == cfg.sink_slots + cfg.cache.ring_frames * cfg.tokens_per_step


def test_characters_57b_matches_the_paper_shapes():
    cfg = load_config("characters-57b")
    assert (cfg.video.grid_h, cfg.video.grid_w) == (22, 34)
    assert cfg.tokens_per_step == 757
    assert cfg.sink_slots == 1246
    assert cfg.cache_slots == 5788
    for tp in (1, 2, 3, 4, 6, 8):
        cfg.validate_tp(tp)


def _write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "custom.toml"
    path.write_text(text)
    return str(path)


def test_user_config_file_needs_no_code(tmp_path):
    cfg = load_config(_write(tmp_path, 'name = "mine"\n[model]\nnum_blocks = 3\n'))
    assert cfg.name == "mine" and cfg.model.num_blocks == 3


@pytest.mark.parametrize(
    "text, field",
    [
        ("[model]\nnum_heads = -4\n", "model.num_heads"),
        ("[model]\nd_model = 0\n", "model.d_model"),
        ("[cache]\nring_frames = 0\n", "cache.ring_frames"),
        ("[cache]\nmode = \"fast\"\n", "cache.mode"),
        ("[model]\nrope_split = [1, 1, 1]\n", "model.rope_split"),
        ("[model]\nbogus = 1\n", "model.bogus"),
        ("[video]\nheight = 100\n", "video.height"),
        ("[sampler]\nsigmas = [0.0, 1.0]\n", "sampler.sigmas"),
        ("[cache]\nprompt_buckets = [8, 64]\n", "cache.prompt_buckets"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(_write(tmp_path, text))


def test_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match="model.num_heads"):
        load_config("tiny").validate_tp(3)


def test_unknown_config_lists_known():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("nonexistent")


@pytest.mark.parametrize("table,field", [
    ('[engine]\nattention = "flash"', "engine.attention"),
    ('[engine]\nreduce = "nccl"', "engine.reduce"),
    ('[engine]\nkernels = "gemm+cublas"', "engine.kernels"),
    ('[engine]\nkernels = "gemm+gemm"', "engine.kernels"),
    ('[engine]\nkernels = ["gemm"]', "engine.kernels"),
    ('[engine]\nfused = true', "engine.fused"),
])
def test_invalid_engine_table_names_the_field(tmp_path, table, field):
    path = tmp_path / "bad.toml"
    path.write_text(table + "\n")
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(str(path))


def test_engine_table_and_its_overrides():
    """The bundled configs carry an [engine] table; `--set` items override it and the cache's
    mode and dtype, and a bad value names its field."""
    cfg = load_config("tiny")
    assert (cfg.engine.attention, cfg.engine.reduce, cfg.engine.kernels) == ("auto", "auto", "auto")
    assert cfg.engine.kernel_set() is None
    out = load_config("tiny", ["engine.reduce=ppermute", "engine.kernels=gemm+qkv", "cache.mode=launch"])
    assert (out.engine.reduce, out.engine.kernel_set(), out.cache.mode) == (
        "ppermute", frozenset({"gemm", "qkv"}), "launch")
    assert out.engine.attention == "auto" and out.cache.dtype == cfg.cache.dtype
    assert load_config("tiny", []) == cfg
    with pytest.raises(ConfigError, match="cache.dtype"):
        load_config("tiny", ["cache.dtype=int4"])
    with pytest.raises(ConfigError, match="engine.kernels"):
        load_config("tiny", ["engine.kernels=all"])
