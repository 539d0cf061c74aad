"""Row-parallel GEMM + all-reduce: every portable method against a float reference."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from characters_jax.parallel import row_parallel
from fp8_weights import quantize_weight


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


def _run(mesh, xs, ws, method, fp8, act_scale="tensor"):
    weights = [quantize_weight(w) if fp8 else w for w in ws]
    x_spec = P(None, "tp")
    w_spec = jax.tree.map(lambda _: P(None, "tp"), weights[0])
    if fp8:  # the per-tensor scale is replicated
        w_spec = type(weights[0])(values=P(None, "tp"), scale=P())

    def body(xs, ws):
        pairs = list(zip(xs, ws))
        if len(pairs) == 1:
            return row_parallel.row_parallel_matmul_reduce(pairs[0][0], pairs[0][1], method=method,
                                                           act_scale=act_scale)
        return row_parallel.row_parallel_matmul_reduce(pairs, method=method, act_scale=act_scale)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([x_spec] * len(xs), [w_spec] * len(ws)),
                              out_specs=P(), check_vma=False))
    return f(xs, weights)


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("method", ["psum", "ppermute"])
def test_row_parallel_float_weights(tp, method):
    mesh = _mesh(tp)
    xs, ws, ref = _problem(101, tp)
    out = _run(mesh, xs, ws, method, fp8=False)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    assert _rel_err(out, ref) < 1e-2, "seed 101"


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("method", ["psum", "ppermute", "auto"])
def test_row_parallel_fp8_two_pairs_one_reduction(tp, method):
    """Attention-out + MLP-down summed, then reduced once."""
    mesh = _mesh(tp)
    xs, ws, ref = _problem(102, tp, m=29, ks=(16, 40), n=32)
    out = _run(mesh, xs, ws, method, fp8=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 6e-2, "seed 102"


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("method", ["psum", "ppermute", "pallas"])
def test_row_scales_keep_small_rows(tp, method):
    """act_scale='row': the two-pair reduction with rows whose magnitudes span 10^-6 .. 1 is
    accurate row by row (the fused methods run their XLA fallback on CPU); one scale per
    tensor loses the smallest rows (the check can fail)."""
    mesh = _mesh(tp)
    seed = 103
    xs, ws, _ = _problem(seed, tp, m=29, ks=(16, 40), n=32)
    mags = np.logspace(-6, 0, 29)[:, None]
    xs = [(x.astype(jnp.float32) * mags).astype(jnp.bfloat16) for x in xs]
    ref = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for x, w in zip(xs, ws))
    out = np.asarray(_run(mesh, xs, ws, method, fp8=True, act_scale="row"), np.float64)
    errs = [_rel_err(out[r], ref[r]) for r in range(len(ref))]
    assert max(errs) < 8e-2, (seed, errs)
    by_tensor = np.asarray(_run(mesh, xs, ws, method, fp8=True), np.float64)
    assert _rel_err(by_tensor[0], ref[0]) > 0.5, seed


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("method", ["psum", "ppermute", "pallas"])
def test_prequantized_activation_with_padding_rows(tp, method):
    """An x that arrives quantized per row with zero padding rows (as the fused
    quantization kernels give it: 29 rows -> 32, scales of the padding rows 0) beside a
    float x of 29 rows: the result has 29 rows and equals the all-float call's."""
    from characters_jax.parallel.fp8_linear import Fp8Activation, quantize_activation

    mesh = _mesh(tp)
    seed = 104
    xs, ws, ref = _problem(seed, tp, m=29, ks=(16, 40), n=32)
    weights = [quantize_weight(w) for w in ws]
    w_spec = type(weights[0])(values=P(None, "tp"), scale=P())

    def body(prequantized, xs, ws):
        x1 = xs[1]
        if prequantized:
            q, s = quantize_activation(x1, per_row=True)
            x1 = Fp8Activation(jnp.pad(q, ((0, 3), (0, 0))), jnp.pad(s, (0, 3)))
        return row_parallel.row_parallel_matmul_reduce(
            [(xs[0], ws[0]), (x1, ws[1])], method=method, act_scale="row",
            out_dtype=jnp.bfloat16)

    run = lambda pre: jax.jit(jax.shard_map(  # noqa: E731
        functools.partial(body, pre), mesh=mesh, in_specs=([P(None, "tp")] * 2, [w_spec] * 2),
        out_specs=P(), check_vma=False))(xs, weights)
    padded, plain = run(True), run(False)
    assert padded.shape == plain.shape == (29, 32)
    np.testing.assert_allclose(np.asarray(padded, np.float32), np.asarray(plain, np.float32),
                               rtol=1e-2, atol=1e-2, err_msg=str(seed))
    assert _rel_err(padded, ref) < 6e-2, seed
    with pytest.raises(ValueError, match="out_dtype"):
        jax.shard_map(lambda x, w: row_parallel.row_parallel_matmul_reduce(
            Fp8Activation(*quantize_activation(x)), w), mesh=mesh,
            in_specs=(P(None, "tp"), w_spec), out_specs=P(), check_vma=False)(xs[0], weights[0])


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


# ----------------------------------------------------------------------------------------
# Stacked FP8 weights (Fp8Weight.layer): read in place by the kernels, never sliced.

def _stacked_problem(seed, tp, m=29, ks=(16, 40), n=32, layers=3):
    """Per pair: x [m, k*tp] bf16 and an FP8 weight stack [layers, n, k*tp] (per-layer
    per-tensor scales); returns (xs, stacks, float reference per layer [layers, m, n])."""
    from characters_jax.parallel.fp8_linear import Fp8Weight

    keys = jax.random.split(jax.random.key(seed), 2 * len(ks))
    xs, stacks = [], []
    ref = np.zeros((layers, m, n))
    for i, k in enumerate(ks):
        x = jax.random.normal(keys[2 * i], (m, k * tp), jnp.float32).astype(jnp.bfloat16)
        per = [quantize_weight(jax.random.normal(jax.random.fold_in(keys[2 * i + 1], l),
                                                 (n, k * tp)) / np.sqrt(k * tp))
               for l in range(layers)]
        stack = Fp8Weight(values=jnp.stack([w.values for w in per]),
                          scale=jnp.stack([w.scale for w in per]))
        xs.append(x)
        stacks.append(stack)
        for l in range(layers):
            ref[l] += np.asarray(x, np.float64) @ np.asarray(per[l].dequantize(), np.float64).T
    return xs, stacks, ref


def _run_layers(mesh, xs, stacks, method, stacked):
    """The two-pair reduction for every layer in a lax.scan; weights stacked (layer=) or
    sliced by the scan.  Returns [layers, m, n]."""
    from characters_jax.parallel.fp8_linear import Fp8Weight

    layers = stacks[0].values.shape[0]
    wspec = Fp8Weight(values=P(None, None, "tp"), scale=P())

    def body(xs, stacks):
        def step(c, l):
            if stacked:
                ws = [Fp8Weight(values=s.values, scale=s.scale, layer=l) for s in stacks]
            else:
                ws = [Fp8Weight(values=s.values, scale=s.scale, layer=l).at_layer() for s in stacks]
            return c, row_parallel.row_parallel_matmul_reduce(list(zip(xs, ws)), method=method)
        return lax.scan(step, 0, jnp.arange(layers, dtype=jnp.int32))[1]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([P(None, "tp")] * len(xs),
                                                          [wspec] * len(stacks)),
                              out_specs=P(), check_vma=False))
    return f(xs, stacks)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("method", ["psum", "pallas", "ppermute"])
def test_stacked_weights_give_the_sliced_result(tp, method):
    """Stacked weights (read in place where the kernels run; on CPU the references) give the
    per-layer slices' numbers (to one rounding of a bf16 partial), for every method ('pallas' runs its XLA fallback
    on CPU), and match float math."""
    mesh = _mesh(tp)
    seed = 106
    xs, stacks, ref = _stacked_problem(seed, tp)
    out = _run_layers(mesh, xs, stacks, method, stacked=True)
    sliced = _run_layers(mesh, xs, stacks, method, stacked=False)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    # Equal up to the rounding of one bf16 partial: XLA may fuse the stacked layer's slice
    # into the dot and sum in another order, and each device's partial (magnitude up to the
    # output's largest) is rounded to bf16 before the reduction. Exact equality failed once
    # in CI on one element of 2,784 (0.1445 vs 0.1484, partials ~2). A wrong layer: O(1).
    out32, sliced32 = np.asarray(out, np.float32), np.asarray(sliced, np.float32)
    np.testing.assert_allclose(out32, sliced32, rtol=0,
                               atol=2.0**-8 * np.abs(sliced32).max(), err_msg=f"seed {seed}")
    for l in range(ref.shape[0]):
        assert _rel_err(out[l], ref[l]) < 6e-2, (seed, l)


_F8_3D = re.compile(r"tensor<\d+x\d+x\d+xf8E4M3FN>")


def _lower_block_for_cuda(monkeypatch, method, tp=2, m=757, ko=128, kd=256, n=512, layers=4,
                          act_scale="tensor", join=False):
    """StableHLO (CUDA) of the two-pair reduction in a scan over stacked weights, with the
    Pallas kernels switched on as on a Hopper GPU."""
    from characters_jax.parallel.fp8_linear import Fp8Weight
    from pallas_kernels import fp8_gemm_allreduce, fp8_gemm_stacked

    monkeypatch.setattr(fp8_gemm_allreduce, "is_supported", lambda: True)
    monkeypatch.setattr(fp8_gemm_stacked, "is_supported", lambda: True)
    mesh = _mesh(tp)
    xsh = NamedSharding(mesh, P(None, "tp"))
    wsh = NamedSharding(mesh, P(None, None, "tp"))
    rep = NamedSharding(mesh, P())
    xs = [jax.ShapeDtypeStruct((m, k * tp), jnp.bfloat16, sharding=xsh) for k in (ko, kd)]
    stacks = [Fp8Weight(values=jax.ShapeDtypeStruct((layers, n, k * tp), jnp.float8_e4m3fn,
                                                    sharding=wsh),
                        scale=jax.ShapeDtypeStruct((layers,), jnp.float32, sharding=rep))
              for k in (ko, kd)]
    wspec = Fp8Weight(values=P(None, None, "tp"), scale=P())

    def body(xs, stacks):
        def step(c, l):
            ws = [Fp8Weight(values=s.values, scale=s.scale, layer=l) for s in stacks]
            if not join:  # attention-out's layer as another tracer: not joinable
                ws[0] = Fp8Weight(values=ws[0].values, scale=ws[0].scale, layer=l + 0)
            y = row_parallel.row_parallel_matmul_reduce(list(zip(xs, ws)), method=method,
                                                        act_scale=act_scale)
            return c + y[0, 0].astype(jnp.float32), None
        return lax.scan(step, jnp.float32(0), jnp.arange(layers, dtype=jnp.int32))[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([P(None, "tp")] * 2, [wspec] * 2),
                              out_specs=P(), check_vma=False))
    return f.trace(xs, stacks).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)


def _calls(text):
    return [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]


def _no_weight_slices(text):
    ops = ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.gather", "stablehlo.copy")
    return [ln for ln in text.splitlines()
            if any(op in ln for op in ops) and _F8_3D.search(ln.split(":", 1)[-1])] == []


def test_stacked_psum_path_chains_the_products_through_the_addend(monkeypatch):
    """'psum' with stacked weights on Hopper: attention-out's GEMM writes bf16, which the
    MLP-down GEMM reads as its epilogue addend and writes the bf16 partial that psum
    reduces: no float32 [M, N] output, no XLA add; x padded to 760 rows (not 768); both
    stacks handed whole to the kernels."""
    text = _lower_block_for_cuda(monkeypatch, "psum")
    calls = _calls(text)
    assert len(calls) == 2
    sigs = [ln.rsplit(":", 1)[-1] for ln in calls]
    ins = [s.split("->")[0] for s in sigs]
    outs = [s.split("->")[1] for s in sigs]
    assert "tensor<4x512x128xf8E4M3FN>" in ins[0] and "tensor<760x128xf8E4M3FN>" in ins[0]
    assert "tensor<4x512x256xf8E4M3FN>" in ins[1] and "tensor<760x256xf8E4M3FN>" in ins[1]
    assert "tensor<760x512xbf16>" in outs[0]
    assert "tensor<760x512xbf16>" in ins[1]  # the first product, as the second's addend
    assert "tensor<760x512xbf16>" in outs[1]
    assert "x512xf32>" not in " ".join(outs)
    assert re.search(r"all_reduce.*tensor<760x512xbf16>", text, re.S)
    assert _no_weight_slices(text)
    # quantized before the pad: no padded bf16 activations
    assert not re.search(r"stablehlo.pad.*-> tensor<760x(128|256)xbf16>", text)


def test_stacked_pallas_path_reads_the_stack_in_place(monkeypatch):
    """'pallas' with stacked weights: the attention-out product comes from the stacked
    kernel in bf16 and enters the fused GEMM + all-reduce kernel as its addend; the fused
    kernel takes the whole down stack and the layer (no weight slice)."""
    text = _lower_block_for_cuda(monkeypatch, "pallas")
    calls = _calls(text)
    assert len(calls) == 2
    sigs = [ln.rsplit(":", 1)[-1] for ln in calls]
    assert "tensor<4x512x128xf8E4M3FN>" in sigs[0].split("->")[0]
    fused_in, fused_out = sigs[1].split("->")
    assert "tensor<4x512x256xf8E4M3FN>" in fused_in and "tensor<1xi32>" in fused_in
    assert "tensor<768x512xbf16>" in fused_in  # the addend
    assert "tensor<1x768x512xbf16>" in fused_out  # the receive buffer
    assert "all_reduce" not in text
    assert _no_weight_slices(text)


def test_stacked_pallas_at_tp1_runs_the_stream_k_gemms(monkeypatch):
    """At tp = 1 nothing is reduced: 'pallas' (what 'auto' picks on Hopper) with stacked
    weights lowers to the psum path's two stacked GEMMs, the stream-K kernel, the first
    product as the second's addend; no fused kernel."""
    from pallas_kernels import fp8_gemm_allreduce, fp8_gemm_stream_k

    text = _lower_block_for_cuda(monkeypatch, "pallas", tp=1)
    calls = _calls(text)
    assert len(calls) == 2
    assert fp8_gemm_stream_k.KERNEL_NAME in text and fp8_gemm_allreduce.KERNEL_NAME not in text
    sigs = [ln.rsplit(":", 1)[-1] for ln in calls]
    assert "tensor<760x512xbf16>" in sigs[1].split("->")[0]  # the addend chain


@pytest.mark.parametrize("method,tp", [("psum", 1), ("psum", 2), ("pallas", 2)])
def test_row_scales_reach_the_fused_and_stacked_kernels(monkeypatch, method, tp):
    """act_scale='row' on Hopper: every GEMM kernel takes the rows' scales (a [757] float32
    operand: the 757 real rows of the 760 or 768 it multiplies, not padded), the
    data-parallel fused kernel ('pallas' at tp >= 2) too."""
    text = _lower_block_for_cuda(monkeypatch, method, tp=tp, act_scale="row")
    calls = _calls(text)
    assert len(calls) == 2
    ins = [ln.rsplit(":", 1)[-1].split("->")[0] for ln in calls]
    assert all("tensor<757xf32>" in i for i in ins), ins
    # The weights' per-layer scales reach the kernels whole, not sliced per block.
    assert all("tensor<4xf32>" in i for i in ins), ins
    assert not [ln for ln in text.splitlines() if "dynamic_slice" in ln and "tensor<4xf32>" in ln]
    assert not re.search(r"stablehlo.pad.*-> tensor<\d+xf32>", text)
    assert _no_weight_slices(text)


@pytest.mark.parametrize("method,tp,act_scale", [("psum", 1, "row"), ("psum", 2, "tensor"),
                                                 ("pallas", 1, "row")])
def test_joined_out_down_is_one_gemm(monkeypatch, method, tp, act_scale):
    """Attention-out and MLP-down at the same layer (the model's block): attention-out
    leads MLP-down in one stream-K kernel that takes both stacks whole (and both rows'
    scales): one Mosaic call per block, no bf16 partial between two GEMMs. The fused
    kernel ('pallas' at tp >= 2) takes attention-out as its addend instead."""
    from pallas_kernels import fp8_gemm_stream_k

    text = _lower_block_for_cuda(monkeypatch, method, tp=tp, act_scale=act_scale, join=True)
    calls = _calls(text)
    assert len(calls) == 1, calls
    ins = calls[0].rsplit(":", 1)[-1].split("->")[0]
    assert "tensor<4x512x128xf8E4M3FN>" in ins and "tensor<4x512x256xf8E4M3FN>" in ins
    assert "tensor<760x128xf8E4M3FN>" in ins and "tensor<760x256xf8E4M3FN>" in ins
    if act_scale == "row":
        assert ins.count("tensor<757xf32>") == 2, ins
    assert fp8_gemm_stream_k.KERNEL_NAME in text
    if tp > 1:  # (at tp = 1 a psum of one device is dropped by XLA, later)
        assert ("all_reduce" in text) == (method == "psum")
    assert _no_weight_slices(text)
    assert len(_calls(_lower_block_for_cuda(monkeypatch, "pallas", tp=2, join=True))) == 2
