#!/usr/bin/env bash
# The test suite: every test, slow ones included, on 8 fake CPU devices (tests/conftest.py sets
# XLA_FLAGS before jax is imported). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf`.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=$(python -c "import os; print(min(os.cpu_count() or 1, 4))")
# --durations: the slowest tests are listed at the end, so CI shows where its time goes.
# --max-worker-restart=0: a worker that dies (killed for memory, say) fails the run at once and is
# named in the summary; replacing it deadlocks pytest-xdist 3.8's --dist loadfile scheduler (CI once
# hung there until its 90-minute limit).
exec python -m pytest -n "$workers" --dist loadfile --max-worker-restart=0 --durations=40 "$@"
