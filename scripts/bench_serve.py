"""Online serving throughput and latency of maxlm.serve against vLLM and a naive FastAPI server, same run.

    python scripts/bench_serve.py                        # ~13M Llama, 64 requests at concurrency 1, 8, 32
    python scripts/bench_serve.py --size tiny --requests 8 --concurrency 1,8 --systems naive,vllm   # smoke run
    python scripts/bench_serve.py --systems maxlm,vllm --concurrency 32 --json out.json
    python scripts/bench_serve.py --vllm-args=--enforce-eager      # extra arguments for one server

One random-init Llama (maxlm's init, fp32) is exported with maxlm.hf.export_model to a temporary
Hugging Face directory with maxlm's byte tokenizer files, and that same directory is served by
each system in turn, each as its own process group on a free loopback port, never two at once:

  maxlm  python -m maxlm.serve --checkpoint DIR --port P --max-num-seqs 32      (+ --maxlm-args)
  vllm   PEER_PYTHON -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port P
         --dtype float32 --max-model-len L --max-num-seqs 32                     (+ --vllm-args)
         with the CPU settings of scripts/serve_vllm.sh (VLLM_CPU_KVCACHE_SPACE=1, OMP threads
         bound to this process's CPUs, VLLM_CACHE_ROOT in the temporary directory); PEER_PYTHON is
         $VLLM_PYTHON, else the vllm environment of scripts/setup_peer_envs.sh
  naive  python scripts/naive_server.py --model DIR --port P: transformers' generate, one request
         at a time behind a lock, streaming through TextIteratorStreamer

The model is bench_decode's "20m" shape (d_model 384, 8 layers, 6 heads, 2 KV heads, d_ff 1024,
untied) with the byte tokenizer's own vocabulary of 259 (256 bytes + bos/eos/pad) instead of 8192,
so that every id the model can produce is a token the tokenizer knows: 12.79M parameters (18.88M
with 8192). --size tiny is a 0.46M-parameter smoke model. Context length: max(512, longest prompt +
longest output, rounded up to 128).

Requests: --requests prompts of random lowercase words, drawn from --seed, whose lengths in tokens
(bos included; the byte tokenizer spends one token per character) are uniform in --prompt-tokens,
each asking for a number of new tokens uniform in --output-tokens. The lengths are the same at every
concurrency level; the text is drawn anew for each level (so no server's prefix cache reuses an
earlier level's prompts) but is the same for every system. Every request is a streamed
/v1/completions call (httpx, one JSON body: temperature 0, max_tokens N, stream_options.include_usage
true, and vLLM's ignore_eos true at the top level, where openai's extra_body puts it), so every system generates exactly the requested tokens; a
request that comes back with any other count is an error. --concurrency C keeps C requests in
flight (closed loop) until all are done. Before each level, max(--warmup, C) short requests (8 new
tokens, prompt lengths spread over the whole range) run at that concurrency, not timed, so that
no system pays for compilation or first-use costs of a shape while timed.

Measured on the client from the stream: TTFT (request sent -> first chunk with a choice; a choice
chunk is taken to carry at least one token, as vLLM's do; naive_server's final one, with the
streamer's remaining text, follows its last token at once), TPOT
((last choice chunk - first) / (output tokens - 1), per request), output tokens from the final
usage chunk (else the count of choice chunks); output tokens/s and requests/s over the level's wall
time (first request sent -> last one done). The load average is read before and after, and the CPU
time of other processes (the machine's busy time minus this client's and the server's process
group's) while timing; on a busy machine no ratio is printed as a result. The last two lines are
"ratio maxlm/naive output_tokens_per_s = X" and "ratio maxlm/vllm output_tokens_per_s = X" at
concurrency 32 (else the highest level run).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SIZE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
SIZES = {
    "20m": (384, 8, 6, 2, 1024),  # bench_decode's 20m shape; 12.79M parameters with the byte vocabulary
    "tiny": (128, 2, 4, 2, 384),  # a smoke test, 0.46M parameters
}
VOCAB = 259  # maxlm's byte tokenizer: 256 bytes, bos, eos, pad
SYSTEMS = ("maxlm", "vllm", "naive")
BUSY_SHARE = 0.10  # other processes' share of the CPUs above which ratios are not results
WARMUP_TOKENS = 8
RATIO_CONCURRENCY = 32


def _range(text: str, flag: str, p: argparse.ArgumentParser) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        p.error(f"{flag} {text!r}: not MIN,MAX")
    if not 1 <= lo <= hi:
        p.error(f"{flag} {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated servers to run, in this order (default: {','.join(SYSTEMS)})")
    p.add_argument("--size", choices=sorted(SIZES), default="20m", help="model preset (default: 20m)")
    for field in SIZE_FIELDS:
        p.add_argument(f"--{field}", type=int, help=f"override the preset's {field}")
    p.add_argument("--requests", type=int, default=64, help="timed requests per concurrency level (default: 64)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels (default: 1,8,32)")
    p.add_argument("--prompt-tokens", default="16,256", help="MIN,MAX prompt tokens, bos included (default: 16,256)")
    p.add_argument("--output-tokens", default="16,128", help="MIN,MAX new tokens per request (default: 16,128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompts and the lengths (default: 0)")
    p.add_argument("--warmup", type=int, default=8,
                   help="untimed requests before each level: max(WARMUP, concurrency) (default: 8)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="--max-num-seqs of maxlm and vLLM (default: 32)")
    p.add_argument("--maxlm-args", default="", help="extra arguments for python -m maxlm.serve (one string)")
    p.add_argument("--vllm-args", default="", help="extra arguments for vLLM's api_server (one string)")
    p.add_argument("--naive-args", default="", help="extra arguments for scripts/naive_server.py (one string)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to answer /health (default: 900)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait for its next byte (default: 600)")
    p.add_argument("--keep-dir", help="export the model into this (new or empty) directory and keep it")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    for field, value in zip(SIZE_FIELDS, SIZES[args.size]):
        if getattr(args, field) is None:
            setattr(args, field, value)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems or len(set(args.systems)) != len(args.systems):
        p.error(f"--systems: a comma-separated subset of {','.join(SYSTEMS)} without repeats, got {unknown or args.systems}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: not a comma-separated list of integers")
    args.prompt_tokens = _range(args.prompt_tokens, "--prompt-tokens", p)
    args.output_tokens = _range(args.output_tokens, "--output-tokens", p)
    if min(args.concurrency) < 1 or args.requests < 1 or args.warmup < 0 or args.max_num_seqs < 1:
        p.error("--concurrency, --requests and --max-num-seqs must be >= 1, --warmup >= 0")
    if args.prompt_tokens[0] < 2 or args.output_tokens[0] < 2:
        p.error("prompts need >= 2 tokens (bos and one character) and outputs >= 2 tokens (for TPOT)")
    for name in ("maxlm_args", "vllm_args", "naive_args"):
        setattr(args, name, shlex.split(getattr(args, name)))
    args.max_seq_len = max(512, -(-(args.prompt_tokens[1] + args.output_tokens[1]) // 128) * 128)
    return args


# ---------------------------------------------------------------------------------------------
# The model


def export(fields: dict, out: str) -> int:
    """A random-init Llama written by maxlm's real export (config, weights, byte tokenizer files,
    generation config); returns the parameter count. Runs in a spawned process: the client stays
    free of JAX."""
    import jax

    from maxlm import model
    from maxlm.config import ModelConfig
    from maxlm.data.tokenizer import ByteTokenizer
    from maxlm.hf import LoadedModel
    from maxlm.hf.export import export_model
    from maxlm.infer import inference_mesh

    cfg = ModelConfig(vocab_size=VOCAB, vocab_multiple=128, d_model=fields["d_model"], n_layers=fields["n_layers"],
                      n_heads=fields["n_heads"], n_kv_heads=fields["n_kv_heads"], d_ff=fields["d_ff"],
                      max_seq_len=fields["max_seq_len"], norm_eps=1e-5, rope_theta=10000.0, dtype="float32",
                      param_dtype="float32", tie_embeddings=False, remat="none")
    params = jax.jit(lambda: model.init_params(cfg, jax.random.PRNGKey(fields["seed"])))()
    loaded = LoadedModel(cfg=cfg, params=params, tokenizer=ByteTokenizer(), mesh=inference_mesh(1),
                         source="random llama (scripts/bench_serve.py)")
    export_model(loaded, out, dtype="float32")
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:  # the export crops the vocabulary padding
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Request:
    prompt: str
    prompt_tokens: int  # bos + one token per character (byte tokenizer, ASCII text)
    output_tokens: int


def random_text(rng: np.random.Generator, chars: int) -> str:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words, size = [], 0
    while size <= chars:  # size counts a space after every word, the joined text has one fewer
        word = "".join(rng.choice(letters, int(rng.integers(1, 9))))
        words.append(word)
        size += len(word) + 1
    text = " ".join(words)[:chars]
    return text[:-1] + "a" if text.endswith(" ") else text


def make_requests(args, level: int) -> list[Request]:
    """The timed requests of concurrency level number ``level``: lengths from --seed alone, text
    drawn per level."""
    lengths = np.random.default_rng(args.seed)
    prompts = lengths.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1, args.requests)
    outputs = lengths.integers(args.output_tokens[0], args.output_tokens[1] + 1, args.requests)
    text = np.random.default_rng([args.seed, 1 + level])
    return [Request(random_text(text, int(p) - 1), int(p), int(o)) for p, o in zip(prompts, outputs)]


def warmup_requests(args, level: int, count: int) -> list[Request]:
    text = np.random.default_rng([args.seed, 1000 + level])
    lengths = np.linspace(args.prompt_tokens[0], args.prompt_tokens[1], max(count, 1)).round().astype(int)
    return [Request(random_text(text, int(p) - 1), int(p), WARMUP_TOKENS) for p in lengths[:count]]


@dataclass
class Result:
    sent: float  # seconds from the level's start
    ttft: float | None = None
    last: float | None = None  # last choice chunk, seconds after sent
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server's usage counted them
    chunks: int = 0
    usage: bool = False
    error: str | None = None


def _sse_error(data: dict) -> str:
    err = data.get("error")
    message = err.get("message", err) if isinstance(err, dict) else err
    return " ".join(str(message).split())[:300]


async def one_request(client, model: str, req: Request, start: float) -> Result:
    import httpx

    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sent = time.perf_counter()
    r = Result(sent=sent - start)
    first = last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                r.error = f"HTTP {response.status_code}: {' '.join(text.split())[:300]}"
                return r
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    r.error = f"error in stream: {_sse_error(data)}"
                    return r
                if data.get("choices"):
                    first = first if first is not None else now
                    last = now
                    r.chunks += 1
                if data.get("usage"):
                    r.usage = True
                    r.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                    r.prompt_tokens = data["usage"].get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as err:
        r.error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        return r
    if not r.usage:
        r.output_tokens = r.chunks
    if first is None:
        r.error = "no chunk with a choice"
    elif r.output_tokens != req.output_tokens:
        r.error = f"{r.output_tokens} output tokens, asked for {req.output_tokens}"
    else:
        r.ttft, r.last = first - sent, last - sent
    return r


async def run_level(url: str, model: str, reqs: list[Request], concurrency: int, timeout: float,
                    label: str | None) -> tuple[list[Result], float]:
    """Sends ``reqs`` keeping ``concurrency`` in flight; returns the results and the wall time."""
    import httpx

    results: list[Result | None] = [None] * len(reqs)
    state = {"next": 0, "done": 0}
    every = max(1, len(reqs) // 8)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        start = time.perf_counter()

        async def worker():
            while state["next"] < len(reqs):
                i = state["next"]
                state["next"] += 1
                results[i] = await one_request(client, model, reqs[i], start)
                state["done"] += 1
                if label and (state["done"] % every == 0 or state["done"] == len(reqs)):
                    print(f"bench_serve: {label}: {state['done']}/{len(reqs)} requests done, "
                          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(reqs)))))
        wall = time.perf_counter() - start
    return results, wall


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> str:
    if os.environ.get("VLLM_PYTHON"):
        return os.environ["VLLM_PYTHON"]
    peer = Path(os.environ.get("MAXLM_PEER_ENVS", "~/.cache/maxlm/peer-envs")).expanduser() / "vllm" / "bin" / "python"
    if peer.is_file():
        return str(peer)
    raise SystemExit("bench_serve: no Python with vLLM: run bash scripts/setup_peer_envs.sh vllm (or set "
                     "VLLM_PYTHON), or leave vllm out of --systems")


def _pdeathsig() -> None:
    """In the server's process: end it (SIGTERM) if this client dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort, Linux only
        pass


def _session_procs(sid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live process of session ``sid``."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session, ..., utime, stime
            procs[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return procs


class Server:
    """One server in its own session (process group); ``stop`` ends the whole group."""

    def __init__(self, name: str, cmd: list[str], env: dict, cwd: str, log: Path, port: int):
        self.name, self.cmd, self.log, self.port = name, cmd, log, port
        self.url = f"http://127.0.0.1:{port}"
        self._out = open(log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True, preexec_fn=_pdeathsig)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout: float) -> float:
        next_note = 15.0
        while True:
            elapsed = time.perf_counter() - self.started
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return elapsed
            except (urllib.error.URLError, OSError):
                pass
            if not self.alive():
                raise RuntimeError(f"{self.name}: the server exited ({self.proc.returncode}) during start-up; "
                                   f"the end of its log ({self.log}):\n{self.tail()}")
            if elapsed > timeout:
                raise RuntimeError(f"{self.name}: not healthy after {elapsed:.0f} s; the end of its log "
                                   f"({self.log}):\n{self.tail()}")
            if elapsed >= next_note:
                last = self.tail(1)[:100]
                print(f"bench_serve: {self.name}: waiting for /health, {elapsed:.0f} s ({last})", file=sys.stderr,
                      flush=True)
                next_note += 15.0
            time.sleep(0.5)

    def model_name(self, fallback: str) -> str:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
                return json.loads(r.read())["data"][0]["id"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
            return fallback

    def cpu_seconds(self) -> float:
        return sum(_session_procs(self.proc.pid).values())

    def stop(self) -> list[int]:
        """TERM the group, KILL it after 30 s, then KILL any process of the session still alive;
        returns the processes that survived all that (none, normally)."""
        pid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
            for p in _session_procs(pid):
                if p != pid:
                    try:
                        os.kill(p, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.perf_counter() + wait
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None and not _session_procs(pid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        return list(_session_procs(pid))


def start_server(name: str, args, model_dir: str, tmp: str) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MAXLM_API_KEY", "VLLM_API_KEY")}  # the client sends none
    if name == "maxlm":
        cmd = [sys.executable, "-m", "maxlm.serve", "--checkpoint", model_dir, "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), *args.maxlm_args]
        cwd = str(ROOT)
    elif name == "vllm":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        dtype = config.get("torch_dtype") or config.get("dtype") or "auto"
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", str(dtype), "--max-model-len", str(config["max_position_embeddings"]),
               "--max-num-seqs", str(args.max_num_seqs), *args.vllm_args]
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; unset, vLLM takes 90% of memory
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        env.setdefault("OMP_NUM_THREADS", str(len(cores)))
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(tmp, "vllm-cache"))
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        cwd = tmp  # not the repository: its top-level kernels/ would shadow PyPI's kernels package
    else:
        cmd = [sys.executable, str(ROOT / "scripts" / "naive_server.py"), "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), *args.naive_args]
        cwd = tmp
    print(f"bench_serve: {name}: starting {shlex.join(cmd)}", file=sys.stderr, flush=True)
    return Server(name, cmd, env, cwd, Path(tmp) / f"{name}-server.log", port)


# ---------------------------------------------------------------------------------------------
# Measuring


def cpu_busy_seconds() -> float | None:
    from bench_train import cpu_busy_seconds as busy

    return busy()


def summarize(results: list[Result], reqs: list[Request], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft for r in ok]) if ok else np.array([np.nan])
    tpot = [(r.last - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out = sum(r.output_tokens for r in ok)
    prompt_mismatch = sum(1 for r, q in zip(results, reqs)
                          if r.error is None and r.prompt_tokens is not None and r.prompt_tokens != q.prompt_tokens)
    errors = [r.error for r in results if r.error is not None]
    return dict(requests=len(results), errors=len(errors), first_errors=errors[:3], wall_s=wall,
                output_tokens=out, output_tokens_per_s=out / wall, requests_per_s=len(ok) / wall,
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
                tpot_p50_s=float(np.median(tpot)) if tpot else float("nan"),
                e2e_p50_s=float(np.median([r.last for r in ok])) if ok else float("nan"),
                usage_reported=all(r.usage for r in ok), prompt_tokens_mismatch=prompt_mismatch)


def bench_system(name: str, args, model_dir: str, tmp: str, levels: list[list[Request]], cores: int) -> dict:
    server = start_server(name, args, model_dir, tmp)
    out: dict = {"command": server.cmd, "levels": {}}
    try:
        out["start_s"] = server.wait_healthy(args.start_timeout)
        model = server.model_name(model_dir)
        out["model"] = model
        print(f"{name}: healthy after {out['start_s']:.1f} s, model {model!r}", flush=True)
        for i, (c, reqs) in enumerate(zip(args.concurrency, levels)):
            warm = warmup_requests(args, i, max(args.warmup, c))
            if warm:
                print(f"bench_serve: {name} concurrency {c}: warm-up, {len(warm)} requests", file=sys.stderr, flush=True)
                results, _ = asyncio.run(run_level(server.url, model, warm, c, args.timeout, None))
                failed = [r.error for r in results if r.error]
                if failed:
                    raise RuntimeError(f"{name}: {len(failed)} of {len(warm)} warm-up requests failed, e.g. {failed[0]}")
            busy_start, client_start, server_start = cpu_busy_seconds(), time.process_time(), server.cpu_seconds()
            results, wall = asyncio.run(run_level(server.url, model, reqs, c, args.timeout,
                                                  f"{name} concurrency {c}"))
            busy_end, client_end, server_end = cpu_busy_seconds(), time.process_time(), server.cpu_seconds()
            s = summarize(results, reqs, wall)
            s["client_cpu_share"] = (client_end - client_start) / (wall * cores)
            s["server_cpu_share"] = (server_end - server_start) / (wall * cores)
            s["others"] = None
            if busy_start is not None and busy_end is not None:
                own = (client_end - client_start) + (server_end - server_start)
                s["others_cpu_s"] = max((busy_end - busy_start) - own, 0.0)
                s["others"] = s["others_cpu_s"] / (wall * cores)
            s["per_request"] = [asdict(r) for r in results]
            out["levels"][c] = s
            note = f", {s['errors']} errors (e.g. {s['first_errors'][0]})" if s["errors"] else ""
            print(f"{name} concurrency {c}: {s['output_tokens_per_s']:,.1f} output tokens/s, "
                  f"{s['requests_per_s']:.2f} requests/s, TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, "
                  f"TPOT p50 {s['tpot_p50_s'] * 1e3:.1f} ms, {wall:.1f} s{note}", flush=True)
            if not server.alive():
                raise RuntimeError(f"{name}: the server exited ({server.proc.returncode}); the end of its log:\n"
                                   f"{server.tail()}")
    except RuntimeError as err:
        out["error"] = str(err)
        print(f"bench_serve: {err}", file=sys.stderr, flush=True)
    finally:
        left = server.stop()
        if left:
            print(f"bench_serve: {name}: processes {left} survived SIGKILL", file=sys.stderr, flush=True)
    return out


def _ms(x: float) -> str:
    return "n/a" if np.isnan(x) else f"{x * 1e3:.1f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    if "maxlm" in args.systems and importlib.util.find_spec("maxlm.serve") is None:
        sys.exit("bench_serve: maxlm.serve cannot be imported from this checkout; leave maxlm out of --systems")
    if "vllm" in args.systems:
        vllm_python()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    fields = {f: getattr(args, f) for f in SIZE_FIELDS} | {"max_seq_len": args.max_seq_len, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="bench_serve.") as tmp:
        model_dir = args.keep_dir or os.path.join(tmp, "model")
        model_dir = os.path.abspath(model_dir)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            count = pool.apply(export, (fields, model_dir))
        print(f"model: d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} kv_heads={args.n_kv_heads} "
              f"d_ff={args.d_ff} vocab={VOCAB} (byte tokenizer) untied, {count / 1e6:.2f}M parameters, fp32, "
              f"context {args.max_seq_len}; exported to {model_dir}")
        print(f"requests: {args.requests} per level at concurrency {','.join(map(str, args.concurrency))}; prompts "
              f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, outputs {args.output_tokens[0]}-"
              f"{args.output_tokens[1]} tokens (ignore_eos), greedy, streamed; seed {args.seed}")
        print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} ({cores} cores)",
              flush=True)
        levels = [make_requests(args, i) for i in range(len(args.concurrency))]
        systems = {}
        for name in args.systems:
            systems[name] = bench_system(name, args, model_dir, tmp, levels, cores)
    load_after = os.getloadavg()

    timed = [s for sys_ in systems.values() for s in sys_["levels"].values()]
    other_s = [s.get("others_cpu_s") for s in timed]
    walls = sum(s["wall_s"] for s in timed)
    others = sum(other_s) / (walls * cores) if timed and None not in other_s else None
    busy = load_before[0] > cores or (others is not None and others > BUSY_SHARE)

    print()
    header = (f"{'system':<7}{'conc':>5}{'reqs':>5}{'errors':>7}{'wall s':>8}{'out tok/s':>10}{'req/s':>7}"
              f"{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'TPOT p50 ms':>12}{'client CPU':>11}{'others':>7}")
    print(header)
    print("-" * len(header))
    for name, sys_ in systems.items():
        if not sys_["levels"]:
            print(f"{name:<7}  failed: {sys_.get('error', '?').splitlines()[0]}")
        for c, s in sys_["levels"].items():
            oth = "n/a" if s["others"] is None else f"{s['others']:.0%}"
            print(f"{name:<7}{c:>5}{s['requests']:>5}{s['errors']:>7}{s['wall_s']:>8.1f}{s['output_tokens_per_s']:>10,.1f}"
                  f"{s['requests_per_s']:>7.2f}{_ms(s['ttft_p50_s']):>12}{_ms(s['ttft_p99_s']):>12}"
                  f"{_ms(s['tpot_p50_s']):>12}{s['client_cpu_share']:>11.0%}{oth:>7}")
    notes = [f"{n} counted output tokens from chunks (no usage chunk)" for n, s in systems.items()
             if any(not lv["usage_reported"] for lv in s["levels"].values())]
    notes += [f"{n} counted other prompt lengths than the byte tokenizer's at concurrency {c} ({lv['prompt_tokens_mismatch']} requests)"
              for n, s in systems.items() for c, lv in s["levels"].items() if lv["prompt_tokens_mismatch"]]
    print("TTFT: request sent -> first streamed chunk; TPOT: (last chunk - first) / (output tokens - 1), per request; "
          "out tok/s and req/s over the level's wall time; client CPU / others: this client's / other processes' "
          f"share of the {cores} CPUs while timing" + "".join(f"; {n}" for n in notes))
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; other processes used "
          f"{others if others is not None else float('nan'):.0%} of the CPUs while timing")

    top = RATIO_CONCURRENCY if RATIO_CONCURRENCY in args.concurrency else max(args.concurrency)
    ratios, lines = {}, []
    for peer in ("naive", "vllm"):
        key = f"maxlm/{peer}"
        a = systems.get("maxlm", {}).get("levels", {}).get(top)
        b = systems.get(peer, {}).get("levels", {}).get(top)
        if a is None or b is None:
            missing = [n for n, lv in (("maxlm", a), (peer, b)) if lv is None]
            text = f"n/a ({' and '.join(missing)} not measured)"
        elif a["errors"] or b["errors"]:
            text = "n/a (failed requests)"
        else:
            ratios[key] = a["output_tokens_per_s"] / b["output_tokens_per_s"]
            text = "n/a (busy machine)" if busy else f"{ratios[key]:.3f}"
        lines.append(f"ratio {key} output_tokens_per_s = {text}" + ("" if top == RATIO_CONCURRENCY else f" (concurrency {top})"))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            args={k: v for k, v in vars(args).items()}, parameters=count, load_before=load_before,
            load_after=load_after, others=others, busy=busy, systems=systems, ratios=ratios,
            ratio_concurrency=top), indent=1))
    if busy:
        print(f"WARNING: the machine was busy (load {load_before[0]:.2f} before, others "
              f"{others if others is not None else 0:.0%}), so no ratio is a result; rerun when it is idle")
    for line in lines:
        print(line)
    failed = [n for n, s in systems.items() if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers are stopped by then
        sys.exit("bench_serve: interrupted")
