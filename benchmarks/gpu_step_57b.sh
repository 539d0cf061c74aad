#!/usr/bin/env bash
# characters-57b step on the GPU machine, both cache modes, random FP8 weights initialised
# sharded on the devices. Run through the device tool on nvidia-h200-x2:
#   bash benchmarks/gpu_step_57b.sh            (writes $OUT/*.json and $OUT/*.log)
# Extra arguments go to every bench call (e.g. --attention cudnn).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
TP=${TP:-2}
STEPS=${STEPS:-50}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > "$OUT/gpus.txt" 2>&1
python3 -m characters_jax.cli bench --config tiny --tp 1 --mode ring --steps 5 --quiet "$@" > "$OUT/tiny.log" 2>&1 || { echo "tiny failed"; tail -30 "$OUT/tiny.log"; }
for mode in ring launch; do
  echo "== characters-57b tp=$TP mode=$mode"
  timeout 280 python3 -m characters_jax.cli bench --config characters-57b --tp "$TP" --mode "$mode" \
    --steps "$STEPS" --warmup 3 --progress 10 --json "$OUT/step57b_tp${TP}_${mode}.json" "$@" 2>&1 | tee "$OUT/step57b_tp${TP}_${mode}.log" | grep -vE "^\[bench\] step [0-9]+/" | tail -20
done
