"""Row-parallel GEMM + all-reduce: every portable method against a float reference."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from characters_jax.parallel import row_parallel
from characters_jax.parallel.fp8_linear import quantize_weight


def _mesh(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _problem(seed, tp, m=37, ks=(48,), n=24):
    """Fresh random activations [m, k*tp] and weights [n, k*tp] per pair, and the f64 reference."""
    keys = jax.random.split(jax.random.key(seed), 2 * len(ks))
    xs, ws, ref = [], [], 0.0
    for i, k in enumerate(ks):
        x = jax.random.normal(keys[2 * i], (m, k * tp), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(keys[2 * i + 1], (n, k * tp)) / np.sqrt(k * tp)).astype(jnp.bfloat16)
        xs.append(x)
        ws.append(w)
        ref = ref + np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return xs, ws, ref


def _run(mesh, xs, ws, method, fp8):
    weights = [quantize_weight(w) if fp8 else w for w in ws]
    x_spec = P(None, "tp")
    w_spec = jax.tree.map(lambda _: P(None, "tp"), weights[0])
    if fp8:  # the per-tensor scale is replicated
        w_spec = type(weights[0])(values=P(None, "tp"), scale=P())

    def body(xs, ws):
        pairs = list(zip(xs, ws))
        if len(pairs) == 1:
            return row_parallel.row_parallel_matmul_reduce(pairs[0][0], pairs[0][1], method=method)
        return row_parallel.row_parallel_matmul_reduce(pairs, method=method)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([x_spec] * len(xs), [w_spec] * len(ws)),
                              out_specs=P(), check_vma=False))
    return f(xs, weights)


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("method", ["psum", "ppermute"])
def test_row_parallel_float_weights(tp, method):
    mesh = _mesh(tp)
    xs, ws, ref = _problem(np.random.SeedSequence().entropy % 2**31, tp)
    out = _run(mesh, xs, ws, method, fp8=False)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("method", ["psum", "ppermute", "auto"])
def test_row_parallel_fp8_two_pairs_one_reduction(tp, method):
    """Attention-out + MLP-down summed, then reduced once."""
    mesh = _mesh(tp)
    xs, ws, ref = _problem(np.random.SeedSequence().entropy % 2**31, tp, m=29, ks=(16, 40), n=32)
    out = _run(mesh, xs, ws, method, fp8=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 6e-2


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("method", ["psum", "ppermute"])
def test_reduce_of_partial(tp, method):
    mesh = _mesh(tp)
    parts = jax.random.normal(jax.random.key(np.random.SeedSequence().entropy % 2**31), (tp, 13, 24))
    f = jax.jit(jax.shard_map(
        lambda p: row_parallel.reduce(p[0], method=method), mesh=mesh,
        in_specs=P("tp"), out_specs=P(), check_vma=False))
    out = f(parts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(parts).sum(0), rtol=1e-5, atol=1e-5)


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError):
        row_parallel.resolve_method("nccl")
    assert row_parallel.resolve_method("auto", "cpu") in row_parallel.METHODS


def test_ppermute_uses_collective_permute_not_all_reduce():
    mesh = _mesh(4)
    xs, ws, _ = _problem(1, 4)
    f = jax.jit(jax.shard_map(
        functools.partial(row_parallel.row_parallel_matmul_reduce, method="ppermute"),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(), check_vma=False))
    hlo = f.lower(xs[0], ws[0]).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" in hlo
    assert "all-reduce(" not in hlo
