#!/usr/bin/env bash
# The test suite: every test, slow ones included, on 8 fake CPU devices (tests/conftest.py sets
# XLA_FLAGS before jax is imported). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf`.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=$(python -c "import os; print(min(os.cpu_count() or 1, 4))")
# --durations: the slowest tests are listed at the end, so CI shows where its time goes.
exec python -m pytest -n "$workers" --dist loadfile --durations=40 "$@"
