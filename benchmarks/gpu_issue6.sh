#!/usr/bin/env bash
# Issue 6 in one device call on nvidia-h200-x2 (at most ~9 minutes):
#   1. characters-57b tp=2 bench with a profiler breakdown, for the ablation variants
#        launch       launch cache,  cuDNN attention,      psum, XLA FP8 GEMMs (weights sliced per layer)
#        ring_cudnn   ring cache,    cuDNN attention,      psum, XLA FP8 GEMMs
#        ring_fp8     ring cache,    FP8 Pallas attention (K/V sliced per layer), psum, XLA FP8 GEMMs
#        ring_kvslice ring cache,    FP8 Pallas attention (K/V sliced per layer), psum, stacked GEMMs
#        ring_stacked ring cache,    FP8 Pallas attention (K/V read in place), psum, stacked Pallas
#                     GEMMs (projections read in place from the layer stack)
#        ring_fused   as ring_stacked, with the fused Pallas GEMM + all-reduce
#        ring_exp2    as ring_fused, attention 'pallas-exp2' (P from ex2, eager rescale; not
#                     in the default VARIANTS)
#        ring_vt      as ring_fused, V cached as the kernel's V^T (--v-cache transposed; not in
#                     the default VARIANTS)
#        ring_fused_sk as ring_fused, the fused GEMM + all-reduce on the stream-K schedule
#                     (--reduce pallas-stream-k; not in the default VARIANTS)
#        ring_qik     as ring_fused, attention 'pallas-qik' (Q quantized in the kernel; not in
#                     the default VARIANTS)
#        ring_fused_row as ring_fused, FP8 activations quantized per row (--activation-scale
#                     row; the GEMMs' inputs by the fused Pallas kernels, --input-quant auto; not
#                     in the default VARIANTS)
#        ring_fused_chained as ring_fused_row, attention-out and MLP-down as two GEMMs chained
#                     through the addend (--out-down chained; the default joins them in one
#                     stream-K GEMM where both run the stacked kernel; not in the default VARIANTS)
#        ring_fused_row_xla as ring_fused_row, the GEMMs' inputs quantized by XLA (--input-quant
#                     xla; not in the default VARIANTS)
#        ring_fused_row_norm as ring_fused_row, only the block input by its Pallas kernel, the
#                     MLP hidden and attention output by XLA (--input-quant pallas-norm; not in
#                     the default VARIANTS)
#        ring_fused_qkv as ring_fused_row, a step's QK-norm, RoPE, Q quantization and K/V cache
#                     write as one Pallas kernel (--qkv-prep pallas, what auto picks on Hopper;
#                     not in the default VARIANTS)
#        ring_fused_xqkv as ring_fused_row, those by the model's code (--qkv-prep xla; not
#                     in the default VARIANTS)
#        ring_fused_tensor as ring_fused, FP8 activations quantized per tensor (--activation-scale
#                     tensor; characters-57b's config says 'row'; not in the default VARIANTS)
#   2. one block, PyTorch vs JAX (benchmarks/torch_block_reference.py)
#   3. the VAE decoder at 704x1088 on GPU 1 (benchmarks/decoder_timing.py)
#   4. the breakdown plot
# Run from the repository root:   bash benchmarks/gpu_issue6.sh
# Everything goes to $OUT (8 files at most come back): results.tar.gz (the bench JSONs,
# block_reference.json, decoder_timing.json, decoder_overlap.json), breakdown.png,
# logs.tar.gz (logs, per-variant breakdown.json, HLO text).
# Every sub-run has a timeout, cut further to what is left of the overall deadline, so one
# failure or hang does not cost the rest. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# Knobs: STEPS (20), WARMUP (3), PROFILE_STEPS (3), DEADLINE_S (530), V_LIMIT_S (110: per variant), VARIANTS (all six; VARIANTS="" runs none: extras only),
# TP (2), DECODER_GPU (1: the decoder's GPU for the decoder extras), PROFILE_PLAIN (0; 1: the
# profile traces a second compile with XLA command buffers off, where the trace names the
# Pallas kernels instead of listing them as MemcpyD2D; one more compile per variant),
# EXTRAS ("block decoder overlap": the block reference, the decoder alone, the decoder sharing GPU 1; 0: none), CONFIG (characters-57b), BLOCK_ARGS (extra torch_block_reference.py arguments, e.g. --dry-run).
# ATTN_CUDNN (cudnn), ATTN_FP8 (pallas), REDUCE_FUSED (pallas): the impls of the variants.
# CPU smoke test: CONFIG=tiny BLOCK_ARGS=--dry-run ATTN_CUDNN=xla ATTN_FP8=reference REDUCE_FUSED=ppermute \
#   XLA_FLAGS=--xla_force_host_platform_device_count=2 bash benchmarks/gpu_issue6.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
OUT=${OUT:-out/gpu_issue6}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}
PROFILE_STEPS=${PROFILE_STEPS:-3}
DEADLINE_S=${DEADLINE_S:-530}
VARIANTS=${VARIANTS-"launch ring_cudnn ring_fp8 ring_kvslice ring_stacked ring_fused"}
CONFIG=${CONFIG:-characters-57b}
TP=${TP:-2}
PROFILE_PLAIN=${PROFILE_PLAIN:-0}  # 1: profile a second compile without XLA command buffers
DECODER_GPU=${DECODER_GPU:-1}  # the decoder's GPU (with TP=2: shared with the generator)
BLOCK_ARGS=${BLOCK_ARGS:-}
ATTN_CUDNN=${ATTN_CUDNN:-cudnn}
ATTN_FP8=${ATTN_FP8:-pallas}
REDUCE_FUSED=${REDUCE_FUSED:-pallas}
LOGS="$OUT/logs"
mkdir -p "$OUT" "$LOGS"
START=$SECONDS

# guarded NAME LIMIT_S CMD...: runs CMD with a timeout of min(LIMIT_S, time left - 20 s),
# output to $LOGS/NAME.log; never stops the script.
guarded() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE_S - (SECONDS - START) - 20 ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    echo "== $name: skipped (${left}s left)" | tee -a "$LOGS/summary.log"
    return 0
  fi
  echo "== $name (timeout ${limit}s, t=$(( SECONDS - START ))s)"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( SECONDS - START ))s total" | tee -a "$LOGS/summary.log"
  grep -vE "^\[bench\] step [0-9]+/|DeprecationWarning|^\s*$" "$LOGS/$name.log" | tail -25
  return 0
}

# The bench sub-command without going through the CLI's other command modules.
BENCH=(python3 -c 'import argparse, sys
from characters_jax.measure import bench
p = argparse.ArgumentParser(prog="characters-jax")
bench.register(p.add_subparsers())
a = p.parse_args(["bench"] + sys.argv[1:])
sys.exit(a.func(a))')

{ nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m; } > "$LOGS/gpus.txt" 2>&1 || true
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" > "$LOGS/env.txt" 2>&1 || true
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.device_count())" >> "$LOGS/env.txt" 2>&1 || true
cat "$LOGS/env.txt"

for v in $VARIANTS; do
  case $v in
    launch)       opts=(--mode launch --attention "$ATTN_CUDNN" --reduce psum --gemm xla) ;;
    ring_cudnn)   opts=(--mode ring --attention "$ATTN_CUDNN" --reduce psum --gemm xla) ;;
    ring_fp8)     opts=(--mode ring --attention "$ATTN_FP8" --reduce psum --gemm xla --kv-slice) ;;
    ring_kvslice) opts=(--mode ring --attention "$ATTN_FP8" --reduce psum --gemm stacked --kv-slice) ;;
    ring_stacked) opts=(--mode ring --attention "$ATTN_FP8" --reduce psum --gemm stacked) ;;
    ring_fused)   opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked) ;;
    ring_exp2)    opts=(--mode ring --attention pallas-exp2 --reduce "$REDUCE_FUSED" --gemm stacked) ;;
    ring_vt)      opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --v-cache transposed) ;;
    ring_fused_sk) opts=(--mode ring --attention "$ATTN_FP8" --reduce pallas-stream-k --gemm stacked) ;;
    ring_qik)     opts=(--mode ring --attention pallas-qik --reduce "$REDUCE_FUSED" --gemm stacked) ;;
    ring_fused_row) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row) ;;
    ring_fused_chained) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row --out-down chained) ;;
    ring_fused_tensor) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale tensor) ;;
    ring_fused_row_xla) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row --input-quant xla) ;;
    ring_fused_row_norm) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row --input-quant pallas-norm) ;;
    ring_fused_qkv) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row --qkv-prep pallas) ;;
    ring_fused_xqkv) opts=(--mode ring --attention "$ATTN_FP8" --reduce "$REDUCE_FUSED" --gemm stacked --activation-scale row --qkv-prep xla) ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  guarded "step57b_$v" "${V_LIMIT_S:-110}" "${BENCH[@]}" --config "$CONFIG" --tp "$TP" "${opts[@]}" \
    --steps "$STEPS" --warmup "$WARMUP" --progress 10 --upkeep-steps-per-call 4 \
    --profile "$LOGS/trace_$v" --profile-steps "$PROFILE_STEPS" --json "$OUT/step57b_tp${TP}_$v.json" \
    $( [ "$PROFILE_PLAIN" = 1 ] && echo --profile-without-command-buffers )
done

EXTRAS=${EXTRAS:-"block decoder overlap"}
[ "$EXTRAS" = 1 ] && EXTRAS="block decoder overlap"
for x in $EXTRAS; do
  case $x in
    block)   guarded block_reference 150 python3 benchmarks/torch_block_reference.py --json "$OUT/block_reference.json" --torch-timeout 80 $BLOCK_ARGS ;;
    decoder) guarded decoder 110 python3 benchmarks/decoder_timing.py --config "$CONFIG" --device "$DECODER_GPU" --chunks 20 --json "$OUT/decoder_timing.json" ;;
    overlap) guarded decoder_overlap 150 python3 benchmarks/decoder_overlap.py --config "$CONFIG" --tp "$TP" --decoder-device "$DECODER_GPU" --json "$OUT/decoder_overlap.json" ;;
    0) ;;
    *) echo "unknown extra $x" ;;
  esac
done
PLOT_FILES=()  # in the order of VARIANTS (the ablation's), not the shell's alphabetical one
for v in $VARIANTS; do [ -f "$OUT/step57b_tp${TP}_$v.json" ] && PLOT_FILES+=("$OUT/step57b_tp${TP}_$v.json"); done
guarded plot 40 python3 benchmarks/plot_breakdown.py "${PLOT_FILES[@]}" --out "$OUT/breakdown.png"

# Logs, the per-variant breakdown.json and HLO text (the raw traces stay behind: too large).
( cd "$LOGS" && find . -maxdepth 2 \( -name "*.log" -o -name "*.txt" -o -name "breakdown.json" \) -size -8M -print0 \
    | tar --null -czf "$OUT/logs.tar.gz" -T - ) || echo "packing logs failed"
rm -rf "$LOGS"

python3 - "$OUT" <<'EOF' || true
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
PEAK = 1979.0  # H200 dense FP8 TFLOP/s (datasheet)
print("\n== issue 6 summary")
print(f"{'tp_variant':<15} {'p50 ms':>8} {'p99 ms':>8} {'reset ms':>9} {'fps':>6} {'TFLOP/s/GPU':>11} {'%FP8pk':>7} {'upkeep%':>8} | "
      f"{'upk':>6} {'attn':>6} {'gemm':>6} {'g+ar':>6} {'coll':>6} {'other':>6} {'busy':>6} {'gap':>6}")
for p in sorted(out.glob("step57b_tp*_*.json")):
    r = json.loads(p.read_text())
    s, b = r["step_ms"], r.get("breakdown") or {}
    c = b.get("components_ms", {})
    reset = ",".join(f"{t:.0f}" for t in r.get("reset_step_ms", [])) or "-"
    comp = " ".join(f"{c.get(k, float('nan')):6.1f}" for k in ("cache_upkeep", "attention", "gemm", "gemm_allreduce", "collective", "other"))
    gap = b.get("launch_gap_ms")
    print(f"{p.stem.replace('step57b_', ''):<15} {s['p50']:8.1f} {s['p99']:8.1f} {reset:>9} {r['fps']:6.1f} "
          f"{r['effective_tflops_per_device']:11.0f} {100 * r['effective_tflops_per_device'] / PEAK:6.1f}% "
          f"{100 * r['cache_upkeep_share']:7.1f}% | {comp} {b.get('busy_ms', float('nan')):6.1f} {gap if gap is not None else float('nan'):6.1f}"
          + (f"  profile error: {b['error']}" if "error" in b else ""))
br = out / "block_reference.json"
if br.exists():
    r = json.loads(br.read_text())
    rat = r.get("ratios", {})
    print("block JAX/PyTorch:", ", ".join(f"{k} {v:.2f}" for k, v in rat.items()) or "no ratios",
          "|", r.get("torch", {}).get("error", ""), r.get("jax", {}).get("error", ""))
dt = out / "decoder_timing.json"
if dt.exists():
    r = json.loads(dt.read_text())
    print(f"decoder {r['frames_shape']}: {r['latency_ms']['p50']:.1f} ms/chunk (pipelined {r['pipelined_ms']:.1f}, "
          f"with host copy {r['with_copy_ms']['p50']:.1f}); target <= 60 ms")
do = out / "decoder_overlap.json"
if do.exists():
    r = json.loads(do.read_text())
    s, d = r["step_ms"], r["decoder_ms"]
    print(f"decoder sharing GPU 1: step p50 alone {s['alone']['p50']:.1f}, paced {s['paced']['p50']:.1f} "
          f"(x{r['step_ratio_paced']:.3f}), back to back {s['back_to_back']['p50']:.1f} (x{r['step_ratio_back_to_back']:.3f}) ms; "
          f"decode alone {d['alone']['latency_ms']['p50']:.1f}, paced {d['paced']['latency_ms']['p50']:.1f} ms/chunk")
EOF
# At most 8 files come back from the device: the JSONs travel as one archive.
( cd "$OUT" && ls *.json > /dev/null 2>&1 && tar czf results.tar.gz *.json && rm -f *.json ) || true
ls "$OUT"
