#!/usr/bin/env bash
# One call on nvidia-h200 (~5 min): the stacked GEMM's default (stream-K) against the
# data-parallel tiling and torch._scaled_mm, its GPU tests; then the attention's defaults
# (V^T as the engine caches it, and plain V) and GPU runs 6-19's kernel against cuDNN and
# PyTorch at HEADS (default 18,36). Every stage under a timeout.
# Output: $OUT/summary.txt, gemm.tgz, attn.tgz (the device returns at most 8 files).
#   OUT=/some/dir bash benchmarks/gpu_final_check.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/final_out}; mkdir -p "$OUT/gemm" "$OUT/attn"
timeout -k 10 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fp8_gemm_stacked.py \
  > "$OUT/gemm/tests.log" 2>&1; echo "gemm tests rc=$?"
timeout -k 10 170 python3 benchmarks/bench_gemm_stacked.py --out "$OUT/gemm" --variants kernel_m760 \
  --configs m128n128s3 --torch --repeats 9 --budget-s 120 > "$OUT/gemm/gemm.log" 2>&1
echo "gemm bench rc=$?"
OUT=$OUT/attn HEADS=${HEADS:-18,36} CONTENDERS=1 VARIANTS_A=default_vt \
  VARIANTS_B=default,kv_split_s2_lpv_fast_np TESTS_K=impl \
  T_A=100 T_B=80 T_TESTS=60 bash benchmarks/run_attention_gpu.sh > "$OUT/attn/run.log" 2>&1
echo "attention rc=$?"
{ grep -E "passed|failed" "$OUT/gemm/tests.log" | tail -2
  sed -n '/==== stacked FP8 GEMM/,$p' "$OUT/gemm/gemm.log" | head -12
  tail -22 "$OUT/attn/run.log"; } | tee "$OUT/summary.txt"
for d in gemm attn; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
