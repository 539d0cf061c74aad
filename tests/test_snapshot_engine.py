"""The step state's snapshot (engine/snapshot.py, DiTGenerator.capture_state /
restore_state): a state captured after k steps, while the steps go on, restored into a
fresh generator continues with the same latents, bitwise, across position resets; at tp=2
the sharded cache is gathered and split again. A state of other shapes is refused by name,
and identities name what differs.

The tiny config with reset_period 3 (the resets fall inside the run), random weights of
seed 0, audio tokens from a fixed numpy seed.
"""

import jax
import numpy as np
import pytest

from characters_jax.config import load_config
from characters_jax.engine import snapshot
from characters_jax.engine.generator import DiTGenerator

CFG = load_config("tiny").replace(cache={"reset_period": 3})
SEED = 0
TOKENS_SEED = 7
STEPS, AT = 14, 6


def _inputs():
    rng = np.random.default_rng(TOKENS_SEED)
    m, v = CFG.model, CFG.video
    latent = rng.standard_normal((v.grid_h, v.grid_w, m.latent_channels)).astype(np.float32)
    tokens = rng.standard_normal((STEPS, m.audio_tokens_per_step, m.audio_feature_dim)).astype(np.float32)
    return latent, tokens


def _run(tp: int):
    """The uninterrupted session (latents of every step) and the state captured after AT
    steps, the steps after it already dispatched when the capture is read."""
    latent, tokens = _inputs()
    gen = DiTGenerator(CFG, tp=tp, seed=SEED, devices=jax.devices()[:tp])
    gen.start_session(latent, list(b"hello"), seed=11)
    out, capture = [], None
    for s in range(STEPS):
        out.append(gen.step(tokens[s]))
        if s + 1 == AT:
            capture = gen.capture_state()
    arrays = capture.arrays()  # read after the later steps consumed (donated) the state
    return [np.asarray(x) for x in out], arrays, capture.step_index


@pytest.mark.parametrize("tp", [1, 2])
def test_a_restored_state_continues_bitwise(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    reference, arrays, step_index = _run(tp)
    assert step_index == AT and int(arrays["step"]) == AT
    _, tokens = _inputs()
    fresh = DiTGenerator(CFG, tp=tp, seed=SEED, devices=jax.devices()[:tp])
    fresh.restore_state(arrays, step_index)
    assert fresh.step_index == AT
    resumed = [np.asarray(fresh.step(tokens[s])) for s in range(AT, STEPS)]
    for s, (a, b) in enumerate(zip(reference[AT:], resumed), start=AT):
        np.testing.assert_array_equal(a, b, err_msg=f"step {s}")
    assert CFG.cache.ring_frames + CFG.cache.reset_period <= STEPS  # position resets happened after the capture


def test_the_negative_control_differs():
    """A state captured one step early does not give the same latents (the check can fail)."""
    reference, arrays, _ = _run(1)
    _, tokens = _inputs()
    fresh = DiTGenerator(CFG, tp=1, seed=SEED)
    fresh.restore_state(arrays, AT)
    other = {**arrays, "rng": arrays["rng"] ^ np.uint32(1)}
    fresh.restore_state(other, AT)
    assert not np.array_equal(np.asarray(fresh.step(tokens[AT])), reference[AT])


def test_a_state_of_other_shapes_is_refused_by_name():
    gen = DiTGenerator(CFG, tp=1, seed=SEED)
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in gen.state_shapes().items()}
    arrays["cache.k"] = arrays["cache.k"][:, :-1]
    del arrays["rng"]
    with pytest.raises(ValueError, match=r"cache\.k: uint8\[.*expected uint8.*rng: missing|rng: missing.*cache\.k"):
        gen.restore_state(arrays, 0)


def test_identities_name_what_differs():
    a = DiTGenerator(CFG, tp=1, seed=SEED).state_identity()
    b = snapshot.identity(CFG.replace(cache={"ring_frames": 8}), 2, DiTGenerator(CFG, tp=1, seed=SEED).engine.options, "random seed 1")
    diff = snapshot.differences(a, b)
    assert any(d.startswith("config.cache.ring_frames: 6 in the snapshot, 8 on this worker") for d in diff), diff
    assert any(d.startswith("tp: 1") for d in diff) and any(d.startswith("weights:") for d in diff)
    assert snapshot.differences(a, a) == []
