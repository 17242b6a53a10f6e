#!/usr/bin/env bash
# The INT4 kernel variants on one NVIDIA GPU, in under ~6 minutes (compiles included): bf16 jnp.dot
# and each variant of kernels/int4_matmul (kernel.VARIANTS) over a small grid of block settings
# (scripts/bench_int4.py VARIANT_GRID) at M = 1, 16, 64 on 8192x8192 weights, group 128; each
# setting's output is checked once against the reference. One process per variant, each under its
# own time limit, so a kernel that fails to compile, crashes or hangs costs only its own rows.
# Prints one table and the best setting per M with its speedup vs bf16; logs and the JSON lines go
# to $OUT (the device tool's output folder) or /tmp/gpu_int4_sweep.
# Usage: bash scripts/gpu_int4_sweep.sh [--help]     (from anywhere; maxlm need not be installed)
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n 2,9p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
start=$(date +%s)
out="${OUT:-/tmp/gpu_int4_sweep}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONWARNINGS=ignore
py=$(command -v python3)
# maxlm.kernels is the repository's kernels/ folder (pyproject package-dir); map it without a build.
site=$(mktemp -d); mkdir -p "$site/maxlm"; cp maxlm/__init__.py "$site/maxlm/"; ln -s "$PWD/kernels" "$site/maxlm/kernels"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
json="$out/int4_sweep.jsonl"; : > "$json"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
status=0
# variant, Ms, seconds: the process is killed at the limit; it starts no new setting after limit - 30 s
# (jax start-up, weights, and timing the compiled settings fit in those 30 s). Sum: 330 s.
for spec in "gemv 1,16 95" "dot 1,16,64 60" "dot_wide 1,16,64 65" "dot_perm 1,16,64 60" "gemv_strided 1,16 50"; do
  set -- $spec
  echo "=== $1 (M = $2, limit $3 s) ===" | tee -a "$out/sweep.log"
  timeout -k 5 "$3" "$py" scripts/bench_int4.py --variants "$1" --ms "$2" --budget-s $(( $3 - 30 )) \
      --repeats 15 --json "$json" 2>&1 | grep -v -i "deprecat" | tee -a "$out/sweep.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then echo "!!! $1 exited with $rc (124: killed at the $3 s limit)" | tee -a "$out/sweep.log"; status=1; fi
done
"$py" scripts/bench_int4.py --summarize "$json" 2>&1 | tee "$out/summary.txt"
echo "total wall time: $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
exit $status
