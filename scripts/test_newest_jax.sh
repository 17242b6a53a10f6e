#!/usr/bin/env bash
# The fast tests again on Python 3.12 with the newest jax, flax, orbax and grain that PyPI serves,
# so API drift shows here before it reaches a GPU image (which runs jax 0.11+ on Python 3.12).
#
#   bash scripts/test_newest_jax.sh [pytest args]     e.g. -k cache
#
# The venv lives in ${MAXLM_NEWEST_VENV:-~/.cache/maxlm/py312-newest-jax}; it is upgraded on every
# run (pip -U), so a new jax release is picked up the next time CI runs. torch and transformers
# are not installed: the Hugging Face parity tests run in the main environment only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MAXLM_NEWEST_VENV:-$HOME/.cache/maxlm/py312-newest-jax}
python312=${MAXLM_PYTHON312:-}
if [[ -z "$python312" ]]; then
  if command -v pyenv >/dev/null && pyenv prefix 3.12 >/dev/null 2>&1; then
    python312="$(pyenv prefix 3.12)/bin/python"
  else
    python312=$(command -v python3.12 || true)
  fi
fi
if [[ -z "$python312" || ! -x "$python312" ]]; then
  echo "test_newest_jax: no Python 3.12 found (install it, or set MAXLM_PYTHON312)" >&2
  exit 2
fi
[[ -x "$venv/bin/python" ]] || "$python312" -m venv "$venv"
echo "test_newest_jax: upgrading $venv (Python $("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'))"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip setuptools wheel
"$venv/bin/python" -m pip install -q --disable-pip-version-check -U jax flax optax orbax-checkpoint grain tensorstore -e '.[serve,test]'
"$venv/bin/python" -c "import jax, flax, optax, orbax.checkpoint as o, grain, sys; print('test_newest_jax: python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__)"
workers=$("$venv/bin/python" -c "import os; print(min(os.cpu_count() or 1, 4))")
exec "$venv/bin/python" -m pytest -n "$workers" --dist loadfile --max-worker-restart=0 -m "not slow and not vllm and not lmeval" "$@"
