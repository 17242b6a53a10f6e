"""Smoke client for an OpenAI-compatible server (vLLM via scripts/serve_vllm.sh): one completion and
one chat request through the ``openai`` client, each printed on one line.

    python scripts/vllm_smoke.py --base-url http://127.0.0.1:8000/v1

Needs only the ``openai`` package (the vllm peer environment has it). Exit status 0 when both
requests answered, 1 when one failed (the error is printed), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument("--prompt", default="The capital of France is", help="completion prompt")
    p.add_argument("--message", default="Say hello in one short sentence.", help="chat user message")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    p.add_argument("--no-chat", action="store_true", help="send the completion request only")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import openai
    except ImportError:
        print("vllm_smoke.py: the openai package is missing (pip install openai)", file=sys.stderr)
        return 2
    client = openai.OpenAI(base_url=args.base_url, api_key="EMPTY", timeout=args.timeout, max_retries=0)
    failed = 0
    try:
        model = args.model or client.models.list().data[0].id
    except openai.OpenAIError as err:
        print(f"models      FAILED: {type(err).__name__}: {err}")
        return 1
    print(f"model       {model}")

    start = time.perf_counter()
    try:
        out = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens,
                                        temperature=0.0)
        choice = out.choices[0]
        print(f"completion  {args.prompt!r} -> {choice.text!r} ({out.usage.completion_tokens} tokens, "
              f"finish_reason={choice.finish_reason}, {time.perf_counter() - start:.2f} s)")
    except openai.OpenAIError as err:
        print(f"completion  FAILED: {type(err).__name__}: {err}")
        failed += 1

    if args.no_chat:
        print("chat        skipped (--no-chat)")
    else:
        start = time.perf_counter()
        try:
            # vLLM renders the chat template and tokenises the result without special tokens by
            # default; add_special_tokens (a vLLM extension) lets the tokenizer put bos first.
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": args.message}],
                max_tokens=args.max_tokens, temperature=0.0, extra_body={"add_special_tokens": True})
            choice = out.choices[0]
            print(f"chat        {args.message!r} -> {choice.message.content!r} "
                  f"({out.usage.completion_tokens} tokens, finish_reason={choice.finish_reason}, "
                  f"{time.perf_counter() - start:.2f} s)")
        except openai.OpenAIError as err:
            hint = (" (the model has no chat template: export one, or pass --chat-template)"
                    if "chat template" in str(err).lower() else "")
            print(f"chat        FAILED{hint}: {type(err).__name__}: {err}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
