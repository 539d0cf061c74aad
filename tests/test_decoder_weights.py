"""Weights directories: the decoder process's runtime and the generator load trained
weights; another config's weights, or damaged ones, are a clear error at start-up that
names what differs. Seeds: parameters from seeds 0/1, inputs from RandomState(0)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from characters_jax.config import load_config
from characters_jax.decoder.runtime import VaeRuntime
from characters_jax.weights.directory import LatentStats, WeightsError, open_weights, save_weights
from characters_jax.weights.dit import dit_checkpoint

MINI = dict(video={"height": 32, "width": 48, "spatial_compression": 16}, decoder={"channels": (8, 8, 8)},
            model={"num_blocks": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64,
                   "latent_channels": 4, "rope_split": (4, 2, 2)})


def _cfg(**changes):
    cfg = load_config("tiny").replace(**MINI)
    return cfg.replace(**changes) if changes else cfg


def _write(path, cfg, store_dtype="bfloat16"):
    from characters_jax.train.dit_train import init_dit
    from characters_jax.train.vae_train import Vae

    _, dit = init_dit(cfg, 0)
    vae = Vae(cfg, 1)
    c = cfg.model.latent_channels
    stats = LatentStats(np.linspace(-0.5, 0.5, c).astype(np.float32), np.linspace(0.5, 2.0, c).astype(np.float32))
    save_weights(path, cfg, dit, vae.initial, stats, store_dtype=store_dtype)
    return dit, vae, stats


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "talking"
    cfg = _cfg()
    return path, cfg, *_write(path, cfg, store_dtype=None)


def test_the_decoder_runtime_loads_trained_weights(weights_dir):
    path, cfg, _, vae, stats = weights_dir
    rt = VaeRuntime(cfg, checkpoint=path)
    rs = np.random.RandomState(0)
    v = cfg.video
    img = rs.randint(0, 256, (v.height, v.width, 3)).astype(np.uint8)
    raw = vae.encode_image(vae.initial, jnp.asarray(img, jnp.float32) / 127.5 - 1.0)
    np.testing.assert_allclose(np.asarray(rt.encode(img)), (np.asarray(raw) - stats.mean) / stats.std, atol=1e-5)
    z = rs.randn(*rt.latent_shape).astype(np.float32)
    frames, _ = rt.decode(rt.initial_state(), z)
    want = vae.decode(vae.initial, jnp.asarray(z * stats.std + stats.mean)[None])
    want = np.asarray((want + 1.0) * 127.5)
    np.testing.assert_allclose(np.asarray(frames, np.float32), want, atol=0.5 + 1e-3)  # rounded to uint8


def test_the_generator_loads_the_dit_of_a_weights_directory(tmp_path):
    from characters_jax.engine.generator import DiTGenerator

    cfg = _cfg()
    dit, _, _ = _write(tmp_path / "w", cfg)  # stored as bfloat16, restored as float32
    gen = DiTGenerator(cfg, checkpoint=dit_checkpoint(tmp_path / "w", cfg))
    got = nnx.to_pure_dict(gen.params)["blocks"]["qkv"]["w"]
    want = jnp.asarray(dit["blocks"]["qkv"]["w"]).astype(jnp.bfloat16).astype(jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_weights_of_another_config_name_the_differing_fields(weights_dir):
    path, _, _, _, _ = weights_dir
    wider = _cfg(model={"d_model": 64})
    with pytest.raises(WeightsError, match=r"model\.d_model: 32 in the weights, 64 in config"):
        VaeRuntime(wider, checkpoint=path)
    with pytest.raises(WeightsError, match=r"model\.d_model"):
        dit_checkpoint(path, wider)
    with pytest.raises(WeightsError, match=r"decoder\.channels: \[8, 8, 8\] in the weights, \[16, 8, 8\]"):
        VaeRuntime(_cfg(decoder={"channels": (16, 8, 8)}), checkpoint=path)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damaged_weights_are_clear_errors_at_start_up(weights_dir, tmp_path):
    path, cfg, _, _, _ = weights_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        VaeRuntime(cfg, checkpoint=tmp_path / "nowhere")
    bad = _copy(path, tmp_path / "no-manifest")
    (bad / "manifest.json").unlink()
    with pytest.raises(WeightsError, match="no manifest.json"):
        VaeRuntime(cfg, checkpoint=bad)
    bad = _copy(path, tmp_path / "garbled")
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(WeightsError, match="unreadable"):
        open_weights(bad, cfg)
    bad = _copy(path, tmp_path / "shapes")  # the manifest disagrees with the stored arrays
    m = json.loads((bad / "manifest.json").read_text())
    m["trees"]["vae"]["decoder/conv_in/conv/kernel"][0][0] = 5
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(WeightsError, match=r"vae \(stored\): decoder/conv_in/conv/kernel has shape"):
        open_weights(bad, cfg)
    bad = _copy(path, tmp_path / "no-part")
    import shutil

    shutil.rmtree(bad / "dit")
    with pytest.raises(WeightsError, match="dit: not a readable orbax checkpoint"):
        dit_checkpoint(bad, cfg)
    bad = _copy(path, tmp_path / "truncated")
    for f in (bad / "vae").rglob("*"):
        if f.is_file() and f.parent.name == "d" and "ocdbt" in str(f.parent.parent):
            f.write_bytes(f.read_bytes()[:7])
    with pytest.raises(WeightsError, match=r"vae: cannot be restored"):
        VaeRuntime(cfg, checkpoint=bad)


@pytest.mark.parametrize("weights", ["shipped", "random"])
def test_a_stream_decodes_without_compiling_after_warm_up(weights):
    """The bundled talking weights (restored onto this machine's device) and random ones:
    after warm-up, a stream's decodes, from a new state and from each returned one, compile
    nothing."""
    from jax import monitoring

    from characters_jax.weights.directory import bundled_weights

    cfg = load_config("talking")
    path = bundled_weights("talking")
    assert path is not None, "checkpoints/talking is missing"
    rt = VaeRuntime(cfg, checkpoint=path if weights == "shipped" else None)
    rt.warmup()
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, *_a, **_k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    state = rt.initial_state()
    rng = np.random.default_rng(3)
    for _ in range(3):
        frames, state = rt.decode(state, rng.standard_normal(rt.latent_shape).astype(np.float32))
        assert np.asarray(frames).shape == (cfg.video.frames_per_step, cfg.video.height, cfg.video.width, 3)
    assert compiles == [], f"{weights} weights: {len(compiles)} compilations while a stream decodes (seed 3)"
