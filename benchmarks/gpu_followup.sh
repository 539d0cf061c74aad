#!/usr/bin/env bash
# The measurements that followed the 2026-11-30 ablation (run F), in one call on
# nvidia-h200-x2 (~3-6 minutes; every stage under a timeout):
#   GPU 1: the FP8 linear and stacked GEMM GPU tests (the FP8 weight stays FP8 at a model
#          shape; the stacked GEMM's narrow tiles in a scan);
#   GPU 0, at the same time: characters-57b at tp=1 with the stacked GEMMs (`auto`);
#   then both GPUs: one block against PyTorch with the stacked Pallas GEMMs
#          (benchmarks/torch_block_reference.py; issue 6's block ratio), and the default
#          step (ring_fused) profiled with XLA command buffers off, so that the trace names
#          the Pallas kernels (gpu_issue6.sh PROFILE_PLAIN=1).
# Output under $OUT (at most 8 files): step57b_tp1.json, block_reference.json, logs.tar.gz
# (tests, tp=1, block and profile logs), profile/ (3 files); a summary last.
# About 6 minutes.
#   bash benchmarks/gpu_followup.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/gpu_followup}
mkdir -p "$OUT"
START=$SECONDS

( CUDA_VISIBLE_DEVICES=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 150 python3 -m pytest -q -s -m gpu \
    -p no:cacheprovider tests/test_fp8_linear.py tests/test_fp8_gemm_stacked.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log" ) &
CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 -m characters_jax.cli bench --config characters-57b --tp 1 \
  --mode ring --steps 10 --warmup 2 --upkeep-steps-per-call 2 --json "$OUT/step57b_tp1.json" > "$OUT/bench_tp1.log" 2>&1
echo "bench tp=1 rc=$? after $(( SECONDS - START ))s"
wait
echo "tests done after $(( SECONDS - START ))s"
timeout -k 10 170 python3 benchmarks/torch_block_reference.py --json "$OUT/block_reference.json" \
  --torch-timeout 80 > "$OUT/block.log" 2>&1
echo "block reference rc=$? after $(( SECONDS - START ))s"

OUT="$OUT/profile" VARIANTS=ring_fused EXTRAS=0 PROFILE_PLAIN=1 STEPS=10 PROFILE_STEPS=2 \
  DEADLINE_S=$(( 560 - (SECONDS - START) )) bash benchmarks/gpu_issue6.sh > "$OUT/profile.log" 2>&1
echo "profile without command buffers: rc=$? after $(( SECONDS - START ))s"

echo "== summary"
grep -E "passed|failed|rc=" "$OUT/tests.log" | tail -4
grep -E "step p50|fits|temporaries|compile " "$OUT/bench_tp1.log" | head -5
grep -E "^block JAX|JAX FP8 GEMMs" "$OUT/block.log"
sed -n '/component/,/^block_/p' "$OUT/block.log" | head -20
grep -A3 "issue 6 summary" "$OUT/profile.log"
# At most 8 files come back from the device: the logs travel as one archive.
( cd "$OUT" && tar czf logs.tar.gz tests.log bench_tp1.log block.log profile.log && rm -f tests.log bench_tp1.log block.log profile.log )
ls -R "$OUT"
