#!/usr/bin/env bash
# The stacked FP8 GEMM's tilings against cuBLASLt, the fused GEMM + all-reduce, and the
# default step's profile with named kernels, in one call on nvidia-h200-x2 (~4-6 minutes;
# every stage under a timeout; on one GPU, STEPS=0, the tests run first on GPU 0):
#   GPU 1: GPU tests (TESTS; default the FP8 linear and stacked GEMM files; T_TESTS s);
#   GPU 0, at the same time: benchmarks/bench_gemm_stacked.py at the four tp=2 shapes, the
#          picked tiling (``pick_config``) against the CONFIGS tilings, and torch._scaled_mm
#          in the same process;
#   ALLREDUCE=1: benchmarks/bench_gemm_allreduce.py on both GPUs (the fused kernel's hidden
#          share against XLA's and its own GEMM);
#   then both GPUs (unless STEPS=0): the default step (ring_fused), STEPS timed, profiled with
#          XLA command buffers off (gpu_issue6.sh PROFILE_PLAIN=1), the Pallas kernels named.
# Output under $OUT: gemm_stacked.json, [gemm_allreduce.json,] logs.tar.gz, profile/ (3
# files); a summary last.
#   bash benchmarks/gpu_gemm_tiles.sh
#   CONFIGS="m128n64s5 m128n128s3w2" ALLREDUCE=1 STEPS=20 bash benchmarks/gpu_gemm_tiles.sh
#   STEPS=0 bash benchmarks/gpu_gemm_tiles.sh   (tilings and tests only, ~90 s)
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/gpu_gemm_tiles}
CONFIGS=${CONFIGS:-"m128n128s3 m128n64s4 m128n128s3w2"}
TESTS=${TESTS:-"tests/test_fp8_linear.py tests/test_fp8_gemm_stacked.py"}
ALLREDUCE=${ALLREDUCE:-0}
STEPS=${STEPS:-10}
mkdir -p "$OUT"
START=$SECONDS

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
run_tests() {  # $1: the GPU
  CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 "${T_TESTS:-150}" \
    python3 -m pytest -q -s -m gpu -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log"
}
# Two GPUs: the tests on GPU 1 beside the benchmark; one GPU: first, on GPU 0.
if [ "$NGPU" -ge 2 ]; then run_tests 1 & else run_tests 0; fi
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES=0 timeout -k 10 260 python3 benchmarks/bench_gemm_stacked.py --out "$OUT" \
  --variants kernel_m760 --configs $CONFIGS --torch --repeats 9 --budget-s 150 > "$OUT/gemm.log" 2>&1
echo "gemm tilings rc=$? after $(( SECONDS - START ))s"
wait
echo "tests done after $(( SECONDS - START ))s"
touch "$OUT/allreduce.log"
if [ "$ALLREDUCE" = 1 ]; then
  timeout -k 10 200 python3 benchmarks/bench_gemm_allreduce.py --out "$OUT" --reps 30 --repeats 5 \
    --budget-s 150 > "$OUT/allreduce.log" 2>&1
  echo "gemm + all-reduce rc=$? after $(( SECONDS - START ))s"
fi

touch "$OUT/profile.log"
if [ "$STEPS" != 0 ]; then
  OUT="$OUT/profile" VARIANTS=ring_fused EXTRAS=0 PROFILE_PLAIN=1 STEPS=$STEPS PROFILE_STEPS=2 \
    DEADLINE_S=$(( 560 - (SECONDS - START) )) bash benchmarks/gpu_issue6.sh > "$OUT/profile.log" 2>&1
  echo "profile without command buffers: rc=$? after $(( SECONDS - START ))s"
fi

echo "== summary"
grep -E "passed|failed|rc=" "$OUT/tests.log" | tail -3
sed -n '/==== stacked FP8 GEMM/,$p' "$OUT/gemm.log"
sed -n '/==== FP8 GEMM + all-reduce/,$p' "$OUT/allreduce.log"
grep -A3 "issue 6 summary" "$OUT/profile.log"
( cd "$OUT" && tar czf logs.tar.gz tests.log gemm.log allreduce.log profile.log && rm -f tests.log gemm.log allreduce.log profile.log )
ls -R "$OUT"
