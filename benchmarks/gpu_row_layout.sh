#!/usr/bin/env bash
# The row-quantize kernels' layout, chosen and checked in one call on ONE GPU (nvidia-h200):
#   1. their GPU tests (tests/test_fp8_row_quantize.py -m gpu);
#   2. benchmarks/bench_row_quantize.py over its layouts at every case;
#   3. the layout with the least total time over the tp=4 cases (norm:9216, gelu:8064,
#      none:2304; each runs 240 times a step) becomes DEFAULT_LAYOUT in a copy of the tree
#      (.ab/best_layout), and the tp=4 share's step runs from this tree and from that copy
#      (benchmarks/gpu_tp_share.sh, TREES=". .ab/best_layout").
# Run from the repository root:   bash benchmarks/gpu_row_layout.sh
# Knobs: DEADLINE_S (560), STEP_VARIANTS (ring_fused_row), QUANT_ARGS (extra
# bench_row_quantize.py arguments, e.g. "--unrolled --layouts 1x2048x8 1x2048x16"),
# QUANT_LIMIT_S (240). Everything goes to $OUT.
source "$(dirname "$0")/_gpu_prologue.sh" out/gpu_row_layout 560
( PYTHONPATH=. timeout 120 python3 -m pytest -q -m gpu tests/test_fp8_row_quantize.py > "$OUT/tests.log" 2>&1 )
echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" | tee "$OUT/summary.txt"
PYTHONPATH=. timeout "${QUANT_LIMIT_S:-240}" python3 benchmarks/bench_row_quantize.py --out "$OUT" ${QUANT_ARGS:-} > "$OUT/quant.log" 2>&1
echo "quant: rc=$?" | tee -a "$OUT/summary.txt"
sed -n '/^us per call/,$p' "$OUT/quant.log" | tee -a "$OUT/summary.txt"
BEST=$(python3 - "$OUT/row_quantize.json" <<'EOF'
import json, math, sys
us = json.load(open(sys.argv[1]))["us"]
cases = [c for c in ("norm:9216", "gelu:8064", "none:2304") if c in us]
names = [n for n in us[cases[0]] if not n.startswith("xla")]
total = {n: sum(min(us[c][n]) for c in cases) for n in names}
total = {n: t for n, t in total.items() if math.isfinite(t)}
print(min(total, key=total.get) if total else "")
EOF
)
echo "best layout over the tp=4 cases: ${BEST:-none}" | tee -a "$OUT/summary.txt"
if [ -n "$BEST" ]; then
  rm -rf .ab/best_layout && mkdir -p .ab/best_layout
  cp -r characters_jax pallas_kernels benchmarks configs pyproject.toml .ab/best_layout/
  LAYOUT=$(PYTHONPATH=. python3 -c "import sys; sys.path.insert(0, 'benchmarks')
import bench_row_quantize as b; l = b.parse_layout('$BEST')
print(repr(l))")
  sed -i "s/^DEFAULT_LAYOUT = Layout()$/DEFAULT_LAYOUT = $LAYOUT/" .ab/best_layout/pallas_kernels/fp8_row_quantize.py
  grep -n "^DEFAULT_LAYOUT" .ab/best_layout/pallas_kernels/fp8_row_quantize.py | tee -a "$OUT/summary.txt"
  OUT="$OUT/share" PARTS=step SHARES=4 TREES=". .ab/best_layout" \
    STEP_VARIANTS="${STEP_VARIANTS:-ring_fused_row}" DEADLINE_S=$(( DEADLINE_S - (SECONDS - START) )) \
    bash benchmarks/gpu_tp_share.sh > "$OUT/share.log" 2>&1
  grep -E "^step|^tp1_|^tp_variant" "$OUT/share.log" | tee -a "$OUT/summary.txt"
fi
rm -f "$OUT/quant.log"
echo "total $(( SECONDS - START )) s" | tee -a "$OUT/summary.txt"
