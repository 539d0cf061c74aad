"""The generator core on 4 virtual CPU devices: equivalences, host syncs, donation,
memory, recompilation."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from characters_jax.cache import kv_cache as kvc
from characters_jax.config import load_config
from characters_jax.measure.bench import reset_steps
from characters_jax.engine.generator import DiTGenerator

CFG = load_config("tiny")
STEPS = 100


def run_session(gen: DiTGenerator, steps: int, prompt: bytes = b"hello world", seed: int = 3) -> np.ndarray:
    """Prefill + `steps` steps on fixed inputs; returns the latents [steps, gh, gw, C]."""
    rs = np.random.RandomState(0)
    image = rs.randn(CFG.video.grid_h, CFG.video.grid_w, CFG.model.latent_channels).astype(np.float32)
    gen.start_session(image, list(prompt), seed=seed)
    audio = rs.randn(steps, CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim).astype(np.float32)
    return np.stack([np.asarray(gen.step(jnp.asarray(a))) for a in audio])


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def worst_step(a, b) -> float:
    return max(rel(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def launch_runs():
    return {dt: run_session(DiTGenerator(CFG, tp=1, cache_mode="launch", cache_dtype=dt), STEPS) for dt in ("bf16", "fp8")}


def test_window_contains_two_resets():
    assert len(reset_steps(STEPS, CFG.cache.ring_frames, CFG.cache.reset_period)) == 2


def test_ring_equals_launch_with_bf16_cache(launch_runs):
    ring = run_session(DiTGenerator(CFG, tp=1, cache_mode="ring", cache_dtype="bf16"), STEPS)
    assert np.isfinite(ring).all()
    assert worst_step(ring, launch_runs["bf16"]) <= 1e-3


def test_ring_vs_launch_with_fp8_cache_is_bounded(launch_runs):
    ring = run_session(DiTGenerator(CFG, tp=1, cache_mode="ring", cache_dtype="fp8"), STEPS)
    diff = worst_step(ring, launch_runs["fp8"])
    print(f"fp8 ring vs launch: worst per-step relative difference {diff:.2e}")
    assert np.isfinite(ring).all()
    assert diff <= 2e-2


def test_a_missing_delta_rotation_is_caught(launch_runs, monkeypatch):
    """Negative control: the equivalence above fails when the reset forgets to rotate."""
    monkeypatch.setattr(kvc, "rotate_ring", lambda layout, cache, delta, freqs: cache)
    broken = run_session(DiTGenerator(CFG, tp=1, cache_mode="ring", cache_dtype="bf16"), STEPS)
    first_reset = min(reset_steps(STEPS, CFG.cache.ring_frames, CFG.cache.reset_period))
    assert worst_step(broken[:first_reset], launch_runs["bf16"][:first_reset]) <= 1e-3
    assert worst_step(broken, launch_runs["bf16"]) > 1e-2


def test_tensor_parallel_sizes_agree():
    """tp=2 (psum) and tp=4 (the ppermute ring) give tp=1's frames to float32 rounding.
    (psum at tp=4: test_row_parallel's psum-4 cases and the gate tests' base run.)"""
    outs = {tp: run_session(DiTGenerator(CFG, tp=tp, cache_dtype="float32"), 12) for tp in (1, 2)}
    ppermute = run_session(DiTGenerator(CFG.replace(engine={"reduce": "ppermute"}), tp=4, cache_dtype="float32"), 12)
    assert rel(outs[2], outs[1]) <= 1e-5
    assert rel(ppermute, outs[1]) <= 1e-5


def test_prompt_and_image_reach_the_output():
    gen = DiTGenerator(CFG, tp=2)
    a = run_session(gen, 3, prompt=b"hello world")
    b = run_session(gen, 3, prompt=b"hello there")
    assert rel(a, b) > 1e-4


def test_prompt_padding_is_masked():
    gen = DiTGenerator(CFG, tp=2)
    eng = gen.engine
    image = jnp.asarray(np.random.RandomState(1).randn(CFG.video.tokens_per_frame, CFG.model.latent_channels), jnp.float32)
    audio = jnp.ones((CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim), jnp.float32)
    outs = []
    for pad in (0, 77):
        prompt = np.full(16, pad, np.int32)
        prompt[:5] = list(b"hello")
        state = eng.prefill(gen.params, eng.init_state(), image, jnp.asarray(prompt), jnp.int32(5), jnp.uint32(0))
        state, latent = eng.step(gen.params, state, audio)
        outs.append(np.asarray(latent))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_step_never_copies_to_the_host():
    gen = DiTGenerator(CFG, tp=4)
    run_session(gen, 2)  # compile and warm up
    audio = jax.device_put(jnp.ones((CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim)), gen.engine.replicated)
    with jax.transfer_guard("disallow"):
        for _ in range(50):  # crosses the first reset
            gen.step(audio).block_until_ready()  # waiting is no transfer
    with pytest.raises(Exception, match="[Dd]isallowed"):
        with jax.transfer_guard("disallow"):
            float(gen.step(audio)[0, 0, 0])  # the guard does catch a device-to-host read


def test_donation_works_and_memory_stays_flat():
    gen = DiTGenerator(CFG, tp=4)
    audio = jax.device_put(jnp.ones((CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim)), gen.engine.replicated)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Dd]onat.*")
        run_session(gen, 3)
        latent = gen.step(audio)
        latent.block_until_ready()
        before = jax.live_arrays()
        before_bytes = sum(a.nbytes for a in before)
        for _ in range(200):
            # Waiting per step keeps XLA:CPU's in-process collectives from queueing hundreds
            # of 4-device programs on 2 cores (they can starve each other's rendezvous).
            latent = gen.step(audio)
            latent.block_until_ready()
    del latent
    after = jax.live_arrays()
    assert sum(a.nbytes for a in after) <= before_bytes
    assert len(after) <= len(before)
    assert gen.state.cache.k.is_deleted() is False


def test_no_recompilation_across_steps_resets_and_sessions():
    gen = DiTGenerator(CFG, tp=4)
    rng = np.random.default_rng(0)
    run_session(gen, 60)  # crosses a reset
    assert gen.engine.step._cache_size() == 1
    image = rng.standard_normal((CFG.video.grid_h, CFG.video.grid_w, CFG.model.latent_channels)).astype(np.float32)
    audio = jnp.ones((CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim))
    for s in range(50):
        n = int(rng.integers(0, CFG.cache.max_prompt_tokens + 1))
        gen.start_session(image, list(rng.integers(0, 256, n)), seed=s)
        gen.step(audio)
    assert gen.engine.prefill._cache_size() <= len(CFG.cache.prompt_buckets)
    assert gen.engine.step._cache_size() == 1


def test_bad_session_inputs_are_rejected():
    gen = DiTGenerator(CFG, tp=1)
    image = np.zeros((CFG.video.grid_h, CFG.video.grid_w, CFG.model.latent_channels), np.float32)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        gen.start_session(image, [1] * (CFG.cache.max_prompt_tokens + 1))
    with pytest.raises(ValueError, match="prompt token ids"):
        gen.start_session(image, [300])
    with pytest.raises(ValueError, match="shape"):
        gen.start_session(image[:2], [1])


def test_fused_reduction_by_name_needs_fp8_weights():
    """reduce='pallas' named for float weights: a ConfigError at construction, not an
    error from inside the first trace."""
    from characters_jax.config import ConfigError

    assert CFG.model.weight_dtype != "fp8"
    with pytest.raises(ConfigError, match="weight_dtype"):
        DiTGenerator(CFG.replace(engine={"reduce": "pallas"}), tp=2)


def test_stacked_gemm_reads_the_same_weights():
    """kernels='gemm' (projection weights read in place from the layer stack; the stacked
    GEMM's reference off Hopper) computes the same step as the per-layer slices of the
    scan; FP8 weights, bf16 activations. With
    activations quantized per row (model.activation_scale='row') the step moves, by about
    FP8's rounding."""
    cfg = CFG.replace(model={"weight_dtype": "fp8", "dtype": "bfloat16"})

    def run(kernels, cfg=cfg):
        gen = DiTGenerator(cfg.replace(engine={"kernels": kernels}), tp=2)
        rs = np.random.RandomState(0)
        gen.start_session(rs.randn(CFG.video.grid_h, CFG.video.grid_w, CFG.model.latent_channels).astype(np.float32), list(b"hi"), seed=1)
        audio = rs.randn(6, CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim).astype(np.float32)
        return np.stack([np.asarray(gen.step(jnp.asarray(a))) for a in audio])

    sliced = run("none")
    stacked = run("gemm")
    assert np.isfinite(stacked).all()
    assert rel(stacked, sliced) <= 1e-3
    by_row = run("gemm", cfg.replace(model={"activation_scale": "row"}))
    assert np.isfinite(by_row).all()
    print(f"per-row vs per-tensor activation scales: {rel(by_row, stacked):.2e}")
    assert 1e-4 < rel(by_row, stacked) < 5e-2


def test_in_place_scan_keeps_projection_weights_whole():
    from flax import nnx

    from characters_jax.model.dit import DiT, _is_projection_weight

    model = nnx.eval_shape(lambda: DiT(CFG.replace(model={"weight_dtype": "fp8"}).model, rngs=nnx.Rngs(0)))
    _, whole, sliced = nnx.split(model.blocks, _is_projection_weight, ...)
    names = {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(whole)}
    assert names == {(proj, leaf) for proj in ("qkv", "out", "up", "down") for leaf in ("w", "w_scale")}
    assert all(v.get_value().shape[0] == CFG.model.num_blocks for _, v in nnx.to_flat_state(sliced))
    from characters_jax.config import ConfigError

    with pytest.raises(ConfigError, match="engine.kernels"):
        CFG.replace(engine={"kernels": "cublas"})
    with pytest.raises(ConfigError, match="model.weight_dtype='fp8'"):
        DiTGenerator(CFG.replace(engine={"kernels": "gemm"}), tp=1)


def test_noise_ulp_nudge_moves_each_element_by_one_ulp():
    """The gate's noise transform moves every nonzero noise element by one
    float32 ulp, and the engine applies a noise transform to every step's noise."""
    from characters_jax.engine.step import Engine
    from characters_jax.gate.runs import noise_ulp_nudge, nudge_noise_ulp
    from characters_jax.parallel.sharding import make_mesh

    x = jax.random.normal(jax.random.key(0), (1000,), jnp.float32).at[3].set(0.0)
    y = nudge_noise_ulp(x, jax.random.key(1))
    d = np.abs(np.asarray(y).view(np.int32).astype(np.int64) - np.asarray(x).view(np.int32).astype(np.int64))
    assert d[3] == 0 and (np.delete(d, 3) == 1).all()
    cfg = CFG.replace(cache={"dtype": "float32"})
    gen = DiTGenerator(cfg, tp=1)
    a = run_session(gen, 3)
    gen.engine = Engine(cfg, make_mesh(1), noise_transform=noise_ulp_nudge(5))
    b = run_session(gen, 3)
    assert 0 < rel(b, a) < 1e-5


def _ops_inside_loops(text: str, op: str) -> tuple[int, int]:
    """(all, inside a stablehlo.while) occurrences of `op` in StableHLO text."""
    depth, loops, total, inside = 0, [], 0, 0  # loops: [depth before the op, entered]
    for line in text.splitlines():
        if op in line:
            total += 1
            inside += bool(loops)
        if "stablehlo.while" in line:
            loops.append([depth, False])
        depth += line.count("{") - line.count("}")
        if loops and depth > loops[-1][0]:
            loops[-1][1] = True  # inside its regions (cond { ... } do { ... })
        while loops and loops[-1][1] and depth <= loops[-1][0]:
            loops.pop()
    return total, inside


def test_rope_angles_are_computed_once_per_step():
    """The new tokens' RoPE angles (cos, sin) are computed once per step, outside the block
    scan: no sine inside any loop of the step program (inside the scan XLA recomputed them
    for every block and pass: a dot and two elementwise kernels each, 720 kernels a step at
    characters-57b)."""
    gen = DiTGenerator(CFG, tp=4)
    audio = jnp.ones((CFG.model.audio_tokens_per_step, CFG.model.audio_feature_dim))
    text = gen.engine.step.trace(gen.params, gen.state, audio).lower().as_text()
    total, inside = _ops_inside_loops(text, "stablehlo.sine")
    assert total >= 1 and inside == 0, (total, inside)
    assert _ops_inside_loops(text, "stablehlo.while")[0] >= 4  # the block scans are loops


def test_block_ops_follow_the_resolved_options():
    """Each program's BlockOps: the reference variant when no kernel of engine.kernels is on,
    the kernels variant with exactly the resolved kernels otherwise; the prefill's ops are
    marked (they set the FP8 scales and never run the fused qkv kernel), the step's not."""
    from characters_jax.engine.block_ops import KernelOps, ReferenceOps
    from characters_jax.engine.step import Engine
    from characters_jax.parallel.sharding import make_mesh

    plain = Engine(CFG.replace(engine={"reduce": "ppermute"}), make_mesh(2))
    for ops, prefill in ((plain.prefill_ops, True), (plain.step_ops, False)):
        assert type(ops) is ReferenceOps and ops.prefill is prefill
        assert (ops.reduce_method, ops.attention_impl) == ("ppermute", plain.options.attention)
        assert not ops.weights_in_place and not ops.attention_rows_padded
    fp8 = CFG.replace(model={"weight_dtype": "fp8", "dtype": "bfloat16"})
    stacked = Engine(fp8.replace(engine={"kernels": "gemm"}), make_mesh(2))
    ops = stacked.step_ops
    assert type(ops) is KernelOps and (ops.gemm, ops.quant, ops.qkv) == (True, False, False)
    assert ops.weights_in_place and not ops.attention_rows_padded
    assert type(Engine(fp8.replace(engine={"kernels": "none"}), make_mesh(2)).step_ops) is ReferenceOps
