"""The PyTorch step (benchmarks/torch_step.py) against the JAX step on the same weights,
inputs and noise.

CPU (the eager path: no compile, no CUDA graphs, FP8 GEMMs emulated from the e4m3 values):
float32 latents equal the JAX generator's within 1e-5 relative, over a session with the
position reset and the mask dropped once every slot is valid, and with a short prompt; FP8
weights against JAX's FP8 step and a float32 torch reference; two tensor-parallel ranks
(gloo) against one; the benchmark command on tiny; bad input. GPU (``gpu``): the compiled,
graph-captured step against JAX in float32, and the ``torch._scaled_mm`` FP8 step (row and
tensor activation scales) against a float32 torch reference and against JAX's FP8 step.

Without torch (the CPU CI) the file skips at collection; on a GPU machine
``benchmarks/gpu_tests.sh`` runs it whole, after the kernels' GPU tests.

Errors are ||a - b|| / ||b|| per step, on the latent and on its denoised part (latent -
noise: the noise is shared, so the latent's own error is diluted by it). Seed 3 throughout.
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest

try:
    import torch
except ImportError as err:
    pytest.skip(f"torch is not importable ({err}): the PyTorch step is not checked here",
                allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import torch_step as ts  # noqa: E402

from characters_jax.config import load_config  # noqa: E402
from characters_jax.measure import upkeep  # noqa: E402

SEED = 3
FLOAT32_TOL = 1e-5  # float32 both sides on the CPU: measured ~1-2e-7
GPU_FLOAT32_TOL = 1e-4  # JAX's float32 on a GPU (highest matmul precision; cuBLAS / XLA summation orders)
FP8_TOL = 3e-2  # FP8 activations + bf16 (denoised part): measured ~1e-2 against the float32 reference
CUDA = torch.cuda.is_available()


def _errors(out, ref, noise):
    """[(latent error, denoised-part error)] per step."""
    noise = noise.reshape(out.shape)
    return [(ts.rel_err(o, r), ts.rel_err(o - n, r - n)) for o, r, n in zip(out, ref, noise)]


def _fp8_config(name: str, act_scale: str):
    return load_config(name).replace(
        model={"dtype": "bfloat16", "weight_dtype": "fp8", "activation_scale": act_scale},
        cache={"dtype": "bf16"})


def _float32(cfg):
    """cfg with float32 activations and block weights (the float reference's)."""
    return cfg.replace(model={"dtype": "float32", "weight_dtype": "float32"})


def _noise(cfg, steps):
    """[steps, T_img, C] float32 standard normal (seed SEED)."""
    shape = (steps, cfg.video.tokens_per_frame, cfg.model.latent_channels)
    return np.random.default_rng(SEED).standard_normal(shape).astype(np.float32)


def _float32_tol() -> float:
    """The float32 parity bound for where JAX runs (its default backend)."""
    import jax

    return GPU_FLOAT32_TOL if jax.default_backend() == "gpu" else FLOAT32_TOL


def _against_jax(cfg, steps, device, prompt_len=None, **engine_kw):
    """(torch latents, JAX latents, noise, engine) of one session of each on the JAX weights;
    JAX's float32 matmuls at full precision (a GPU's default is TF32)."""
    import jax

    inputs = ts.session_inputs(cfg, steps, SEED, prompt_len)
    with jax.default_matmul_precision("highest"):
        gen, ref = ts.jax_session(cfg, inputs, SEED, steps)
    engine = ts.TorchStep(ts.StepSpec.from_config(cfg), ts.weights_from_jax(gen.params, device), device, **engine_kw)
    noise = ts.jax_noise(cfg, SEED, steps)
    return ts.torch_session(engine, inputs, SEED, steps, noise), ref, noise, engine


@pytest.mark.parametrize("prompt_len, steps", [(None, 10), (5, 3)], ids=["full-prompt-reset", "short-prompt"])
def test_eager_step_matches_jax_float32(prompt_len, steps):
    cfg = load_config("tiny").replace(cache={"dtype": "float32", "reset_period": 3})
    out, ref, noise, engine = _against_jax(cfg, steps, "cpu", prompt_len)
    if prompt_len is None:  # the session covered a reset and steps without the mask
        assert 8 in ts.reset_steps(steps, cfg.cache.ring_frames, cfg.cache.reset_period)
        assert not engine.masked_now()
    else:
        assert engine.masked_now()
    errs = _errors(out, ref, noise)
    assert max(max(e) for e in errs) < _float32_tol(), errs


def test_fp8_step_matches_jax_fp8_and_a_float_reference():
    cfg = _fp8_config("tiny", "row")
    steps = 3
    out, ref, noise, engine = _against_jax(cfg, steps, "cpu", act_scale="row")
    inputs = ts.session_inputs(cfg, steps, SEED)
    spec32 = ts.StepSpec.from_config(_float32(cfg))
    f32 = ts.torch_session(ts.TorchStep(spec32, engine.weights.dequantized(), "cpu"), inputs, SEED, steps, noise)
    tensor = ts.torch_session(ts.TorchStep(engine.spec, engine.weights, "cpu", act_scale="tensor"), inputs, SEED, steps, noise)
    vs_jax = [e[1] for e in _errors(out, ref, noise)]
    vs_f32 = {mode: [e[1] for e in _errors(x, f32, noise)] for mode, x in (("row", out), ("tensor", tensor))}
    assert max(vs_jax) < FP8_TOL, vs_jax
    for mode, errs in vs_f32.items():
        assert max(errs) < FP8_TOL, (mode, errs)
        assert min(errs) > 1e-3, (mode, errs)  # the GEMMs' inputs were quantized: not the float path


def test_every_layers_tensor_scale_is_16_byte_aligned():
    """cuBLASLt refuses a scale pointer that is not 16-byte aligned: each layer's per-tensor
    weight scale, as the step hands it to ``_scaled_mm``, starts on a 16-byte boundary and
    holds that layer's scale."""
    cfg = _fp8_config("tiny", "tensor")
    spec = ts.StepSpec.from_config(cfg)
    weights = ts.random_weights(spec, torch.device("cpu"), seed=SEED)
    engine = ts.TorchStep(spec, weights, "cpu", act_scale="tensor", compile=False)
    for i, name in enumerate(ts.BLOCK_PROJECTIONS):
        for layer in range(spec.model.num_blocks):
            scale = engine.w_scale[name][layer]
            assert scale.data_ptr() % 16 == 0, (name, layer, scale.data_ptr() % 16)
            assert scale.item() == weights.scales[layer, i].float().item(), (name, layer)


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on the CPU needs a C++ compiler (g++)")
def test_compiled_elementwise_work_equals_eager():
    """Inductor's kernels (C++ on the CPU here; Triton on the GPU, where the GPU tests run
    them with tensor scales too) for every elementwise function of the step, FP8 activations
    with row scales, the mask dropped at step 5: the same latents as the eager functions
    (the bf16 roundings kept: emulate_precision_casts)."""
    cfg = _fp8_config("tiny", "row")
    steps = 6
    spec = ts.StepSpec.from_config(cfg)
    weights = ts.random_weights(spec, torch.device("cpu"), seed=SEED)
    inputs = ts.session_inputs(cfg, steps, SEED)
    noise = _noise(cfg, steps)
    runs = {}
    for compile in (False, True):
        engine = ts.TorchStep(spec, weights, "cpu", act_scale="row", compile=compile)
        assert engine.compiled == compile
        runs[compile] = ts.torch_session(engine, inputs, SEED, steps, noise)
    errs = [e[0] for e in _errors(runs[True], runs[False], noise)]
    assert max(errs) < 1e-6, errs


def test_two_ranks_equal_one():
    cfg = load_config("tiny").replace(cache={"ring_frames": 2, "reset_period": 1})
    steps = 4  # the reset at step 2
    assert 2 in ts.reset_steps(steps, cfg.cache.ring_frames, cfg.cache.reset_period)
    inputs = ts.session_inputs(cfg, steps, SEED)
    noise = _noise(cfg, steps)
    two = ts.run_ranks(2, "session", {"cfg": cfg, "inputs": inputs, "seed": SEED, "steps": steps, "noise": noise, "cpu": True},
                       timeout_s=240)["latents"]
    spec = ts.StepSpec.from_config(cfg)
    one = ts.torch_session(ts.TorchStep(spec, ts.random_weights(spec, torch.device("cpu"), seed=SEED), "cpu"),
                           inputs, SEED, steps, noise)
    errs = _errors(two, one, noise)
    assert max(max(e) for e in errs) < FLOAT32_TOL, errs


def test_bad_input_gets_a_clear_error(capsys):
    assert ts.main(["--config", "tiny", "--share", "5"]) == 2
    assert "does not split 5 ways" in capsys.readouterr().err
    assert ts.main(["--config", "tiny", "--tp", "3"]) == 2
    assert "not divisible by the tensor-parallel size 3" in capsys.readouterr().err
    assert ts.main(["--config", "tiny", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert ts.main(["--config", "nonesuch"]) == 2
    assert "not found" in capsys.readouterr().err
    cfg = load_config("tiny")
    spec = ts.StepSpec.from_config(cfg)
    weights = ts.random_weights(spec, torch.device("cpu"))
    engine = ts.TorchStep(spec, weights, "cpu")
    with pytest.raises(ValueError, match="image_latent must have shape"):
        engine.start_session(np.zeros((2, 2, 16), np.float32), [1])
    with pytest.raises(ValueError, match="exceeds cache.max_prompt_tokens"):
        engine.start_session(np.zeros((4, 4, 16), np.float32), [1] * 33)
    with pytest.raises(ValueError, match="weight qkv: shape"):
        ts.TorchStep(spec.replace(tp=2), weights, "cpu")


def test_the_benchmark_command_on_tiny(tmp_path):
    out = tmp_path / "out"
    rc = ts.main(["--config", "tiny", "--cpu", "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "torch_step_tiny_tp1.json").read_text())
    assert r["jax"]["step_ms"]["n"] == 2 and r["jax"]["latent_finite"]
    mode = r["torch"]["modes"]["float"]
    assert mode["step_ms"]["n"] == 2 and mode["latent_finite"]
    assert mode["timed_steps_masked"]  # the ring is not full after 3 steps
    assert mode["torch_over_jax_p50"] == pytest.approx(mode["step_ms"]["p50"] / r["jax"]["step_ms"]["p50"])
    assert r["step_flops"] == upkeep.step_flops(load_config("tiny"))
    assert set(mode["breakdown"]["components_ms"]) == set(ts.COMPONENTS)
    table = (out / "torch_step_tiny_tp1.md").read_text()
    assert f"| p50 / JAX p50 | 1.000 | {mode['torch_over_jax_p50']:.3f} |" in table


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch has no CUDA device")
def test_gpu_compiled_graph_step_matches_jax_float32():

    cfg = load_config("tiny").replace(cache={"dtype": "float32", "reset_period": 3})
    steps = 10
    out, ref, noise, engine = _against_jax(cfg, steps, "cuda")
    assert engine.graphs and engine.captured == ("masked", "unmasked")
    errs = _errors(out, ref, noise)
    assert max(max(e) for e in errs) < GPU_FLOAT32_TOL, errs  # float32 on the GPU (cuBLAS, SDPA): summation orders


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch has no CUDA device")
@pytest.mark.parametrize("act_scale", ["row", "tensor"])
def test_gpu_scaled_mm_step_close_to_a_float_reference(act_scale):
    cfg = _fp8_config("small", act_scale)
    steps = 8  # the mask drops at step 5
    spec = ts.StepSpec.from_config(cfg)
    device = torch.device("cuda")
    weights = ts.random_weights(spec, device, seed=SEED)
    inputs = ts.session_inputs(cfg, steps, SEED)
    noise = _noise(cfg, steps)
    engine = ts.TorchStep(spec, weights, device, act_scale=act_scale)
    out = ts.torch_session(engine, inputs, SEED, steps, noise)
    assert engine.captured == ("masked", "unmasked")
    spec32 = ts.StepSpec.from_config(_float32(cfg))
    ref = ts.torch_session(ts.TorchStep(spec32, weights.dequantized(), device, compile=False, graphs=False),
                           inputs, SEED, steps, noise)
    errs = [e[1] for e in _errors(out, ref, noise)]
    assert max(errs) < FP8_TOL, errs
    assert min(errs) > 1e-3, errs
    b = engine.profile(1)
    comps = b["components_ms"]
    assert comps["gemm"] > 0 and comps["attention"] > 0 and comps["cache_write"] > 0
    assert sum(comps.values()) <= b["kernel_ms"] * 1.001


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch has no CUDA device")
def test_gpu_scaled_mm_step_matches_jax_fp8():
    cfg = _fp8_config("tiny", "row")
    out, ref, noise, engine = _against_jax(cfg, 3, "cuda", act_scale="row")
    errs = [e[1] for e in _errors(out, ref, noise)]
    assert max(errs) < FP8_TOL, errs
