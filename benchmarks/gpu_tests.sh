#!/usr/bin/env bash
# The GPU tests: every custom kernel against its reference on the device (the `gpu` tests of
# tests/test_fp8_*.py), then the PyTorch step (benchmarks/torch_step.py) against the JAX step
# (all of tests/test_torch_step.py: its eager parity tests and its `gpu` ones; it needs torch).
#
#     benchmarks/gpu_tests.sh [pytest arguments, e.g. -x or -k scaled_mm]
#
# From any directory; PYTHON picks the interpreter (default python3). On a machine without
# an NVIDIA GPU the `gpu` tests skip, and test_torch_step.py skips where torch is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
"$PY" -m pytest -q -m gpu tests/test_fp8_*.py "$@"
"$PY" -m pytest -q tests/test_torch_step.py "$@"
