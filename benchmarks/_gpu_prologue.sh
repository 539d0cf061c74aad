# Sourced by the one-GPU scripts (gpu_check_prepared.sh, gpu_out_down.sh, gpu_row_layout.sh,
# gpu_tp_share.sh):
# strict mode, the environment every GPU call keeps (NVLink multicast off), $OUT made, and
# the deadline clock.
#   source benchmarks/_gpu_prologue.sh DEFAULT_OUT DEFAULT_DEADLINE_S
#   $(left)        seconds left before DEADLINE_S, less a 15 s margin
#   $(left_max N)  the same, at most N
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$1}
DEADLINE_S=${DEADLINE_S:-$2}
mkdir -p "$OUT"
START=$SECONDS
left() { echo $(( DEADLINE_S - (SECONDS - START) - 15 )); }
left_max() { local t; t=$(left); (( t > $1 )) && t=$1; echo "$t"; }
