#!/usr/bin/env bash
# Numerics harness on the GPU machine (nvidia-h200-x2): characters-57b at REDUCED DEPTH
# (BLOCKS=4 of 60 blocks, full width: d=9216, 72 heads x 128, MLP 32256), tp=2, STEPS=20 steps.
# Reference: launch bf16 cache, reference attention, bf16 GEMMs (the same random weights the
# FP8 variants quantize), psum; RUNS=4 reference runs (base, inputs nudged 1 bf16 ulp, tp=1,
# identical repeat for XLA's GPU nondeterminism). Frames: DECODER=small decodes every step at
# full resolution (704x1088) with the config's decoder structure at channels / 8
# (128/64/32/16), fixed random weights; DECODER=config uses the full LTX-size decoder (slower).
# Writes $OUT/numerics57b.{json,png,md,log}; prints the table last. Stays under 3 minutes: variants
# not started after BUDGET_S=135 s are skipped (noted), and a hard LIMIT_S=170 s timeout
# still leaves the partial table (written after every variant).
#   bash benchmarks/gpu_numerics.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/numerics}
mkdir -p "$OUT"
CONFIG=${CONFIG:-characters-57b}
TP=${TP:-2}
BLOCKS=${BLOCKS:-4}
STEPS=${STEPS:-20}
RUNS=${RUNS:-4}
DECODER=${DECODER:-small}
# Most telling first: variants not started after BUDGET_S seconds are skipped with a note.
VARIANTS=${VARIANTS:-ring-fp8,fp8-attention,fp8-gemm,stacked-gemm,fused-reduce,ppermute,ring-bf16,production}
BUDGET_S=${BUDGET_S:-135}
echo "== numerics: $CONFIG reduced to $BLOCKS blocks (full width; characters-57b has 60), tp=$TP, $STEPS steps, $RUNS reference runs, decoder=$DECODER"
t0=$(date +%s)
timeout "${LIMIT_S:-170}" python3 -m characters_jax.cli numerics --config "$CONFIG" --blocks "$BLOCKS" --tp "$TP" \
  --steps "$STEPS" --runs "$RUNS" --decoder "$DECODER" --variants "$VARIANTS" --time-budget "$BUDGET_S" \
  --json "$OUT/numerics57b.json" --plot "$OUT/numerics57b.png" --table "$OUT/numerics57b.md" "$@" \
  > "$OUT/numerics57b.log" 2>&1
rc=$?
echo "== exit $rc after $(( $(date +%s) - t0 )) s (0: all within spread, 1: some variant flagged, 124: timed out)"
if [ -s "$OUT/numerics57b.md" ]; then
  grep -E "^\[numerics\].*(failed|Error)" "$OUT/numerics57b.log" | head -5
  sed -n '/^numerics:/,$p' "$OUT/numerics57b.log" | grep -vE "^\|" | head -8
  cat "$OUT/numerics57b.md" | tail -n +3
else
  tail -40 "$OUT/numerics57b.log"
fi
