"""The "FastAPI + model.generate" server that practitioner guides start from, OpenAI-compatible enough
for scripts/bench_serve.py: one request at a time through transformers' ``generate``.

    python scripts/naive_server.py --model DIR --port 8002
    python scripts/naive_server.py --model DIR --port 8002 --threads 2 --served-model-name tiny

DIR is a Hugging Face directory (e.g. ``python -m maxlm.hf export``'s). The model is loaded with
``AutoModelForCausalLM.from_pretrained`` (default attention, fp32 unless --dtype) on the CPU, with
``torch.set_num_threads(--threads)`` (default: the CPUs this process may use). Requests are
serialised with a FIFO lock: each runs ``model.generate`` (batch 1, KV cache) to the end before the
next starts; there is no batching. Endpoints:

  GET  /health           200 once the model is loaded
  GET  /v1/models        one model, named --served-model-name (default: --model as given, as vLLM does)
  POST /v1/completions   prompt (a string, a list of one string, or a list of token ids), max_tokens
                         (default 16), temperature (0 or absent: greedy; > 0: sampling with top_p),
                         stream, stream_options.include_usage, ignore_eos (vLLM's extension: do not
                         stop at the end-of-sequence token, so exactly max_tokens tokens come out)

Streaming uses transformers' ``TextIteratorStreamer`` fed by ``generate`` in a thread: one SSE event
``data: {...}`` per generated token (its text may be empty while the streamer holds back an
unfinished word or character), then one with the streamer's remaining text and finish_reason, the
usage chunk when asked for, and ``data: [DONE]``. Errors are OpenAI-style JSON with status 400.
"""

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8002, help="port to listen on (default: 8002)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else (os.cpu_count() or 1), help="torch.set_num_threads (default: the CPUs this process may use)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weights and compute dtype (default: float32)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    return p.parse_args(argv)


class BadRequest(ValueError):
    """A client mistake: answered with status 400 and this message."""


class Cancelled:
    """A stopping criterion that ends ``generate`` once the client has gone away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class Engine:
    """The model, its tokenizer and the lock that lets one ``generate`` run at a time."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.threads)
        self.torch = torch
        self.name = args.served_model_name or args.model
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos = eos
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos)
        # generate() fills settings a request leaves at the global default from the model's own
        # generation config; with no eos there, a request without ignore_eos passes it explicitly.
        gen.eos_token_id = None
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self.lock = asyncio.Lock()  # FIFO: waiters are served in arrival order
        self.count = sum(p.numel() for p in self.model.parameters())

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return prompt
        raise BadRequest("prompt must be a string, a list of one string or a list of token ids (one prompt per request)")

    def generate_kwargs(self, body: dict, ids: list[int], streamer, cancel: threading.Event) -> dict:
        from transformers import StoppingCriteriaList

        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if self.max_len is not None and len(ids) + max_tokens > self.max_len:
            raise BadRequest(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceed the model's "
                             f"maximum context length ({self.max_len})")
        temperature = body.get("temperature")
        if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
            raise BadRequest(f"temperature must be a number >= 0, got {temperature!r}")
        sample = bool(temperature)
        kwargs = dict(input_ids=self.torch.tensor([ids]), attention_mask=self.torch.ones(1, len(ids), dtype=self.torch.long),
                      max_new_tokens=max_tokens, do_sample=sample, pad_token_id=self.pad, streamer=streamer,
                      stopping_criteria=StoppingCriteriaList([Cancelled(cancel)]))
        if sample:
            kwargs.update(temperature=float(temperature), top_p=float(body.get("top_p") or 1.0))
        if not body.get("ignore_eos", False) and self.eos is not None:
            kwargs["eos_token_id"] = self.eos
        return kwargs

    async def pieces(self, kwargs: dict, streamer, cancel: threading.Event):
        """Yields (text, end) from the streamer: one per generated token (end False), then the
        remainder its end() flushes (end True). Waits for the lock first; the generation
        thread releases it when generate returns."""
        await self.lock.acquire()
        loop = asyncio.get_running_loop()
        failed: list[BaseException] = []

        def target():
            try:
                self.model.generate(**kwargs)
            except BaseException as err:  # noqa: BLE001 - reported to the request
                failed.append(err)
                streamer.text_queue.put(streamer.stop_signal)
            finally:
                loop.call_soon_threadsafe(self.lock.release)

        try:
            threading.Thread(target=target, daemon=True).start()
        except BaseException:
            self.lock.release()
            raise
        try:
            pieces = iter(streamer)
            while True:
                piece = await asyncio.to_thread(next, pieces, None)
                if piece is None:
                    break
                yield piece
        finally:
            cancel.set()  # a client that went away stops the generation at its next token
        if failed:
            raise RuntimeError(f"generate failed: {type(failed[0]).__name__}: {failed[0]}")


def make_app(engine: Engine):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import TextIteratorStreamer

    class Streamer(TextIteratorStreamer):
        """TextIteratorStreamer whose items say whether they are end()'s flush: (text, end)."""

        def on_finalized_text(self, text: str, stream_end: bool = False):
            super().on_finalized_text((text, stream_end), stream_end)

    app = FastAPI()

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                            status_code=status)

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "naive_server", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error(f"the body is not JSON ({err})")
        if not isinstance(body, dict):
            return error("the body must be a JSON object")
        if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or body.get("echo"):
            return error("n, best_of and echo are not supported")
        if body.get("model") not in (None, engine.name):
            return error(f"the model {body.get('model')!r} does not exist (this server serves {engine.name!r})", 404)
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        streamer = Streamer(engine.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = threading.Event()
        try:
            ids = engine.prompt_ids(body.get("prompt"))
            kwargs = engine.generate_kwargs(body, ids, streamer, cancel)
        except BadRequest as err:
            return error(str(err))
        rid, created, max_tokens = f"cmpl-{uuid.uuid4().hex}", int(time.time()), kwargs["max_new_tokens"]

        def chunk(text: str, finish: str | None = None, usage: dict | None = None) -> str:
            choices = [] if usage else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
            data = {"id": rid, "object": "text_completion", "created": created, "model": engine.name,
                    "choices": choices}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not stream:
            try:
                pieces = [p async for p in engine.pieces(kwargs, streamer, cancel)]
            except RuntimeError as err:
                return error(str(err), 500)
            n = sum(not end for _, end in pieces)
            return {"id": rid, "object": "text_completion", "created": created, "model": engine.name,
                    "choices": [{"index": 0, "text": "".join(text for text, _ in pieces), "logprobs": None,
                                 "finish_reason": "length" if n >= max_tokens else "stop"}],
                    "usage": usage(n)}

        async def events():
            n = 0
            try:
                async for text, end in engine.pieces(kwargs, streamer, cancel):
                    if end:  # the streamer's remainder: no token of its own; the last choice chunk
                        yield chunk(text, "length" if n >= max_tokens else "stop")
                    else:
                        n += 1
                        yield chunk(text)
                if include_usage:
                    yield chunk("", usage=usage(n))
            except RuntimeError as err:
                yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'internal_error', 'code': 500}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        sys.exit(f"naive_server.py: {args.model}/config.json not found (not a Hugging Face directory)")
    import uvicorn

    start = time.perf_counter()
    engine = Engine(args)
    print(f"naive_server: {engine.name}: {engine.count / 1e6:.2f}M parameters, {args.dtype}, "
          f"{args.threads} torch threads, loaded in {time.perf_counter() - start:.1f} s; "
          f"serving http://{args.host}:{args.port}/v1 one request at a time", flush=True)
    uvicorn.run(make_app(engine), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
