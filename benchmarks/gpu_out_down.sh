#!/usr/bin/env bash
# Attention-out + MLP-down joined in one stream-K GEMM, on ONE GPU (nvidia-h200):
#   tests  the stacked GEMM's GPU tests of the lead product and the stream-K schedule
#   gemm   benchmarks/bench_out_down.py: chained against joined at the tp = 4, 2, 3 shapes
#   step   the tp=4 share's step (gpu_tp_share.sh), joined (ring_fused_row, the default)
#          against chained (ring_fused_chained), chained first (each in its own process)
# Run from the repository root:   bash benchmarks/gpu_out_down.sh
# Knobs: PARTS ("tests gemm step"), DEADLINE_S (570), GEMM_ARGS (extra bench_out_down.py arguments). Everything goes to $OUT (summary.txt,
# tests.log, out_down.json, share/step_tp4_tree0.tar.gz).
source "$(dirname "$0")/_gpu_prologue.sh" out/gpu_out_down 570
PARTS=${PARTS:-"tests gemm step"}
for part in $PARTS; do
  case $part in
    tests)
      t=$(left_max 120)
      ( PYTHONPATH=. timeout "$t" python3 -m pytest -q -m gpu tests/test_fp8_gemm_stacked.py \
          -k "lead or stream_k or inside_scan" > "$OUT/tests.log" 2>&1 )
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt" ;;
    gemm)
      t=$(left_max 240)
      PYTHONPATH=. timeout "$t" python3 benchmarks/bench_out_down.py --out "$OUT" ${GEMM_ARGS:-} > "$OUT/gemm.log" 2>&1
      echo "gemm: rc=$?" | tee -a "$OUT/summary.txt"
      grep "^tp=" "$OUT/gemm.log" | tee -a "$OUT/summary.txt"; grep -v "^tp=" "$OUT/gemm.log" | grep -vi deprecat | tail -5 >> "$OUT/summary.txt"; rm -f "$OUT/gemm.log" ;;
    step)
      OUT="$OUT/share" PARTS=step SHARES=4 TREES=. \
        STEP_VARIANTS="ring_fused_chained ring_fused_row" \
        STEPS=8 WARMUP=1 V_LIMIT_S=75 DEADLINE_S=$(left) bash benchmarks/gpu_tp_share.sh > "$OUT/share.log" 2>&1
      grep -E "^step|^tp1_" "$OUT/share.log" | tee -a "$OUT/summary.txt"; rm -f "$OUT/share.log" "$OUT/share/summary.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "total $(( SECONDS - START )) s" | tee -a "$OUT/summary.txt"
