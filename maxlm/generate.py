"""Generate text from a trained model: ``python -m maxlm.generate --checkpoint PATH --prompt TEXT``.

A thin command line over ``maxlm.infer``: ``load_model`` opens the checkpoint on an inference mesh,
``maxlm.infer.generate.run`` generates. Every user mistake (a missing checkpoint, a bad option
value, an empty or malformed prompts file, a prompt longer than the context) is one line on stderr
naming the file, line or value at fault, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from maxlm.cli_args import OneLineParser, UserError, number

EXAMPLES = """\
examples:
  # greedy, streamed to the terminal, stops at the tokenizer's end-of-sequence token
  python -m maxlm.generate --checkpoint runs/tiny --prompt 'def fib(n):'

  # sampling, two prompts in one batch, a stop string
  python -m maxlm.generate --checkpoint runs/tiny --prompt 'import os' --prompt 'class A:' \\
      --temperature 0.8 --top-p 0.95 --repetition-penalty 1.1 --stop $'\\n\\n' --seed 1

  # a prompts file (one {"prompt": "..."} per line), results as JSON lines, 2-way tensor parallel
  python -m maxlm.generate --checkpoint runs/tiny/checkpoints/760 --prompts prompts.jsonl \\
      --out results.jsonl --no-stream --tensor 2

  # a chat model (python -m maxlm.sft): the prompt is the user's message, in the chat template
  python -m maxlm.generate --checkpoint runs/sft_tiny --chat --prompt $'Uppercase the word.\n\nhello'

  # a Hugging Face directory (config.json + *.safetensors + tokenizer.json)
  python -m maxlm.generate --checkpoint exported/ --prompt 'Hello' --max-new-tokens 32

The output ends with a summary line: prefill and decode tokens/s, the shape bucket that ran, and
the compile time. --out writes one JSON object per prompt: prompt, completion, tokens (the new
token ids) and finish_reason ("length", "stop_token" or "stop_string"; a completion ends before its
stop string). Each prompt must leave room for one new token in the model's context.
"""




def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m maxlm.generate", description=__doc__.splitlines()[0].removesuffix(":"),
                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CKPT_DIR|HF_DIR",
                   help="a maxlm run directory (its newest good checkpoint, or --step), one checkpoint "
                        "RUN_DIR/checkpoints/STEP, or a Hugging Face directory")
    p.add_argument("--adapter", metavar="PEFT_DIR",
                   help="LoRA adapters in PEFT's format to put on the checkpoint (e.g. from "
                        "`maxlm.hf export --lora peft`, or trained with Hugging Face PEFT)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": "..."} object per line')
    p.add_argument("--max-new-tokens", type=number(int, lambda v: v >= 1, "must be >= 1"), default=128,
                   help="new tokens per prompt at most (default: %(default)s)")
    p.add_argument("--temperature", type=number(float, lambda v: v >= 0 and math.isfinite(v), "must be >= 0"),
                   default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=number(int, lambda v: v >= 0, "must be >= 0"), default=0,
                   help="sample from the k most likely tokens; 0 is off (default)")
    p.add_argument("--top-p", type=number(float, lambda v: 0 < v <= 1, "must lie in (0, 1]"), default=1.0,
                   help="nucleus sampling mass; 1 is off (default)")
    p.add_argument("--repetition-penalty", type=number(float, lambda v: 0 < v < math.inf, "must be > 0"),
                   default=1.0, help="as Hugging Face: divides (multiplies) the positive (negative) logits of "
                                     "tokens already in the prompt or output; 1 is off (default)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop a completion when it contains STR (repeatable; the completion ends before it)")
    p.add_argument("--stop-token", action="append", default=[], metavar="ID",
                   type=number(int, lambda v: v >= 0, "must be >= 0"),
                   help="stop at this token id (repeatable; default: the tokenizer's end-of-sequence id)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message: rendered with the chat template (maxlm/data/"
                        "chat_template.jinja, as SFT trained it) and answered as the assistant")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--seed", type=number(int, lambda v: 0 <= v < 2**32, "must lie in [0, 2**32)"), default=0,
                   help="random seed of the sampling, in [0, 2**32) (default: %(default)s)")
    p.add_argument("--tensor", type=number(int, lambda v: v >= 1, "must be >= 1"), default=1,
                   help="devices on the tensor axis (heads and MLP split across them; default: 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--step", type=number(int, lambda v: v >= 0, "must be >= 0"),
                   help="the checkpoint step of a run directory (default: the newest good one)")
    p.add_argument("--no-stream", action="store_true", help="print completions at the end, not as they come")
    p.add_argument("--out", metavar="FILE.jsonl", help="write the results as JSON lines")
    return p


def read_prompts(path: str) -> list[tuple[str, str]]:
    """(label "FILE:LINE", prompt) for each non-blank line of a JSONL prompts file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: --prompts file does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{path}: --prompts is a directory, not a JSONL file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the --prompts file ({err})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise UserError(f'{where}: expected an object with a "prompt" field, got {line.strip()[:60]}')
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise UserError(f'{where}: field "prompt" must be a non-empty string, got {row["prompt"]!r:.60}')
        prompts.append((where, row["prompt"]))
    if not prompts:
        raise UserError(f"{path}: --prompts file holds no prompts")
    return prompts


def _check_out(path: str | None) -> None:
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise UserError(f"{path}: --out is a directory, not a file")
    if not out.parent.resolve().is_dir():
        raise UserError(f"{path}: --out's directory {out.parent} does not exist")


def _write_jsonl(path: str, rows: list[dict]) -> None:
    """Written beside the target and renamed, so an interrupted run leaves no half file."""
    out = Path(path)
    fd, tmp = tempfile.mkstemp(dir=out.parent.resolve(), prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def generate(args: argparse.Namespace) -> int:
    if args.prompt is not None:
        prompts = [(f"--prompt {i}", text) for i, text in enumerate(args.prompt, 1)]
        if any(not text for _, text in prompts):
            raise UserError(f"{next(w for w, t in prompts if not t)}: the prompt is empty")
    else:
        prompts = read_prompts(args.prompts)
    if any(not s for s in args.stop):
        raise UserError("--stop: a stop string must not be empty")
    _check_out(args.out)

    from maxlm.infer import generate as gen
    from maxlm.hf.load import LoadError, load_model
    from maxlm.infer.sampling import SamplingParams

    try:
        loaded = load_model(args.checkpoint, step=args.step, dtype=args.dtype, tensor=args.tensor,
                            adapter=args.adapter)
    except LoadError as err:
        raise UserError(str(err)) from None
    tok, cfg = loaded.tokenizer, loaded.cfg
    if tok is None:
        raise UserError(f"{args.checkpoint}: has no tokenizer (tokenizer.json), so text prompts cannot be encoded")
    for t in args.stop_token:
        if t >= cfg.vocab_size:
            raise UserError(f"--stop-token {t}: not a token id of this model (vocab_size = {cfg.vocab_size})")
    stop_tokens = list(args.stop_token)
    if not stop_tokens and not args.ignore_eos and getattr(tok, "eos_id", None) is not None:
        stop_tokens = [tok.eos_id]
    if args.chat:
        from maxlm.data import chat

        ids = [chat.encode_prompt(tok, [{"role": "user", "content": text}]) for _, text in prompts]
    else:
        ids = [tok.encode(text, add_eos=False) for _, text in prompts]
    for (where, _), p in zip(prompts, ids):  # before anything is printed
        if len(p) >= cfg.max_seq_len:
            raise UserError(f"{where}: prompt has {len(p)} tokens; the context (ModelConfig.max_seq_len = "
                            f"{cfg.max_seq_len}) leaves room for at most {cfg.max_seq_len - 1}")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    labels = [f"[{i}] {text}" for i, (_, text) in enumerate(prompts, 1)] if len(prompts) > 1 else [""]
    stream = None
    if not args.no_stream:
        if len(prompts) == 1:
            print(prompts[0][1], end="", flush=True)
        stream = gen.TerminalStream(labels, args.stop)
    try:
        result = gen.run(cfg, loaded.params, ids, args.max_new_tokens, sampling=sampling, stop_tokens=stop_tokens,
                         stop_strings=args.stop, tokenizer=tok, seed=args.seed, mesh=loaded.mesh,
                         on_progress=stream)
    except gen.PromptError as err:
        raise UserError(f"{prompts[err.index][0]}: {err}") from None
    texts = result.texts
    if args.chat:  # the reply as the template reads it back (without its closing newline)
        texts = [chat.read_reply(t) for t in texts]
    if args.no_stream:
        for label, (_, text), completion in zip(labels, prompts, texts):
            print(f"{label or text}{completion}")
    if args.out:
        _write_jsonl(args.out, [dict(prompt=text, completion=completion, tokens=[int(t) for t in new],
                                     finish_reason=finish)
                                for (_, text), completion, new, finish in
                                zip(prompts, texts, result.tokens, result.finish)])
    print(result.summary() + f"; from {loaded.source}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return generate(args)
    except UserError as err:
        print(f"maxlm.generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
