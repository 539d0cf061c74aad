"""The self-rollout stage: its rollout is the engine's session, the training forward gives
back the rollout's own velocities, a few steps on a tiny setting lower the loss, the stage
resumes from its checkpoint and fine-tunes a weights directory. Seeds: the engine's
weights 7 and noise seed 3 (as test_train_forward), data RandomState(0), settings seed 0."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from characters_jax.config import load_config
from characters_jax.train.dit_forward import clip_velocity
from characters_jax.train.latents import DitData
from characters_jax.train.loop import LoopSettings
from characters_jax.train.self_rollout import RolloutSettings, rollout, train_rollout
from characters_jax.train.state_io import StageStore
from test_train_pipeline import mini_config

STEPS = 12


def _engine_session(cfg, image, prompt, audio):
    """(model, noise [STEPS, T_img, C], latents [STEPS, T_img, C]) of a DiTGenerator session."""
    from characters_jax.engine.generator import DiTGenerator

    gen = DiTGenerator(cfg.replace(engine={"attention": "reference"}), tp=1, seed=7)
    gen.start_session(image, prompt, seed=3)
    key = jax.random.wrap_key_data(jnp.asarray(np.asarray(gen.state.rng)))
    shape = (cfg.video.tokens_per_frame, cfg.model.latent_channels)
    noise = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(key, s), shape, jnp.float32)) for s in range(STEPS)])
    out = np.stack([np.asarray(gen.step(jnp.asarray(a))) for a in audio]).reshape(STEPS, *shape)
    return nnx.merge(gen.engine.graphdef, gen.params), noise, out


@pytest.fixture(scope="module")
def session():
    # float32 cache; reset_period 3: resets at steps 8 and 11, ring of 6 frames
    cfg = load_config("tiny").replace(cache={"dtype": "float32", "reset_period": 3})
    rs = np.random.RandomState(0)
    v, m = cfg.video, cfg.model
    image = rs.randn(v.grid_h, v.grid_w, m.latent_channels).astype(np.float32)
    audio = rs.randn(STEPS, m.audio_tokens_per_step, m.audio_feature_dim).astype(np.float32)
    prompt = list(b"hello")
    model, noise, engine_out = _engine_session(cfg, image, prompt, audio)
    args = (jnp.asarray(image.reshape(-1, m.latent_channels)),
            jnp.asarray(np.pad(np.asarray(prompt, np.int32), (0, 8 - len(prompt)))), jnp.int32(len(prompt)),
            jnp.asarray(audio))
    roll = jax.jit(lambda: rollout(model, cfg, *args, jnp.asarray(noise)))()
    return cfg, model, args, roll, engine_out


def test_the_rollout_is_the_engine_session(session):
    _, _, _, roll, engine_out = session
    scale = np.abs(engine_out).max()
    assert scale > 0.1
    np.testing.assert_allclose(np.asarray(roll.latents), engine_out, atol=1e-5 * scale, rtol=0)
    # negative control: another step's output is far off
    assert np.abs(np.asarray(roll.latents)[1:] - engine_out[:-1]).max() > 0.1 * scale


def test_the_training_forward_gives_the_rollouts_velocities(session):
    """At every pass, clip_velocity with the rollout's context and inputs is the velocity
    the rollout stepped with: what the loss differentiates is what generated the context."""
    cfg, model, args, roll, _ = session
    sig = cfg.sampler.sigmas
    inputs = np.asarray(roll.inputs)
    after = np.concatenate([inputs[:, 1:], np.asarray(roll.latents)[:, None]], axis=1)
    image, prompt, prompt_len, audio = args
    forward = jax.jit(lambda cur, s: clip_velocity(model, cfg, image, prompt, prompt_len, roll.inputs[:, -1], audio, cur, s))
    for i in range(cfg.sampler.num_passes):
        got = np.asarray(forward(roll.inputs[:, i], jnp.full((STEPS,), sig[i], jnp.float32)))
        want = (after[:, i] - inputs[:, i]) / (sig[i + 1] - sig[i])
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)


def _data(cfg, n=6, steps=8):
    rs = np.random.RandomState(0)
    t_img, c = cfg.video.tokens_per_frame, cfg.model.latent_channels
    pad = cfg.cache.prompt_buckets[1]
    f32 = lambda *shape: jnp.asarray(rs.randn(*shape), "float32")  # noqa: E731
    base = f32(n, 1, t_img, c)  # each clip a still face with small changes: learnable in a few steps
    return DitData(latents=base + 0.3 * f32(n, steps, t_img, c), audio=f32(n, steps, 9, cfg.model.audio_feature_dim),
                   ref=base[:, 0], prompt=jnp.zeros((n, pad), "int32"),
                   prompt_len=jnp.asarray([0, 3, 8, 16, 1, 2][:n], "int32"),
                   token_weight=jnp.ones((t_img,), "float32"))


def _settings(max_steps, lr=3e-3, current="noised"):
    from characters_jax.train.optim import OptimSettings

    return RolloutSettings(batch=4, rollout_steps=6, current=current,
                           optim=OptimSettings(lr=lr, warmup_steps=3, ema_decay=0.9),
                           loop=LoopSettings(max_steps=max_steps, log_every=1, plan_after=100, save_every_s=3600.0))


def _init(cfg, seed=0):
    from characters_jax.train.dit_train import init_dit

    return init_dit(cfg, seed)[1]


def _losses(record):
    cols = record["history_columns"]
    return np.asarray([row[cols.index("loss")] for row in record["history"]])


@pytest.mark.parametrize("current", ["noised", "rollout"])
def test_self_rollout_steps_lower_the_loss(tmp_path, current):
    cfg = mini_config()
    lines = []
    _, ema, record = train_rollout(cfg, _settings(16, current=current), _data(cfg), StageStore(tmp_path / "rollout"),
                                   600.0, lines.append, _init(cfg), seed=0)
    loss = _losses(record)
    assert record["rollout_steps"] == 6 and len(loss) >= 14 and np.all(np.isfinite(loss))
    assert loss[-4:].mean() < 0.8 * loss[:4].mean(), loss
    cols = record["history_columns"]
    assert {"mse@1", "mse@0.25", "rollout_rms"} <= set(cols)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(ema))


def test_the_stage_resumes_from_its_checkpoint(tmp_path):
    cfg = mini_config()
    data, store, init = _data(cfg), StageStore(tmp_path / "rollout"), _init(cfg)
    lines = []
    for max_steps in (3, 5):
        _, _, record = train_rollout(cfg, _settings(max_steps), data, store, 600.0, lines.append, init, seed=0)
        assert store.steps()[-1] == max_steps
    assert any("resuming at step 3" in line for line in lines)
    assert [r[0] for r in record["history"]] == [2, 3, 5]  # both runs (a run's first step: compile)


def test_finetune_starts_from_a_weights_directory(tmp_path):
    """The stage starts from a weights directory's DiT (not a fresh init) and its result
    packs into a directory that passes the serving path's checks."""
    from characters_jax.weights.directory import LatentStats, open_weights, save_weights
    from characters_jax.weights.dit import dit_checkpoint
    from characters_jax.train.finetune import load_trained
    from characters_jax.train.pipeline import pack, pure
    from characters_jax.train.vae_train import Vae

    cfg = mini_config()
    start = _init(cfg, seed=5)
    c = cfg.model.latent_channels
    stats = LatentStats(np.zeros(c, np.float32), np.ones(c, np.float32))
    start_record = {"dit": {"steps": 14}, "vae": {"steps": 9}}
    save_weights(tmp_path / "start", cfg, pure(start), pure(Vae(cfg).initial), stats, start_record, store_dtype=None)
    weights = open_weights(tmp_path / "start", cfg)
    dit, _, vae_params = load_trained(weights, cfg)
    for a, b in zip(jax.tree.leaves(dit), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))  # negative control: another init differs
                   for a, b in zip(jax.tree.leaves(_init(cfg)), jax.tree.leaves(start)))
    _, tuned, _ = train_rollout(cfg, _settings(2), _data(cfg), StageStore(tmp_path / "rollout"), 600.0, lambda m: None,
                                dit)  # the same program as the other tests' (the compilation cache)
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(start))]
    assert 0 < max(moved) < 0.1  # two small steps away from the start
    summary = {"from_training": weights.manifest["training"], "stages": {"rollout": {"steps": 2}, "dit": {"steps": 16}}}
    tuned_dir = pack(cfg, tmp_path / "tuned", tuned, vae_params, stats, summary)
    assert dit_checkpoint(tuned_dir, cfg).endswith("dit")
    # the packed weights keep the record they started from, this run's stages last and winning
    assert open_weights(tuned_dir, cfg).manifest["training"] == {"dit": {"steps": 16}, "vae": {"steps": 9}, "rollout": {"steps": 2}}


def test_the_stage_has_its_own_settings():
    from characters_jax.train.settings import load_settings

    s = load_settings("talking", ["rollout.lr=3e-5", "rollout.rollout_steps=24", "budget.rollout=0.2",
                                  "rollout.current=\"rollout\""])
    assert (s.rollout.optim.lr, s.rollout.rollout_steps, s.budget.rollout, s.rollout.current) == (3e-5, 24, 0.2, "rollout")
    assert load_settings("talking").budget.rollout > 0 and load_settings("talking").rollout.rollout_steps == 48
    with pytest.raises(Exception, match=r"rollout\.bogus: unknown"):
        load_settings("talking", ["rollout.bogus=1"])


def test_a_stage_slower_than_its_plan_needs_keeps_running(tmp_path):
    """The stages' loop (`loop.run_stage`, which the self-rollout stage runs): a quarter of the
    budget spent before the plan's timing steps are done (a loaded machine) is no error; the
    stage runs to max_steps."""
    import time

    import optax

    from characters_jax.train.loop import run_stage
    from characters_jax.train.optim import OptimSettings, init_state

    def slow_step(state, batch, lr):
        time.sleep(0.1)  # a step slower than the budget allows for the plan's measurement
        return dataclasses.replace(state, step=state.step + 1), {"loss": jnp.float32(1.0)}

    state = init_state({"w": jnp.zeros(2)}, optax.sgd(0.1))
    loop = LoopSettings(max_steps=12, log_every=1, plan_after=100, save_every_s=3600.0)
    state, record = run_stage("slow", state, slow_step, lambda i: None, store=StageStore(tmp_path / "slow"), record={},
                              budget_s=3.0, loop=loop, optim=OptimSettings(), examples_per_step=1,
                              log=lambda m: None)
    assert int(state.step) == 12 and record.get("planned_steps") is None
