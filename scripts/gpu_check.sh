#!/usr/bin/env bash
# The GPU-only checks of the kernels (issue 14), in one run of under 8 minutes on one NVIDIA GPU:
#   1. the flash attention and INT4 matmul tests, compiled for the GPU (not interpret mode);
#   2. scripts/bench_attention.py: Pallas vs cuDNN vs XLA attention, TFLOP/s at B=4 H=16 S=4096 D=128;
#   3. scripts/bench_int4.py: the INT4 kernel vs a bf16 matmul on 8192x8192 weights at M=1..256.
# Logs go to $OUT (the device tool's output folder) or /tmp/gpu_check. Needs jax with CUDA, pytest
# and numpy; maxlm is put on the path without its other dependencies (the kernels import none).
# Usage: bash scripts/gpu_check.sh [--help]
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n 2,8p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu_check}"; mkdir -p "$out"
# Compiling each test's kernels takes most of the time (74 tests: ~330 s in one process on an H200),
# so the tests run in 4 processes, none of which takes most of the GPU's memory up front.
export PYTHONUNBUFFERED=1 MAXLM_TEST_ON_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
py=$(command -v python3)
# maxlm.kernels is the repository's kernels/ folder (pyproject package-dir); map it without a build.
site=$(mktemp -d); mkdir -p "$site/maxlm"; cp maxlm/__init__.py "$site/maxlm/"; ln -s "$PWD/kernels" "$site/maxlm/kernels"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
status=0
timeout 240 "$py" -m pytest -q -n 4 -p no:cacheprovider -rfE tests/test_flash_attention.py tests/test_int4_matmul.py \
2>&1 | tee "$out/kernel_tests.log" || status=1
timeout 120 "$py" scripts/bench_attention.py --gpu 2>&1 | tee "$out/bench_attention.log" || status=1
timeout 80 "$py" scripts/bench_int4.py 2>&1 | tee "$out/bench_int4.log" || status=1
exit $status
