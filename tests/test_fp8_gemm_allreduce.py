"""Fused FP8 GEMM + all-reduce: reference on CPU devices, CUDA lowering, GPU exactness."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels import fp8_gemm_allreduce as fused


def _mesh(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


def _operands(seed, tp, m, k, n):
    kx, kw = jax.random.split(jax.random.key(seed))
    x8 = (jax.random.normal(kx, (m, k * tp)) * 16).astype(jnp.float8_e4m3fn)
    w8 = (jax.random.normal(kw, (n, k * tp)) * 16).astype(jnp.float8_e4m3fn)
    ref = np.asarray(x8, np.float64) @ np.asarray(w8, np.float64).T / 512.0
    return x8, w8, ref


def _fused(mesh, use_kernel, config=fused.Config()):
    def body(x, w):
        return fused.gemm_allreduce(x, w, jnp.float32(1 / 32), x_scale=jnp.float32(1 / 16),
                                    use_kernel=use_kernel, config=config)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                                 out_specs=P(), check_vma=False))


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_fallback_matches_reference(tp):
    mesh = _mesh(tp)
    x8, w8, ref = _operands(np.random.SeedSequence().entropy % 2**31, tp, 37, 32, 48)
    out = _fused(mesh, use_kernel=False)(x8, w8)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("config", [fused.CONFIG_RUN1, fused.CONFIG_TMA_ADD])
def test_kernel_lowers_for_cuda_point_to_point_only(tp, config):
    """The Mosaic GPU kernel lowers for tp peers with point-to-point stores only (no NVLS)."""
    mesh = _mesh(tp)
    spec = NamedSharding(mesh, P(None, "tp"))
    x = jax.ShapeDtypeStruct((757, 256 * tp), jnp.float8_e4m3fn, sharding=spec)
    w = jax.ShapeDtypeStruct((512, 256 * tp), jnp.float8_e4m3fn, sharding=spec)
    text = _fused(mesh, use_kernel=True, config=config).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "multimem" not in text and "multicast" not in text


def test_bad_tiles_are_rejected():
    mesh = _mesh(2)
    x8, w8, _ = _operands(0, 2, 64, 48, 96)  # K = 48 is not a multiple of tile_k
    spec = NamedSharding(mesh, P(None, "tp"))
    with pytest.raises(ValueError, match="does not fit tiles"):
        _fused(mesh, use_kernel=True).trace(
            jax.ShapeDtypeStruct(x8.shape, x8.dtype, sharding=spec),
            jax.ShapeDtypeStruct(w8.shape, w8.dtype, sharding=spec))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [fused.CONFIG_RUN1, fused.Config(tile_m=64, stages=4),
                                    fused.CONFIG_TMA_ADD,
                                    fused.Config(reduce="tma_add", tile_m=64, stages=4)])
def test_kernel_on_all_gpus_matches_reference(config):
    if jax.default_backend() != "gpu" or not fused.is_supported():
        pytest.skip("needs NVIDIA Hopper GPUs")
    tp = jax.device_count()
    mesh = _mesh(tp)
    x8, w8, ref = _operands(np.random.SeedSequence().entropy % 2**31, tp, 757, 512, 1024)
    spec = NamedSharding(mesh, P(None, "tp"))
    x8, w8 = jax.device_put(x8, spec), jax.device_put(w8, spec)
    out = _fused(mesh, use_kernel=True, config=config)(x8, w8)
    exact = _fused(mesh, use_kernel=False)(x8, w8)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 1e-2
    # Same bf16 partials summed: agrees with the psum reference up to one bf16 rounding.
    assert _rel_err(out, np.asarray(exact, np.float64)) < 4e-3
