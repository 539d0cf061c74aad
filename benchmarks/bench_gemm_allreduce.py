"""The block's row-parallel reduction: attention-out + MLP-down summed over ``--tp`` GPUs,
through the model's API under each method, against PyTorch (``_scaled_mm`` + NCCL).

One GPU's operands of a config at tp (needs tp devices): the attention output [M, heads /
tp x head_dim] and the MLP hidden [M, mlp / tp] in bf16, the stacked FP8 weights
[L, d_model, K / tp] of out and down read at the scan's layer, the activations quantized
inside with the config's activation scales.

  psum_alone  ``lax.psum`` of the [M, d_model] bf16 result (the reduction's own cost)
  psum        ``row_parallel_matmul_reduce(method='psum')``: the stacked GEMMs, then psum
  ppermute    the portable ring (reduce-scatter + all-gather of row chunks by ppermute)
  pallas      the fused Pallas GEMM + all-reduce (NVIDIA sm_90 only)
  torch       per GPU ``_scaled_mm`` of both products, summed, then a NCCL all-reduce
              (torch.distributed, one process per GPU, run before the JAX rows)
  torch_allreduce_alone  the NCCL all-reduce alone

Time: L calls (the config's blocks) in one jitted scan, per call = scan time / L, median over
``--repeats``; torch L calls between CUDA events. Error: the last layer's output against
float32 on the host. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

    python3 benchmarks/bench_gemm_allreduce.py --config characters-57b --tp 2 --out $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 benchmarks/bench_gemm_allreduce.py --smoke
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile

from _common import (Results, Shapes, cuda_event_times_us, default_out, finish, fp8_stack, load_shapes, looped,
                     median_us, names_of, parser, rel_err, torch_cuda_missing, torch_fp8_operands)

METHODS = ("psum", "ppermute", "pallas")


def run_jax(res: Results, s: Shapes, methods, repeats: int, seed: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from characters_jax.parallel.fp8_linear import Fp8Weight
    from characters_jax.parallel.row_parallel import row_parallel_matmul_reduce
    from pallas_kernels import fp8_gemm_allreduce

    mesh = Mesh(np.array(jax.devices()[:s.tp]), ("tp",))
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    ko, kd = s.attention_width * s.tp, s.mlp * s.tp
    keys = iter(jax.random.split(jax.random.key(seed), 8))

    def stack(k):
        values = fp8_stack(next(keys), s.layers, s.d_model, k, shard(P(None, None, "tp")))
        return Fp8Weight(values=values, scale=jax.device_put(jnp.full((s.layers,), k ** -0.5 / 16, jnp.float32), shard(P())))

    a = jax.device_put(jax.random.normal(next(keys), (s.tokens, ko), jnp.bfloat16), shard(P(None, "tp")))
    b = jax.device_put(jax.random.normal(next(keys), (s.tokens, kd), jnp.bfloat16), shard(P(None, "tp")))
    wo, wd = stack(ko), stack(kd)
    last = s.layers - 1

    def f32(w):
        return np.asarray(w.values[last], np.float32) * float(w.scale[last])

    ref = np.asarray(a, np.float32) @ f32(wo).T + np.asarray(b, np.float32) @ f32(wd).T
    wspec = Fp8Weight(values=P(None, None, "tp"), scale=P())
    case = f"out+down ({s.d_model} x {ko // s.tp}+{kd // s.tp}, tp={s.tp})"
    flop = 2 * s.tokens * s.d_model * (ko + kd) // s.tp

    def block(method):
        def body(a, b, wo, wd, i):
            at = lambda w: Fp8Weight(values=w.values, scale=w.scale, layer=i)  # noqa: E731
            return row_parallel_matmul_reduce([(a, at(wo)), (b, at(wd))], method=method,
                                              out_dtype=jnp.bfloat16, act_scale=s.activation_scale)
        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), wspec, wspec, P()),
                             out_specs=P(), check_vma=False)

    def timed(fn, operands, check=True):
        def run():
            us = median_us(looped(fn, s.layers), operands, repeats, per=s.layers)
            out = {"us": us}
            if check:
                out["rel_err"] = rel_err(jax.jit(fn)(*operands, jnp.int32(last)), ref)
                out["flop"] = flop
            return out
        return run

    partial = jax.device_put(jnp.ones((s.tokens * s.tp, s.d_model), jnp.bfloat16), shard(P("tp")))
    psum = jax.shard_map(lambda p, i: lax.psum(p, "tp"), mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(), check_vma=False)
    res.measure(case, "psum_alone", timed(psum, (partial,), check=False))
    for method in methods:
        if method == "pallas" and not fp8_gemm_allreduce.is_supported():
            res.skip(case, method, "needs NVIDIA sm_90 GPUs")
            continue
        res.measure(case, method, timed(block(method), (a, b, wo, wd)))


def _torch_worker(rank: int, s: Shapes, repeats: int, path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=s.tp)
    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(rank)
    ops = []
    for k in (s.attention_width, s.mlp):
        x, w = torch_fp8_operands(s, k, s.d_model, dev, gen)
        ops.append((x, w, torch.tensor(1 / 16, device=dev), torch.tensor(k ** -0.5 / 16, device=dev)))

    def block(layer):
        out = None
        for x, w, sa, sb in ops:
            y = torch._scaled_mm(x, w[layer].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            out = y if out is None else out + y
        dist.all_reduce(out)
        return out

    buf = torch.ones((s.rows, s.d_model), device=dev, dtype=torch.bfloat16)
    rows = {}
    for name, call in (("torch", block), ("torch_allreduce_alone", lambda _: dist.all_reduce(buf))):
        dist.barrier()
        rows[name] = statistics.median(cuda_event_times_us(call, s.layers, repeats))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run_torch(res: Results, s: Shapes, repeats: int) -> None:
    import torch
    import torch.multiprocessing as mp

    case = f"out+down ({s.d_model} x {s.attention_width}+{s.mlp}, tp={s.tp})"
    if torch.cuda.device_count() < s.tp:
        res.skip(case, "torch", f"needs {s.tp} GPUs, torch sees {torch.cuda.device_count()}")
        return
    path = os.path.join(tempfile.mkdtemp(), "torch.json")
    mp.spawn(_torch_worker, args=(s, repeats, path), nprocs=s.tp, join=True)
    with open(path) as f:
        for name, us in json.load(f).items():
            res.add(case=case, impl=name, us=us, **({} if "alone" in name else {
                "flop": 2 * s.tokens * s.d_model * (s.attention_width + s.mlp)}))


def main(argv=None) -> int:
    p = parser(__doc__, 2, "GPUs the products are summed over", "CPU check (2 host devices): small config, 2 layers")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
    p.add_argument("--layers", type=int, default=None, help="stack depth (default: the config's blocks)")
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args(argv)
    methods = names_of(a.methods, METHODS, "bench_gemm_allreduce: methods")
    if methods is None:
        return 2
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    s = load_shapes("small" if a.smoke else a.config, a.tp)
    s = dataclasses.replace(s, layers=a.layers or (2 if a.smoke else s.layers))
    why = "--no-torch" if a.no_torch else ("smoke run" if a.smoke else torch_cuda_missing())
    import jax

    res = Results(a.out or default_out(), "gemm_allreduce",
                  {"config": s.config, "tp": s.tp, "tokens": s.tokens, "layers": s.layers,
                   "activation_scale": s.activation_scale, "seed": a.seed, "jax": jax.__version__,
                   "devices": [d.device_kind for d in jax.devices()[:s.tp]], "torch": why or "yes"})
    if why is None:
        res.run_case("torch", lambda: run_torch(res, s, a.repeats))
    if len(jax.devices()) < s.tp:
        res.skip("jax", "-", f"needs {s.tp} devices, found {len(jax.devices())}")
    else:
        res.run_case("jax", lambda: run_jax(res, s, methods, 1 if a.smoke else a.repeats, a.seed))
    return finish(res)


if __name__ == "__main__":
    sys.exit(main())
