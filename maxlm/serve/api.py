"""The OpenAI-compatible HTTP API over an ``Engine`` (FastAPI; uvicorn runs it).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream by server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

The engine runs on its own thread; its outputs cross to the event loop through a ``_Mailbox``, one
wake-up of the loop for all the outputs posted since the last (about one per engine step, not one
per sequence and token), into one ``asyncio.Queue`` per HTTP request. A request that fails
validation, names another model or asks for more than the context holds gets a 4xx with an OpenAI error body naming the field; a
full queue gets 429; a request after shutdown began gets 503. A client that goes away mid-request
has its request aborted, so its KV blocks are freed at the engine's next step. With an API key,
every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and
``/metrics`` stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2.sandbox
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from maxlm.data import chat
from maxlm.serve.engine import Draining, Engine, Output, QueueFull, RequestError
from maxlm.serve.protocol import APIError, ChatRequest, CompletionRequest, parse

DEFAULT_CHAT_TEMPLATE = chat.TEMPLATE_PATH  # the one template, shared with SFT and the export
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def chat_renderer(template: str):
    """messages -> prompt text, as transformers' ``apply_chat_template`` renders a template (a
    sandboxed Jinja environment with trim_blocks and lstrip_blocks). The prompt is then encoded
    with the tokenizer's bos, so ``bos_token`` renders empty (no second bos)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)

    def render(messages: list[dict]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
    return render


class _Mailbox:
    """Hands the engine thread's outputs to the event loop. At 32 streams a step makes 32 outputs;
    one ``call_soon_threadsafe`` each woke the loop 32 times per step, so the loop, not the engine,
    set the pace. Posts wait in a list, and only the first post after a flush schedules one."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.pending = loop, threading.Lock(), []

    def post(self, queue: asyncio.Queue, item: Any) -> None:  # on the engine thread
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:  # a flush is scheduled already
                return
        self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:  # on the event loop
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)


class _Request:
    """One prompt in flight: posts the engine's outputs to its HTTP request's queue as (index,
    output), and adds them up."""

    def __init__(self, index: int, queue: asyncio.Queue, mailbox: _Mailbox):
        self.index, self.queue, self.mailbox = index, queue, mailbox
        self.id: str | None = None
        self.text, self.tokens, self.prompt, self.cached = "", 0, 0, 0
        self.finish: str | None = None

    def __call__(self, output: Output) -> None:  # on the engine thread
        self.mailbox.post(self.queue, (self.index, output))

    @property
    def done(self) -> bool:
        return self.finish is not None

    def take(self, out: Output) -> None:
        self.text += out.text
        self.tokens, self.prompt, self.cached = out.completion_tokens, out.prompt_tokens, out.cached_tokens
        self.finish = out.finish_reason


def usage(handles: list[_Request]) -> dict:
    prompt, completion = sum(h.prompt for h in handles), sum(h.tokens for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(h.cached for h in handles)}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({getattr(err, 'msg', err)})") from None


def completion_chunks(base: dict, i: int | None, text: str, finish: str | None) -> list[dict]:
    """The SSE chunks of /v1/completions for one output of prompt ``i`` (None: the opening, none)."""
    if i is None:
        return []
    return [{**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}]


def chat_chunks(base: dict, i: int | None, text: str, finish: str | None) -> list[dict]:
    """The SSE chunks of /v1/chat/completions: an opening one naming the role, then deltas."""
    if i is None:
        delta, i = {"role": "assistant", "content": ""}, 0
    else:
        delta = {"content": text} if text else {}
    return [{**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}]


class _Server:
    """What the routes share: the engine, the model's name, its tokenizer and chat template."""

    def __init__(self, engine: Engine, model_name: str, chat_template: str | None):
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.mailbox: _Mailbox | None = None  # made on the first request, for the running loop
        self.render = None if self.tokenizer is None else chat_renderer(
            chat_template or DEFAULT_CHAT_TEMPLATE.read_text())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def encode(self, prompt: Any) -> list[list[int]]:
        """A prompt field (text, token ids, or a list of either) as token-id prompts, bos first."""
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids as the prompt", "prompt")
                p = [int(t) for t in self.tokenizer.encode(p, add_bos=True, add_eos=False)]
            out.append(list(p))
        return out

    def chat_prompt(self, req: ChatRequest) -> str:
        if self.render is None:
            raise APIError(400, "this model has no tokenizer, so chat messages cannot be encoded", "messages")
        try:
            return self.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except jinja2.TemplateError as err:
            raise APIError(400, f"the chat template cannot render these messages ({err})", "messages") from None

    def submit(self, prompts: list[list[int]], req, max_tokens: int | None) -> list[_Request]:
        """Queue every prompt, or none: an engine refusal aborts those already queued."""
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens = {max_tokens} must be >= 1", "max_tokens")
        engine, loop, handles, queue = self.engine, asyncio.get_running_loop(), [], asyncio.Queue()
        if self.mailbox is None or self.mailbox.loop is not loop:
            self.mailbox = _Mailbox(loop)
        try:
            for i, prompt in enumerate(prompts):
                limit = max_tokens if max_tokens is not None else engine.cfg.max_seq_len - len(prompt)
                handle = _Request(i, queue, self.mailbox)
                handle.id = engine.submit(prompt, req.params(limit), handle, request_id=uuid.uuid4().hex)
                handles.append(handle)
        except (RequestError, QueueFull, Draining) as err:
            self.abort(handles)
            if isinstance(err, RequestError):
                raise APIError(400, str(err), err.param) from None
            if isinstance(err, QueueFull):
                raise APIError(429, str(err), code="queue_full") from None
            raise APIError(503, str(err)) from None
        return handles

    def abort(self, handles: list[_Request]) -> None:
        for h in handles:
            if not h.done:
                self.engine.abort(h.id)

    @staticmethod
    async def arrivals(queue: asyncio.Queue, timeout: float | None = None) -> list[tuple[int, Output]]:
        """Every (index, output) that has arrived in an HTTP request's queue, waiting for the
        first: a reader that fell behind takes them all at once."""
        items = [await (queue.get() if timeout is None else asyncio.wait_for(queue.get(), timeout))]
        while not queue.empty():
            items.append(queue.get_nowait())
        return items

    async def collect(self, request: Request, handles: list[_Request]) -> list[_Request]:
        """Wait for every prompt's last output; abort all when the client goes away."""
        try:
            while not all(h.done for h in handles):
                try:
                    for i, out in await self.arrivals(handles[0].queue, DISCONNECT_POLL_S):
                        handles[i].take(out)
                except TimeoutError:
                    if await request.is_disconnected():  # nobody reads the answer (nginx's 499)
                        raise APIError(499, "the client closed the connection") from None
        finally:
            self.abort(handles)
        if any(h.finish == "error" for h in handles):
            raise APIError(500, "the engine failed while running this request (see the server log)")
        return handles

    async def stream(self, handles: list[_Request], chunks, base: dict, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per engine step of any prompt, then usage (if asked) and
        [DONE]; the chunks that arrived together leave in one write. Cancelled when the client
        disconnects; the ``finally`` aborts what still runs."""
        try:
            for head in chunks(base, None, "", None):
                yield sse(head)
            while not all(h.done for h in handles):
                events = []
                for i, out in await self.arrivals(handles[0].queue):
                    handles[i].take(out)
                    if out.finish_reason == "error":
                        yield "".join(events) + sse(APIError(500, "the engine failed while running this request").body())
                        return
                    if out.token_ids or out.text or out.finish_reason is not None:  # a chunk per step
                        events += [sse(piece) for piece in chunks(base, i, out.text, out.finish_reason)]
                if events:
                    yield "".join(events)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(handles)})
            yield "data: [DONE]\n\n"
        finally:
            self.abort(handles)


def build_app(engine: Engine, model_name: str, *, api_key: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    server = _Server(engine, model_name, chat_template)
    app = FastAPI(title="maxlm.serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def authorized(request: Request) -> None:
        """The /v1 routes' guard (a dependency, not a middleware: Starlette's HTTP middleware
        would hide a client's disconnect from the route)."""
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                               code="invalid_api_key")
    guarded = [Depends(authorized)]

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health():
        return Response(status_code=503 if engine.draining else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "maxlm", "max_model_len": engine.cfg.max_seq_len}]}

    async def answer(request: Request, req, prompts: list[list[int]], max_tokens: int | None, kind: str):
        """Run ``prompts`` and answer as ``kind`` ("text_completion" or "chat.completion")."""
        handles = server.submit(prompts, req, max_tokens)
        rid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        base = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name}
        if req.stream:
            chunks = completion_chunks if kind == "text_completion" else chat_chunks
            if kind != "text_completion":
                base["object"] = "chat.completion.chunk"
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(server.stream(handles, chunks, base, include), media_type="text/event-stream")
        done = await server.collect(request, handles)
        if kind == "text_completion":
            choices = [{"index": i, "text": h.text, "logprobs": None, "finish_reason": h.finish}
                       for i, h in enumerate(done)]
        else:
            choices = [{"index": 0, "message": {"role": "assistant", "content": done[0].text}, "logprobs": None,
                        "finish_reason": done[0].finish}]
        return {**base, "choices": choices, "usage": usage(done)}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        req = parse(CompletionRequest, await json_body(request))
        server.check_model(req.model)
        return await answer(request, req, server.encode(req.prompt), req.max_tokens, "text_completion")

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(request: Request):
        req = parse(ChatRequest, await json_body(request))
        server.check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await answer(request, req, server.encode(server.chat_prompt(req)), max_tokens, "chat.completion")

    return app
