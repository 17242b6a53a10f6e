"""The OpenAI-compatible HTTP API over an ``Engine`` (FastAPI; uvicorn runs it).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream by server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

The engine runs on its own thread; each request's outputs cross to the event loop through an
``asyncio.Queue`` (``call_soon_threadsafe``). A request that fails validation, names another model
or asks for more than the context holds gets a 4xx with an OpenAI error body naming the field; a
full queue gets 429; a request after shutdown began gets 503. A client that goes away mid-request
has its request aborted, so its KV blocks are freed at the engine's next step. With an API key,
every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and
``/metrics`` stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2.sandbox
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from maxlm.serve.engine import Draining, Engine, Output, QueueFull, RequestError
from maxlm.serve.protocol import APIError, ChatRequest, CompletionRequest, parse

DEFAULT_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
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


class _Request:
    """One prompt in flight: the engine's outputs, queued for the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.id: str | None = None
        self.done = False

    def __call__(self, output: Output) -> None:  # on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)


def build_app(engine: Engine, model_name: str, *, api_key: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    tokenizer = engine.tokenizer
    render = None if tokenizer is None else chat_renderer(chat_template or DEFAULT_CHAT_TEMPLATE.read_text())
    app = FastAPI(title="maxlm.serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def error(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    def authorized(request: Request) -> None:
        """The /v1 routes' guard (a dependency, not a middleware: Starlette's HTTP middleware
        would hide a client's disconnect from the route)."""
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                               code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError):
        return error(err)

    @app.get("/health")
    async def health():
        return Response(status_code=503 if engine.draining else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "maxlm", "max_model_len": engine.cfg.max_seq_len}]}

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON ({getattr(err, 'msg', err)})") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")

    def encode(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids as the prompt", "prompt")
                p = [int(t) for t in tokenizer.encode(p, add_bos=True, add_eos=False)]
            out.append(list(p))
        return out

    def submit(prompts: list[list[int]], req, max_tokens: int, loop) -> list[_Request]:
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens = {max_tokens} must be >= 1", "max_tokens")
        handles = []
        try:
            for prompt in prompts:
                limit = max_tokens if max_tokens is not None else engine.cfg.max_seq_len - len(prompt)
                handle = _Request(loop)
                handle.id = engine.submit(prompt, req.params(limit), handle, request_id=uuid.uuid4().hex)
                handles.append(handle)
        except (RequestError, QueueFull, Draining) as err:
            for h in handles:
                engine.abort(h.id)
            if isinstance(err, RequestError):
                raise APIError(400, str(err), err.param) from None
            if isinstance(err, QueueFull):
                raise APIError(429, str(err), code="queue_full") from None
            raise APIError(503, str(err)) from None
        return handles

    async def collect(request: Request, handles: list[_Request]) -> list[dict]:
        """Wait for every prompt's last output; abort all when the client goes away."""
        results = [{"text": "", "tokens": 0, "finish": None, "prompt": 0, "cached": 0} for _ in handles]
        try:
            for r, handle in zip(results, handles):
                while not handle.done:
                    try:
                        out = await asyncio.wait_for(handle.queue.get(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        if await request.is_disconnected():  # nobody reads the answer (nginx's 499)
                            raise APIError(499, "the client closed the connection") from None
                        continue
                    r["text"] += out.text
                    r["tokens"], r["prompt"], r["cached"] = out.completion_tokens, out.prompt_tokens, out.cached_tokens
                    if out.finish_reason is not None:
                        r["finish"], handle.done = out.finish_reason, True
        finally:
            for h in handles:
                if not h.done:
                    engine.abort(h.id)
        if any(r["finish"] == "error" for r in results):
            raise APIError(500, "the engine failed while running this request (see the server log)")
        return results

    def usage(results: list[dict]) -> dict:
        prompt, completion = sum(r["prompt"] for r in results), sum(r["tokens"] for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r["cached"] for r in results)}}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(handles: list[_Request], chunk, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per output of any prompt, then usage (if asked) and [DONE].
        Cancelled when the client disconnects; the ``finally`` aborts what is still running."""
        results = [{"text": "", "tokens": 0, "finish": None, "prompt": 0, "cached": 0} for _ in handles]
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, handle):
            while True:
                out = await handle.queue.get()
                await merged.put((i, out))
                if out.finish_reason is not None:
                    return
        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            for head in chunk(None, None, None):
                yield sse(head)
            left = len(handles)
            while left:
                i, out = await merged.get()
                r = results[i]
                r["tokens"], r["prompt"], r["cached"] = out.completion_tokens, out.prompt_tokens, out.cached_tokens
                if out.finish_reason is not None:
                    handles[i].done, left = True, left - 1
                    if out.finish_reason == "error":
                        yield sse(APIError(500, "the engine failed while running this request").body())
                        break
                if out.token_ids or out.text or out.finish_reason is not None:  # a chunk per step
                    for piece in chunk(i, out.text, out.finish_reason):
                        yield sse(piece)
            else:
                if include_usage:
                    yield sse(chunk(None, None, None, usage=usage(results)))
                yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            for h in handles:
                if not h.done:
                    engine.abort(h.id)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        req = parse(CompletionRequest, await body_of(request))
        check_model(req.model)
        handles = submit(encode(req.prompt), req, req.max_tokens, asyncio.get_running_loop())
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
        if req.stream:
            def chunk(i, text, finish, usage=None):
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                if i is None:
                    return []
                return [{**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(handles, chunk, include), media_type="text/event-stream")
        results = await collect(request, handles)
        return {**base, "choices": [{"index": i, "text": r["text"], "logprobs": None, "finish_reason": r["finish"]}
                                    for i, r in enumerate(results)], "usage": usage(results)}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request):
        req = parse(ChatRequest, await body_of(request))
        check_model(req.model)
        if render is None:
            raise APIError(400, "this model has no tokenizer, so chat messages cannot be encoded", "messages")
        try:
            text = render([{"role": m.role, "content": m.text()} for m in req.messages])
        except jinja2.TemplateError as err:
            raise APIError(400, f"the chat template cannot render these messages ({err})", "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        handles = submit(encode(text), req, max_tokens, asyncio.get_running_loop())
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}

            def chunk(i, text, finish, usage=None):
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                if i is None:  # the opening chunk names the role
                    return [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}]
                delta = {"content": text} if text else {}
                return [{**base, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(handles, chunk, include), media_type="text/event-stream")
        results = await collect(request, handles)
        r = results[0]
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"]}, "logprobs": None,
                             "finish_reason": r["finish"]}], "usage": usage(results)}

    return app
