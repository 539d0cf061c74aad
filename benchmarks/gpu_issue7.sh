#!/usr/bin/env bash
# Issue 7 on nvidia-h200-x4 (4 x H200), in two device calls of at most ~9 minutes each:
#   PART=tp4  characters-57b at tp=4 (the reference system's layout), every ablation variant
#             of benchmarks/gpu_issue6.sh (launch, ring_cudnn, ring_fp8, ring_stacked,
#             ring_fused, ring_fused_tensor: the default's per-row activation scales against
#             per tensor, ring_fused_xqkv: without the fused qkv kernel, ring_fused_sk) with
#             profiles and the plot (the guarded runs skip what no longer fits the deadline,
#             last first; ring_stacked, the NCCL psum, second: the fused kernel's exchange
#             against it is the first figure to read at tp=4);
#   PART=tp3  characters-57b at tp=3 (an odd GPU count) for ring_fused, ring_fused_sk and
#             ring_stacked, the
#             decoder on the fourth GPU running alongside (benchmarks/decoder_overlap.py
#             --tp 3 --decoder-device 3), then the FP8 GEMM + all-reduce benchmark at tp=4
#             and tp=3 (fused kernel vs XLA + NCCL psum vs PyTorch _scaled_mm + NCCL).
# Run from the repository root:   PART=tp4 bash benchmarks/gpu_issue7.sh ; PART=tp3 bash ...
# Output under $OUT (at most 8 files come back): tp4/ or tp3/ from gpu_issue6.sh
# (results.tar.gz, logs.tar.gz, breakdown.png) and, for tp3, gemm_tp4.json / gemm_tp3.json
# plus their logs in gemm_logs.tar.gz. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# Knobs: PART (tp4), STEPS (46: the position reset falls in the window), DEADLINE_S (540).
# CPU smoke test (4 virtual devices, tiny config):
#   PART=tp4 CONFIG=tiny BLOCK_ARGS=--dry-run ATTN_CUDNN=xla ATTN_FP8=reference \
#   REDUCE_FUSED=ppermute XLA_FLAGS=--xla_force_host_platform_device_count=4 bash benchmarks/gpu_issue7.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/gpu_issue7}
PART=${PART:-tp4}
STEPS=${STEPS:-46}
DEADLINE_S=${DEADLINE_S:-540}
START=$SECONDS
mkdir -p "$OUT"
export STEPS WARMUP=${WARMUP:-3} PROFILE_STEPS=${PROFILE_STEPS:-2}

case $PART in
  tp4)
    OUT="$OUT/tp4" TP=4 EXTRAS=0 DEADLINE_S=$DEADLINE_S \
      VARIANTS=${VARIANTS-"ring_fused ring_stacked ring_fused_tensor ring_fused_xqkv ring_fused_sk launch ring_cudnn ring_fp8"} bash benchmarks/gpu_issue6.sh
    ;;
  tp3)
    OUT="$OUT/tp3" TP=3 DECODER_GPU=3 EXTRAS=overlap DEADLINE_S=$(( DEADLINE_S - 170 )) \
      VARIANTS=${VARIANTS-"ring_fused ring_fused_sk ring_stacked"} bash benchmarks/gpu_issue6.sh
    LOGS=$(mktemp -d)
    for tp in 4 3; do
      left=$(( DEADLINE_S - (SECONDS - START) - 10 ))
      limit=$(( left < 80 ? left : 80 ))
      if (( limit < 30 )); then echo "== gemm tp=$tp: skipped (${left}s left)"; continue; fi
      echo "== gemm tp=$tp (timeout ${limit}s)"
      timeout -k 10 "$limit" python3 benchmarks/bench_gemm_allreduce.py --tp "$tp" --out "$LOGS/tp$tp" \
        --reps 20 --repeats 3 --budget-s $(( limit - 25 )) > "$LOGS/gemm_tp$tp.log" 2>&1
      echo "   rc=$?"
      cp "$LOGS/tp$tp/gemm_allreduce.json" "$OUT/gemm_tp$tp.json" 2>/dev/null || true
      sed -n '/==== summary/,$p' "$LOGS/gemm_tp$tp.log" | head -30
    done
    tar czf "$OUT/gemm_logs.tar.gz" -C "$LOGS" . || true
    ;;
  *) echo "PART must be tp4 or tp3, got $PART"; exit 2 ;;
esac
echo "== issue 7 part $PART done in $(( SECONDS - START ))s"; ls -R "$OUT" | head -20
