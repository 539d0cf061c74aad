#!/usr/bin/env bash
# One GPU's share of a tensor-parallel characters-57b, measured on ONE GPU (nvidia-h200):
#   tests  the GPU tests of the stacked FP8 GEMM and the row-quantize kernels
#          (tests/test_fp8_gemm_stacked.py, tests/test_fp8_row_quantize.py; TESTS_K: a -k filter)
#   quant  benchmarks/bench_row_quantize.py: the row-quantize kernels' layouts against XLA
#   gemm   benchmarks/bench_gemm_stacked.py at the per-GPU shapes of tp = N for each N in
#          SHARES, against torch._scaled_mm in the same process
#   step   the step of a model cut to one GPU's share of tp = N (num_heads / N, mlp_dim / N;
#          the residual width, norms, modulation and cache rows as at tp = N), run at tp = 1:
#          what one GPU of the tp = N step computes, without the row-parallel all-reduce
#          (at tp = 1 the block's o and MLP-down GEMMs chain through the addend instead of
#          running the fused GEMM + all-reduce)
# Run from the repository root:   bash benchmarks/gpu_tp_share.sh
# Knobs: PARTS ("tests gemm step"; also "quant"), QUANT_LIMIT_S (240), SHARES ("4 3"), TREES (". ": repository trees the step
# runs from, in order, e.g. ". .ab/old ." for an A/B/A comparison of two code versions in one
# call; each needs benchmarks/gpu_issue6.sh), STEPS (10), WARMUP (2), V_LIMIT_S (150),
# GEMM_BUDGET_S (100), STEP_VARIANTS (ring_fused: gpu_issue6.sh's variants), BASE_CONFIG (configs/characters-57b.toml), DEADLINE_S (560).
# Everything goes to $OUT: gemm_tp<N>.json, one step tarball per tree and share
# (step_tp<N>_tree<i>.tar.gz: step JSON, breakdown, logs), tests.log, summary.txt.
# CPU smoke test: PARTS=step SHARES=2 BASE_CONFIG=configs/tiny.toml STEPS=2 WARMUP=1 \
#   ATTN_FP8=reference REDUCE_FUSED=psum bash benchmarks/gpu_tp_share.sh
source "$(dirname "$0")/_gpu_prologue.sh" out/gpu_tp_share 560
PARTS=${PARTS:-"tests gemm step"}
SHARES=${SHARES:-"4 3"}
TREES=${TREES:-.}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
V_LIMIT_S=${V_LIMIT_S:-150}
GEMM_BUDGET_S=${GEMM_BUDGET_S:-100}
BASE_CONFIG=${BASE_CONFIG:-configs/characters-57b.toml}
ROOT=$(pwd)
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"

# share_config N: writes one GPU's share of BASE_CONFIG at tp = N and prints its path.
share_config() {
  python3 - "$ROOT/$BASE_CONFIG" "$1" "$OUT/share_tp$1.toml" <<'EOF'
import re, sys, tomllib
src, n, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
text = open(src).read()
model = tomllib.loads(text)["model"]
for key in ("num_heads", "mlp_dim"):
    if model[key] % n:
        sys.exit(f"{key} = {model[key]} does not split {n} ways")
    text = re.sub(rf"(?m)^{key} = \d+", f"{key} = {model[key] // n}", text, count=1)
text = re.sub(r'(?m)^name = "([^"]*)"', rf'name = "\1-share-of-tp{n}"', text, count=1)
open(dst, "w").write(text)
print(dst)
EOF
}

for part in $PARTS; do
  case $part in
    tests)
      t=$(left_max 120)
      ( PYTHONPATH=. timeout "$t" python3 -m pytest -q -m gpu tests/test_fp8_gemm_stacked.py \
          tests/test_fp8_row_quantize.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/tests.log" 2>&1 )
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" | tee -a "$SUMMARY" ;;
    quant)
      t=$(left_max "${QUANT_LIMIT_S:-240}")
      PYTHONPATH=. timeout "$t" python3 benchmarks/bench_row_quantize.py --out "$OUT" \
        > "$OUT/quant.log" 2>&1
      echo "quant: rc=$?" | tee -a "$SUMMARY"
      sed -n '/^us per call/,$p' "$OUT/quant.log" | tee -a "$SUMMARY"
      grep -v "done$" "$OUT/quant.log" | grep -v "^us per call" | grep -vi deprecat | head -20 >> "$SUMMARY"
      rm -f "$OUT/quant.log" ;;
    gemm)
      for n in $SHARES; do
        t=$(left); (( t < 60 )) && { echo "gemm tp=$n: skipped" | tee -a "$SUMMARY"; continue; }
        PYTHONPATH=. timeout "$t" python3 benchmarks/bench_gemm_stacked.py --tp "$n" --out "$OUT/g$n" \
          --variants kernel_m760 --torch --repeats 9 --budget-s "$GEMM_BUDGET_S" > "$OUT/g$n.log" 2>&1
        echo "gemm tp=$n: rc=$?" | tee -a "$SUMMARY"
        mv "$OUT/g$n/gemm_stacked.json" "$OUT/gemm_tp$n.json" 2>/dev/null
        sed -n '/==== stacked FP8 GEMM/,$p' "$OUT/g$n.log" | tee -a "$SUMMARY"
        rm -rf "$OUT/g$n" "$OUT/g$n.log"
      done ;;
    step)
      for n in $SHARES; do
        cfg=$(share_config "$n") || { echo "share tp=$n: no config" | tee -a "$SUMMARY"; continue; }
        i=0
        for tree in $TREES; do
          t=$(left); d="$OUT/step_tp${n}_tree$i"
          if (( t < 60 )); then echo "step tp=$n tree $i ($tree): skipped" | tee -a "$SUMMARY"; i=$((i + 1)); continue; fi
          ( cd "$ROOT/$tree" && OUT="$d" CONFIG="$cfg" TP=1 VARIANTS="${STEP_VARIANTS:-ring_fused}" EXTRAS=0 \
              STEPS="$STEPS" WARMUP="$WARMUP" PROFILE_STEPS=2 PROFILE_PLAIN=1 V_LIMIT_S="$V_LIMIT_S" \
              DEADLINE_S="$t" bash benchmarks/gpu_issue6.sh > "$d.log" 2>&1 )
          echo "step tp=$n tree $i ($tree):" | tee -a "$SUMMARY"
          sed -n '/== issue 6 summary/,$p' "$d.log" | tee -a "$SUMMARY"
          mv "$d.log" "$d/run.log" 2>/dev/null; cp "$cfg" "$d/" 2>/dev/null
          tar -czf "$d.tar.gz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"
          i=$((i + 1))
        done
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
rm -f "$OUT"/share_tp*.toml  # each step tarball's logs hold the config it ran
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
