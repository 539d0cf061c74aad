"""The profiler breakdown: `characters-jax bench --set bench.profile_dir=DIR` on CPU devices, and the classifier
on synthetic HLO / GPU kernel names (what the GPU trace carries)."""

import argparse
import json

import pytest

from characters_jax.measure import bench
from characters_jax.measure.profile import COMPONENTS, DeviceEvent, HloIndex, compute_breakdown, format_breakdown


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--config", "tiny", "--tp", "2", "--steps", "2", "--set", "bench.warmup=1", "--set", "bench.upkeep_steps_per_call=1",
        "--set", f"bench.profile_dir={out / 'trace'}", "--set", "bench.profile_steps=2", "--set", "bench.quiet=true",
    ])
    return bench.run_bench(args), out


def test_bench_profile_components_add_up(bench_result):
    r, out = bench_result
    b = r["breakdown"]
    assert "error" not in b, b
    comps = b["components_ms"]
    assert set(comps) == set(COMPONENTS)
    assert all(v >= 0 for v in comps.values())
    assert b["kernel_ms"] > 0
    assert sum(comps.values()) == pytest.approx(b["kernel_ms"], rel=1e-6)
    assert sum(b["components_share"].values()) == pytest.approx(1.0, rel=1e-6)
    assert b["busy_ms"] <= b["kernel_ms"] * 1.001 + 1e-6
    assert b["wall_ms"] > 0 and b["devices"] == ["cpu:0", "cpu:1"]
    assert b["scoped_share"] > 0.9  # CPU thunks name their HLO instructions
    # Written next to the trace, and printed by the bench.
    assert json.loads((out / "trace" / "breakdown.json").read_text())["steps"] == 2
    assert "profile breakdown" in bench.format_table(r)


def test_bench_profile_finds_the_named_scopes(bench_result):
    b = bench_result[0]["breakdown"]
    assert b["by_scope"]["attention"]["attention"] > 0
    assert b["by_scope"]["cache_upkeep"]["cache_upkeep"] > 0
    assert b["components_ms"]["attention"] > 0 and b["components_ms"]["cache_upkeep"] > 0
    assert b["components_ms"]["gemm"] > 0
    assert b["components_ms"]["collective"] > 0  # tp=2: one psum per block
    assert b["by_scope"]["out_down_reduce"]["collective"] > 0


HLO = """HloModule jit_program, is_scheduled=true

%fused_gemm (p0: f8e4m3fn[8,16], p1: f8e4m3fn[32,16]) -> f32[8,32] {
  %p0 = f8e4m3fn[8,16]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%body (arg: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %arg = (s32[], f32[8,32]) parameter(0)
  %cublas-gemm.1 = (f32[8,32]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(program)/while/body/qkv_proj/dot_general"}
  %triton_gemm.2 = f32[8,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_gemm, metadata={op_name="jit(program)/while/body/mlp_up/dot_general"}
  %loop_convert_fusion = bf16[8,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_gemm, metadata={op_name="jit(program)/while/body/cache_upkeep/convert_element_type"}
  %custom-call.7 = bf16[8,32]{1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(program)/while/body/attention/pallas_call"}
  %custom-call.8 = bf16[8,32]{1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(program)/while/body/out_down_reduce/pallas_call"}
  %custom-call.10 = bf16[8,32]{1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(program)/while/body/qkv_proj/pallas_call"}
  %custom-call.11 = bf16[8,32]{1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(program)/while/body/out_down_reduce/pallas_call"}
  %all-reduce-start.3 = bf16[8,32]{1,0} all-reduce-start(%y), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(program)/while/body/out_down_reduce/psum"}
  %add_rsqrt_fusion = f32[8,1]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(program)/while/body/rsqrt"}
  ROOT %tuple = (s32[], f32[8,32]) tuple(%i, %y)
}

ENTRY %main.1 (p: f32[8,32]) -> f32[8,32] {
  %p = f32[8,32]{1,0} parameter(0)
  ROOT %while.9 = (s32[], f32[8,32]) while(%init), condition=%cond, body=%body
}
"""


def test_classify_by_hlo_and_by_kernel_name():
    idx = HloIndex(HLO)
    assert idx.module == "jit_program"
    assert idx.classify("cublas-gemm.1", "sm90_xmma_gemm_e4m3") == ("gemm", "qkv_proj")
    assert idx.classify("triton_gemm.2", "triton_gemm_dot") == ("gemm", "mlp_up")
    assert idx.classify("loop_convert_fusion", "loop_convert_fusion") == ("cache_upkeep", "cache_upkeep")
    assert idx.classify("custom-call.7", "attention_kernel") == ("attention", "attention")
    assert idx.classify("custom-call.8", "fused_kernel") == ("gemm_allreduce", "out_down_reduce")
    assert idx.classify("all-reduce-start.3", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == ("collective", "out_down_reduce")
    # Pallas kernels by the names they carry into the trace: the stacked GEMM is a GEMM in
    # any scope, the fused kernel a GEMM + all-reduce (not a collective, despite its name).
    from pallas_kernels import fp8_attention, fp8_gemm_allreduce
    gemm_name = fp8_gemm_allreduce.GEMM_KERNEL_NAME + "_mosaic_gpu_kernel"
    fused_name = fp8_gemm_allreduce.KERNEL_NAME + "_mosaic_gpu_kernel"
    assert idx.classify("custom-call.10", gemm_name) == ("gemm", "qkv_proj")
    assert idx.classify("custom-call.11", gemm_name) == ("gemm", "out_down_reduce")
    assert idx.classify("custom-call.11", fused_name) == ("gemm_allreduce", "out_down_reduce")
    assert idx.classify("custom-call.7", fp8_attention.KERNEL_NAME + "_mosaic_gpu_kernel") == ("attention", "attention")
    # Unnamed Mosaic kernels (older traces: 'body_mosaic_gpu_kernel') go by their scope.
    assert idx.classify("custom-call.10", "body_mosaic_gpu_kernel") == ("gemm", "qkv_proj")
    assert idx.classify("custom-call.11", "body_mosaic_gpu_kernel") == ("gemm_allreduce", "out_down_reduce")
    assert idx.classify("add_rsqrt_fusion", "add_rsqrt_fusion") == ("other", "unscoped")
    assert idx.is_container("while.9")
    # No hlo_op stat (e.g. kernels replayed from a command buffer): the fusion's kernel name.
    assert idx.classify(None, "loop_convert_fusion") == ("cache_upkeep", "cache_upkeep")
    assert idx.classify(None, "triton_gemm_2") == ("gemm", "mlp_up")
    # Events that name no instruction of the program: the kernel name decides.
    none = HloIndex("")
    assert none.classify(None, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL")[0] == "collective"
    assert none.classify(None, "sm90_xmma_gemm_e4m3e4m3_f32_tn_n_tilesize128x128x64")[0] == "gemm"
    assert none.classify(None, "cutlass3x_sm90_tensorop_gemm")[0] == "gemm"
    assert none.classify(None, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16")[0] == "attention"
    assert none.classify(None, "loop_add_fusion")[0] == "other"
    assert none.classify(None, "x", "jit(program)/while/body/attention/exp") == ("attention", "attention")


def test_breakdown_nesting_overlap_and_gaps():
    """A container (while) is not counted; a nested thunk's time is its own; a collective on a
    second stream overlapping compute raises kernel time above busy time."""
    idx = HloIndex(HLO)
    ev = lambda line, s, e, op, kernel=None: DeviceEvent("gpu:0", line, s, e, kernel or op, op, "jit_program", "")
    events = [
        ev("Stream #1", 0, 1000, "while.9"),
        ev("Stream #1", 100, 400, "cublas-gemm.1", "sm90_xmma_gemm"),
        ev("Stream #1", 400, 600, "custom-call.7"),
        ev("Stream #1", 600, 700, "loop_convert_fusion"),
        ev("Stream #2", 500, 800, "all-reduce-start.3", "ncclDevKernel_AllReduce"),
        ev("Stream #1", 900, 1000, "add_rsqrt_fusion"),
        DeviceEvent("gpu:0", "Stream #1", 0, 50, "other_module_kernel", "x", "jit_other", ""),  # another program: dropped
    ]
    b = compute_breakdown(events, idx, steps=1, wall_ms=[0.002])
    ms = b["components_ms"]
    assert ms["gemm"] == pytest.approx(300e-6)
    assert ms["attention"] == pytest.approx(200e-6)
    assert ms["cache_upkeep"] == pytest.approx(100e-6)
    assert ms["collective"] == pytest.approx(300e-6)
    assert ms["other"] == pytest.approx(100e-6)
    assert b["kernel_ms"] == pytest.approx(1000e-6)
    assert b["busy_ms"] == pytest.approx(800e-6)  # 100..800 and 900..1000
    assert b["overlap_ms"] == pytest.approx(200e-6)
    assert b["launch_gap_ms"] == pytest.approx(0.002 - 800e-6)
    assert "collective" in format_breakdown(b)
