#!/usr/bin/env bash
# One call on ONE GPU (nvidia-h200) that checks what was prepared on CPU and measures it:
#   1. the GPU tests of the kernels (stacked GEMM, qkv prepare, row quantize);
#   2. the numerics harness on the default per-row path (57b at 4 blocks, tp=1; the fused
#      qkv kernel and the per-layer scale stacks included);
#   3. the tp=4 share's step from this tree and from BASE_REV's (A/B/A), the latter
#      extracted with git archive into .ab/base (run where the repository's .git is, i.e.
#      prepare .ab/base on the CPU machine and let it travel with the tree; the script
#      only checks that it is there).
# Prepare (CPU machine):  mkdir -p .ab/base && git archive "$BASE_REV" | tar -x -C .ab/base
# Run (repository root):  bash benchmarks/gpu_check_prepared.sh
# Knobs: DEADLINE_S (570), PARTS ("tests numerics step"). Everything goes to $OUT (7 files:
# tests.log, summary.txt, num/numerics57b.{json,log}, share/step_tp4_tree{0,1,2}.tar.gz).
source "$(dirname "$0")/_gpu_prologue.sh" out/gpu_check_prepared 570
PARTS=${PARTS:-"tests numerics step"}
for part in $PARTS; do
  case $part in
    tests)
      t=$(left_max 150)
      ( PYTHONPATH=. timeout "$t" python3 -m pytest -q -m gpu tests/test_fp8_gemm_stacked.py \
          tests/test_fp8_qkv_prepare.py tests/test_fp8_row_quantize.py > "$OUT/tests.log" 2>&1 )
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt" ;;
    numerics)
      t=$(left_max 240)
      OUT="$OUT/num" TP=1 RUNS=3 VARIANTS=stacked-gemm-row BUDGET_S=$(( t - 60 )) LIMIT_S="$t" \
        bash benchmarks/gpu_numerics.sh > "$OUT/numerics.log" 2>&1
      echo "numerics: rc=$?" | tee -a "$OUT/summary.txt"
      grep -E "^\| (\*\*reference|stacked)" "$OUT/numerics.log" | tee -a "$OUT/summary.txt" ;;
    step)
      if [ ! -d .ab/base ]; then echo "step: no .ab/base (see the header)" | tee -a "$OUT/summary.txt"; continue; fi
      OUT="$OUT/share" PARTS=step SHARES=4 TREES=". .ab/base ." STEP_VARIANTS=ring_fused_row \
        STEPS=8 WARMUP=1 V_LIMIT_S=80 DEADLINE_S=$(left) bash benchmarks/gpu_tp_share.sh > "$OUT/share.log" 2>&1
      grep -E "^step|^tp1_" "$OUT/share.log" | tee -a "$OUT/summary.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
# At most 8 files come back: keep the logs that say more than the summary.
rm -f "$OUT/numerics.log" "$OUT/share.log" "$OUT/share/summary.txt" "$OUT"/num/*.png "$OUT"/num/*.md
echo "total $(( SECONDS - START )) s" | tee -a "$OUT/summary.txt"
