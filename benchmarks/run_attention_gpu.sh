#!/usr/bin/env bash
# One device call (1 or 2 x H200): FP8 attention tests and benchmark, every stage under its own
# timeout, logs under $OUT (7 files, 8 with the profile). GPU 0: benchmark; first the contenders and the known
# kernel (VARIANTS_A), then the new variants (VARIANTS_B), so that a failing or hanging
# new variant cannot cost the known numbers. The GPU tests: on GPU 1 in parallel, or on
# GPU 0 after the benchmarks when the machine has one GPU.
# CPU tests in the background on the host.
# Usage: OUT=/some/dir bash benchmarks/run_attention_gpu.sh
# Knobs: HEADS (18,36,72), VARIANTS_A (kv_split_s2: GPU run 5's kernel), VARIANTS_B
# (default,default_vt: attention_pallas's defaults, plain V and V^T; names in bench_attention.py's _Variants),
# CONTENDERS (1: cuDNN, XLA, PyTorch),
# ITERS (20), T_A / T_B / T_TESTS (stage timeouts, s), TESTS_K (pytest -k filter of the GPU
# tests, default all), PTXAS_B (1: ptxas -v of stage B's kernels, its register and spill
# lines in the summary), PROFILE_VARIANT (variant names, comma-separated, each optionally
# ':diag1+diag2' with attention_profile.py --debug diagnostics: the Mosaic GPU profile of
# each at 18 heads, stream-K, after the benchmarks), SASS_VARIANT (a variant: its PTX and
# ptxas report, for attention_ptx.py --sass); both in $OUT/prof.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/attn_out}; mkdir -p "$OUT"
HEADS=${HEADS:-18,36,72}
VARIANTS_A=${VARIANTS_A:-kv_split_s2}
VARIANTS_B=${VARIANTS_B:-default,default_vt}
CONTENDERS=${CONTENDERS:-1}
ITERS=${ITERS:-20}
( JAX_PLATFORMS=cpu timeout 120 python3 -m pytest -q -m "not gpu" -p no:cacheprovider \
    tests/test_fp8_attention.py; echo "rc=$?" ) > "$OUT/cpu_tests.txt" 2>&1 &
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
gpu_tests() {  # $1: the GPU to run them on
  nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
  CUDA_VISIBLE_DEVICES=$1 timeout "${T_TESTS:-300}" python3 -m pytest -v -s -m gpu \
    -p no:cacheprovider tests/test_fp8_attention.py -k "${TESTS_K:-}"; echo "rc=$?"
}
# Two GPUs: the tests on GPU 1 beside the benchmark; one GPU: after it, on GPU 0.
[ "$NGPU" -ge 2 ] && { gpu_tests 1 > "$OUT/gpu_tests.txt" 2>&1 & }
export CUDA_VISIBLE_DEVICES=0
timeout "${T_A:-150}" python3 benchmarks/bench_attention.py --out "$OUT" --tag _a \
    --iters "$ITERS" --heads "$HEADS" --log /tmp/bench_log_a.txt --variants "$VARIANTS_A" \
    --contenders "$CONTENDERS" > "$OUT/bench_a.txt" 2>&1
echo "bench_a rc=$?"
PTXAS_ENV=(); [ "${PTXAS_B:-0}" = 1 ] && PTXAS_ENV=(MOSAIC_GPU_DUMP_PTXAS=1)
env "${PTXAS_ENV[@]}" timeout "${T_B:-150}" python3 benchmarks/bench_attention.py --out "$OUT" --tag _b \
    --iters "$ITERS" --heads "$HEADS" --log /tmp/bench_log_b.txt --variants "$VARIANTS_B" \
    --contenders 0 > "$OUT/bench_b.txt" 2>&1
echo "bench_b rc=$?"
if [ -n "${PROFILE_VARIANT:-}${SASS_VARIANT:-}" ]; then
  mkdir -p /tmp/prof
  for pv in ${PROFILE_VARIANT//,/ }; do  # variant or variant:debug1+debug2
    dbg=""; [[ $pv == *:* ]] && dbg=${pv#*:}; dbg=${dbg//+/,}
    timeout "${T_PROF:-120}" python3 benchmarks/attention_profile.py --out "/tmp/prof/${pv//[:+]/_}" \
      --heads 18 --schedules stream_k --variant "${pv%%:*}" --debug "$dbg" \
      > "/tmp/prof/${pv//[:+]/_}.txt" 2>&1 || echo "profile $pv rc=$?"
    echo "== profile $pv"; grep -A12 "^heads" "/tmp/prof/${pv//[:+]/_}.txt" | grep -v "^  *Init\|merge\|partial\|store\|q_wait"
  done
  if [ -n "${SASS_VARIANT:-}" ]; then  # PTX and ptxas report of one variant (its SASS:
    # attention_ptx.py --sass on the PTX, on any machine; nvdisasm is not on this PATH)
    timeout 120 python3 benchmarks/attention_ptx.py \
      --variant "$SASS_VARIANT" --out "/tmp/prof/ptx_$SASS_VARIANT" > /tmp/prof/ptx.txt 2>&1 \
      || echo "ptx rc=$?"
    rm -f /tmp/prof/ptx_*/*mlir-passes.log  # 45-80 MB of pass dumps
    ls -la "/tmp/prof/ptx_$SASS_VARIANT" | head
  fi
  tar czf "$OUT/prof.tgz" -C /tmp prof
fi
[ "$NGPU" -ge 2 ] || gpu_tests 0 > "$OUT/gpu_tests.txt" 2>&1
wait
grep -h "registers\|spill\|arning" "$OUT/bench_b.txt" | sort | uniq -c | head -20
grep -h "rel_err\|stream-K\|passed\|failed\|rc=\|Error" "$OUT/gpu_tests.txt" | cut -c1-250 | tail -40
tail -3 "$OUT/cpu_tests.txt"
grep -h "Error\|error" "$OUT/bench_a.txt" "$OUT/bench_b.txt" | cut -c1-300 | head -8
python3 benchmarks/bench_attention.py --table "$OUT/attention_results_a.json" \
    "$OUT/attention_results_b.json" 2>&1 | tee "$OUT/table.txt"
