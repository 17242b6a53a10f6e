"""``maxlm.serve``'s HTTP API, spoken to by the unmodified ``openai`` client and by raw HTTP: every
answer is checked against ``maxlm.infer.generate`` (the independent reference), under load (32
clients, 200 requests); bad input gets its 4xx and the next request still works; a client that
disconnects frees its blocks; the API key; a full queue; SIGTERM drains (a real process)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn

from maxlm import model
from maxlm.config import ModelConfig
from maxlm.data.tokenizer import ByteTokenizer
from maxlm.infer import generate as gen
from maxlm.serve.api import DEFAULT_CHAT_TEMPLATE, build_app, chat_renderer
from maxlm.serve.engine import Engine, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128,
             dtype="float32", init_std=0.2)
NAME = "tiny"
MOST_NEW = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An app on uvicorn in a thread of this process (the engine on its own thread)."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served():
    cfg = ModelConfig(**LLAMA)
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    tok = ByteTokenizer()
    engine = Engine(cfg, params, tok, EngineConfig(max_num_seqs=32, block_size=8, max_prefill_tokens=64))
    engine.start()
    server = Server(build_app(engine, NAME))
    yield SimpleNamespace(url=server.url, engine=engine, cfg=cfg, params=params, tok=tok)
    server.stop()
    engine.shutdown()


def reference_texts(s, prompts, new=MOST_NEW):
    """Greedy completions (token ids) of text prompts from maxlm.generate, bos first as the server
    encodes them; no stop token (the requests send ignore_eos)."""
    ids = [s.tok.encode(p, add_eos=False) for p in prompts]
    return gen.run(s.cfg, s.params, ids, new).tokens


def text_of(s, tokens):
    return s.tok.decode(np.asarray(tokens, np.int32))


def client(s, **kw):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_openai_client_completions_chat_and_streaming(served):
    s = served
    c = client(s)
    assert [m.id for m in c.models.list().data] == [NAME]
    prompt = "def fibonacci(n):"
    want = text_of(s, reference_texts(s, [prompt])[0][:12])
    extra = {"ignore_eos": True}
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == len(prompt) + 1
    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = chat_renderer(DEFAULT_CHAT_TEMPLATE.read_text())(messages)
    want_chat = text_of(s, reference_texts(s, [rendered])[0][:10])
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body=extra)
    assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
    pieces = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body=extra))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == want_chat
    assert pieces[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_32_clients_200_requests_equal_generate(served):
    s = served
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz  ,.()=:"))
    prompts = ["".join(rng.choice(alphabet, int(rng.integers(1, 100)))) for _ in range(200)]
    limits = [int(rng.integers(1, MOST_NEW + 1)) for _ in prompts]
    ref = reference_texts(s, prompts)

    async def run():
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(32)

        async def one(i):
            async with gate:
                if i % 4 == 0:  # a quarter stream
                    stream = await c.completions.create(model=NAME, prompt=prompts[i], max_tokens=limits[i],
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
                    return "".join([ch.choices[0].text async for ch in stream if ch.choices])
                out = await c.completions.create(model=NAME, prompt=prompts[i], max_tokens=limits[i],
                                                 temperature=0, extra_body={"ignore_eos": True})
                return out.choices[0].text
        try:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await c.close()
    texts = asyncio.run(run())
    for i, (text, want, n) in enumerate(zip(texts, ref, limits)):
        assert text == text_of(s, want[:n]), f"request {i}"
    deadline = time.time() + 10
    while s.engine.busy() and time.time() < deadline:
        time.sleep(0.05)
    assert s.engine.blocks.leaks() == []
    metrics = httpx.get(s.url + "/metrics").text
    for name in ("maxlm_requests_waiting", "maxlm_requests_running", "maxlm_kv_blocks_used", "maxlm_kv_blocks_free",
                 "maxlm_prefix_cache_hit_rate", "maxlm_generation_tokens_per_second", "maxlm_kv_waste_ratio",
                 "maxlm_time_to_first_token_seconds_bucket", "maxlm_time_per_output_token_seconds_bucket"):
        assert name in metrics
    print(f"KV waste during the load: {s.engine.kv_waste():.1%}")


def _post(s, path, body, raw=False, **kw):
    content = body if raw else json.dumps(body)
    return httpx.post(s.url + path, content=content, headers={"Content-Type": "application/json"},
                      **{"timeout": 60, **kw})


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ([1, 2], 400, None),
    ({"model": NAME, "prompt": "x" * 200, "max_tokens": 4}, 400, "prompt"),
    ({"model": NAME, "prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hello", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": "gpt-4", "prompt": "hello"}, 404, "model"),
    ({"model": NAME, "prompt": "hello", "max_tokenz": 4}, 400, "max_tokenz"),
    ({"model": NAME, "prompt": "hello", "n": 2}, 400, "n"),
    ({"model": NAME, "prompt": "hello", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "hello", "stop": [""]}, 400, "stop"),
    ({"prompt": "hello"}, 400, "model"),
])
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_goes_on(served, body, status, param):
    s = served
    reply = _post(s, "/v1/completions", body, raw=isinstance(body, str))
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    good = _post(s, "/v1/completions", {"model": NAME, "prompt": "ab", "max_tokens": 3, "temperature": 0,
                                        "ignore_eos": True})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == text_of(s, reference_texts(s, ["ab"])[0][:3])


def test_a_disconnect_mid_stream_frees_the_blocks(served, monkeypatch):
    s = served
    # This model decodes 80 tokens in well under the time a loaded machine takes to read one chunk
    # and look: slow each engine step so the request is still running when the client leaves.
    step = s.engine.step
    monkeypatch.setattr(s.engine, "step", lambda: (time.sleep(0.02), step())[1])
    body = {"model": NAME, "prompt": "a" * 40, "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
    aborted = s.engine.metrics.finished.labels("abort")._value.get()
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as reply:
        next(reply.iter_lines())  # the first chunk came: the request holds blocks
        assert s.engine.blocks.num_used > 0
    deadline = time.time() + 20
    while (s.engine.busy() or s.engine.blocks.leaks()) and time.time() < deadline:
        time.sleep(0.05)
    assert s.engine.blocks.leaks() == [] and not s.engine.busy()
    assert s.engine.metrics.finished.labels("abort")._value.get() == aborted + 1


def test_api_key_is_required_when_set(served):
    s = served
    server = Server(build_app(s.engine, NAME, api_key="sekret"))
    try:
        keyed = SimpleNamespace(**{**vars(s), "url": server.url})
        with pytest.raises(openai.AuthenticationError):
            client(keyed, api_key="wrong").completions.create(model=NAME, prompt="ab", max_tokens=2)
        assert httpx.post(server.url + "/v1/completions", json={}).status_code == 401
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        out = client(keyed, api_key="sekret").completions.create(model=NAME, prompt="ab", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        server.stop()


def test_a_full_queue_answers_429_and_a_client_that_gives_up_is_aborted(served):
    s = served
    idle = Engine(s.cfg, s.params, s.tok, EngineConfig(max_num_seqs=2, block_size=8, max_queue=1))  # never started
    server = Server(build_app(idle, NAME))
    try:
        body = {"model": NAME, "prompt": "ab", "max_tokens": 2}
        first = threading.Thread(target=lambda: _swallow(lambda: httpx.post(server.url + "/v1/completions",
                                                                            json=body, timeout=3)))
        first.start()
        deadline = time.time() + 10
        while not idle._inbox and time.time() < deadline:
            time.sleep(0.02)
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
        first.join()  # its client gave up waiting: the server notices and aborts the request
        while not idle._aborts and time.time() < deadline:
            time.sleep(0.02)
        idle.step()
        assert not idle.busy() and idle.metrics.finished.labels("abort")._value.get() == 1
    finally:
        server.stop()


def _swallow(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass


# ---- the command line, as a process


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from maxlm import hf
    from maxlm.hf.load import LoadedModel

    cfg = ModelConfig(**LLAMA)
    out = tmp_path_factory.mktemp("serve") / "tiny"
    hf.export_model(LoadedModel(cfg, jax.device_get(model.init_params(cfg, jax.random.PRNGKey(1))), ByteTokenizer(),
                                None, "random"), out)
    return out


@pytest.mark.slow
def test_sigterm_drains_the_requests_in_flight_then_exits_0(exported):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), MAXLM_API_KEY="")
    env.pop("MAXLM_API_KEY")
    proc = subprocess.Popen([sys.executable, "-m", "maxlm.serve", "--checkpoint", str(exported), "--port", str(port),
                             "--served-model-name", NAME, "--no-warmup", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": NAME, "prompt": "hello", "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 60
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
        assert "drained and stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_mistakes_are_one_line_and_exit_2(exported, tmp_path, capsys):
    from maxlm.serve.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [
        (["--checkpoint", str(exported), "--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1:"),
        (["--checkpoint", str(exported), "--host", "no.such.host.invalid"], "--host no.such.host.invalid"),
        (["--checkpoint", str(tmp_path / "nope")], "nope"),
        (["--checkpoint", str(exported), "--num-blocks", "3"], "--num-blocks = 3"),
        (["--checkpoint", str(exported), "--block-size", "12"], "--block-size = 12"),
        (["--checkpoint", str(exported), "--port", "70000"], "--port"),
        (["--checkpoint", str(exported), "--chat-template", str(tmp_path / "none.jinja")], "none.jinja"),
    ]
    for argv, needle in cases:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
        assert err.startswith("maxlm.serve: error:")
    taken.close()
