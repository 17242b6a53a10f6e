#!/usr/bin/env bash
# Serve an exported model (python -m maxlm.hf export ...) with vLLM's OpenAI-compatible server,
# wait until it is healthy, send one completion and one chat request (scripts/vllm_smoke.py), then
# keep serving until Ctrl-C (or stop at once with --check).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/serve_vllm.sh DIR [--cpu] [--port N] [--host H] [--check] [-- extra vllm args]

Starts `python -m vllm.entrypoints.openai.api_server --model DIR` with flags read from DIR:
  --dtype            config.json's torch_dtype (or dtype)
  --max-model-len    config.json's max_position_embeddings (or n_positions)
  --chat-template    maxlm/data/chat_template.jinja when tokenizer_config.json has none
  on GPU:  --tensor-parallel-size = visible GPUs, --gpu-memory-utilization 0.90
  on CPU (--cpu, or no GPU visible): VLLM_CPU_KVCACHE_SPACE=1 (GiB), OMP threads bound to this
           process's cores, VLLM_CACHE_ROOT in a temporary folder
then waits for /health and runs scripts/vllm_smoke.py (one completion, one chat request).

  --cpu        run on CPU (vllm-cpu) even if a GPU is visible
  --port N     port to listen on (default 8000)
  --host H     address to listen on (default 127.0.0.1)
  --check      stop the server after the smoke requests (exit status = theirs)
Any other argument goes to vLLM unchanged (e.g. --max-num-seqs 8); an explicit --dtype,
--max-model-len, --chat-template or --tensor-parallel-size there replaces the derived one.

The Python that runs vLLM: $VLLM_PYTHON, else the peer environment built by
scripts/setup_peer_envs.sh (${MAXLM_PEER_ENVS:-~/.cache/maxlm/peer-envs}/vllm/bin/python), else
python3 if it imports vllm. $VLLM_START_TIMEOUT (seconds, default 900) bounds the start. The
server log goes to $SERVE_VLLM_LOG if set, else into a temporary folder (kept if the start fails).
EOF
}

die() { echo "serve_vllm.sh: $*" >&2; exit 2; }

HERE="$(cd "$(dirname "$0")" && pwd)"
dir="" cpu=0 port=8000 host=127.0.0.1 check=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --cpu) cpu=1 ;;
    --check) check=1 ;;
    --port) [ $# -ge 2 ] || die "--port needs a number"; port="$2"; shift ;;
    --port=*) port="${1#--port=}" ;;
    --host) [ $# -ge 2 ] || die "--host needs an address"; host="$2"; shift ;;
    --host=*) host="${1#--host=}" ;;
    --) shift; extra+=("$@"); break ;;
    *) if [ -z "$dir" ] && [ "${1#-}" = "$1" ]; then dir="$1"; else extra+=("$1"); fi ;;
  esac
  shift
done

[ -n "$dir" ] || die "missing DIR, the exported model directory (see --help)"
[ -d "$dir" ] || die "$dir: no such directory (export one with: python -m maxlm.hf export RUN_DIR --out DIR)"
[ -f "$dir/config.json" ] || die "$dir/config.json: not found (not a Hugging Face export)"
case "$port" in ''|*[!0-9]*) die "--port '$port' is not a number" ;; esac
dir="$(cd "$dir" && pwd)"

# The Python with vLLM. PYTHONSAFEPATH keeps the working directory off its sys.path: run from a
# maxlm checkout, our kernels/ folder would shadow the PyPI `kernels` package transformers imports.
export PYTHONSAFEPATH=1
peer="${MAXLM_PEER_ENVS:-$HOME/.cache/maxlm/peer-envs}/vllm/bin/python"
if [ -n "${VLLM_PYTHON:-}" ]; then py="$VLLM_PYTHON"
elif [ -x "$peer" ]; then py="$peer"
elif python3 -c "import vllm" >/dev/null 2>&1; then py="$(command -v python3)"
else die "no Python with vLLM: run bash scripts/setup_peer_envs.sh vllm (or set VLLM_PYTHON)"
fi

# Flags from the export: dtype, context length, chat template.
read -r dtype max_len has_template < <("$py" - "$dir" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
try:
    cfg = json.loads((d / "config.json").read_text())
    assert isinstance(cfg, dict)
except Exception as err:
    print(f"serve_vllm.sh: {d / 'config.json'}: not a JSON object ({err})", file=sys.stderr)
    print("! ! !")
    sys.exit(0)
dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "auto"
length = cfg.get("max_position_embeddings") or cfg.get("n_positions") or "-"
try:
    template = bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
except Exception:
    template = False
print(dtype, length, int(template or (d / "chat_template.jinja").is_file()))
EOF
)
[ "$dtype" != "!" ] || exit 2

has_flag() { local f; for f in "${extra[@]+"${extra[@]}"}"; do case "$f" in "$1"|"$1"=*) return 0 ;; esac; done; return 1; }
args=(--model "$dir" --host "$host" --port "$port")
has_flag --dtype || args+=(--dtype "$dtype")
if [ "$max_len" != "-" ] && ! has_flag --max-model-len; then args+=(--max-model-len "$max_len"); fi
if [ "$has_template" = 0 ] && ! has_flag --chat-template; then
  args+=(--chat-template "$HERE/../maxlm/data/chat_template.jinja")
  template_note="maxlm/data/chat_template.jinja (the export has no chat template)"
else
  template_note="the export's"
fi

gpus=0
if [ "$cpu" = 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
  fi
fi
tmp="$(mktemp -d "${TMPDIR:-/tmp}/serve_vllm.XXXXXX")"
if [ "$gpus" -gt 0 ]; then
  device="GPU x$gpus"
  has_flag --tensor-parallel-size || args+=(--tensor-parallel-size "$gpus")
  has_flag --gpu-memory-utilization || args+=(--gpu-memory-utilization 0.90)
else
  cpu=1
  cores=$("$py" -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
  ncores=$(echo "$cores" | tr ',' '\n' | grep -c .)
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"  # GiB; unset, it takes 90% of memory
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$cores}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$ncores}"
  device="CPU, $ncores cores ($VLLM_CPU_OMP_THREADS_BIND), KV cache ${VLLM_CPU_KVCACHE_SPACE} GiB"
fi
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$tmp/vllm-cache}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
log="${SERVE_VLLM_LOG:-$tmp/server.log}"

echo "serve_vllm.sh: $dir on $device"
echo "  dtype $dtype, max model len $max_len, chat template: $template_note"
echo "  $py -m vllm.entrypoints.openai.api_server ${args[*]}${extra[*]:+ ${extra[*]}}"
echo "  server log: $log"

# The server runs in its own process group, ended (with its engine processes) on any exit.
setsid "$py" -m vllm.entrypoints.openai.api_server "${args[@]}" ${extra[@]+"${extra[@]}"} >"$log" 2>&1 &
server=$!
stop() {  # stop STATUS
  trap - EXIT INT TERM
  if kill -0 "$server" 2>/dev/null; then
    kill -TERM -- "-$server" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server" 2>/dev/null || true
  fi
  if [ "$1" = 0 ] || [ -n "${SERVE_VLLM_LOG:-}" ]; then rm -rf "$tmp"; else echo "serve_vllm.sh: server log kept at $log" >&2; fi
}
trap 'stop $?' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

url="http://$host:$port"
[ "$host" != "0.0.0.0" ] || url="http://127.0.0.1:$port"
start=$SECONDS next=15
while ! "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url/health" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    echo "serve_vllm.sh: the server exited during start-up; the end of its log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  if [ $((SECONDS - start)) -ge "${VLLM_START_TIMEOUT:-900}" ]; then
    echo "serve_vllm.sh: not healthy after $((SECONDS - start)) s; the end of its log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  if [ $((SECONDS - start)) -ge "$next" ]; then
    echo "  waiting for $url/health: $((SECONDS - start)) s ($(tail -n 1 "$log" | cut -c1-100))"
    next=$((next + 15))
  fi
  sleep 1
done
echo "healthy after $((SECONDS - start)) s at $url/v1"

status=0
"$py" "$HERE/vllm_smoke.py" --base-url "$url/v1" || status=$?
if [ "$check" = 1 ]; then
  exit "$status"
fi
echo "serving $dir at $url/v1 (Ctrl-C stops)"
wait "$server" || status=$?
echo "serve_vllm.sh: the server exited ($status); the end of its log:" >&2
tail -n 30 "$log" >&2
exit 1
