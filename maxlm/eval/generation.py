"""Generation tasks (GSM8K style): greedy completion, then exact match of the final answer.

The prompt is lm-eval's gsm8k layout: ``"Question: " + question + "\\nAnswer:"``, after k shots of
``"Question: q\\nAnswer: a\\n\\n"`` (the first k other questions of the file). The completion is cut
at the first stop string (``"Question:"`` or a blank line) or the model's eos.

The final answer of a text (``extract_answer``) is the number after ``####`` when there is one
(GSM8K's reference format), else the last number in the text. Numbers are compared normalised:
commas and a leading ``$`` dropped, trailing zeros of decimals removed (``1,000.50`` == ``1000.5``).
``exact_match`` uses that rule; ``exact_match_strict`` counts only completions that write ``####``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from maxlm.eval.tasks import GenDoc, Task

STOP_STRINGS = ("Question:", "\n\n")
DEFAULT_NEW_TOKENS = 256
_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?"
_MARKED = re.compile(r"####\s*(" + _NUMBER + ")")


def normalize_number(text: str) -> str:
    raw = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(raw)
    except InvalidOperation:
        return raw
    if value == value.to_integral_value():
        return str(value.to_integral_value())
    return format(value.normalize(), "f")


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The final answer of a solution: the number after '####', else (unless strict) the last number."""
    marked = _MARKED.search(text)
    if marked:
        return normalize_number(marked.group(1))
    if strict:
        return None
    numbers = re.findall(_NUMBER, text)
    return normalize_number(numbers[-1]) if numbers else None


def prompt(doc: GenDoc, shots: list[GenDoc]) -> str:
    prefix = "".join(f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in shots)
    return prefix + f"Question: {doc.question}\nAnswer:"


def complete(cfg: Any, params: Any, tokenizer: Any, prompts: list[str], *, new_tokens: int,
             batch_size: int, mesh: Any = None, stop_strings: Sequence[str] = STOP_STRINGS) -> list[str]:
    """Greedy completions of text prompts: at most ``new_tokens`` tokens each (fewer where the
    context runs out), ended by eos or cut before the first of ``stop_strings``.

    A prompt longer than the context keeps its last ``max_seq_len - 1`` tokens (lm-eval keeps the
    end of a context as well); ``maxlm.infer.generate.run`` then gives each row the room it has left."""
    from maxlm.infer import generate

    keep = cfg.max_seq_len - 1
    encoded = [np.asarray(tokenizer.encode(p, add_bos=True, add_eos=False), np.int32)[-keep:] for p in prompts]
    texts: list[str] = []
    for start in range(0, len(encoded), batch_size):
        out = generate.run(cfg, params, encoded[start:start + batch_size], new_tokens,
                           stop_strings=tuple(stop_strings), stop_tokens=[tokenizer.eos_id], tokenizer=tokenizer,
                           mesh=mesh)
        for tokens, finish, text in zip(out.tokens, out.finish, out.texts):
            # A row ended by eos holds the eos token: its text is the tokens before it.
            texts.append(tokenizer.decode(tokens[:-1]) if finish == "stop_token" else text)
    return texts


def evaluate(task: Task, cfg: Any, params: Any, tokenizer: Any, *, shots: int = 0, limit: int | None = None,
             batch_size: int = 8, new_tokens: int = DEFAULT_NEW_TOKENS, mesh: Any = None) -> dict[str, Any]:
    asked = task.docs[:limit] if limit else task.docs
    prompts = []
    for doc in asked:
        others = [d for d in task.docs if d != doc]
        if len(others) < shots:
            raise ValueError(f"--shots {shots} needs {shots} other questions in the task file, which has {len(others)}")
        prompts.append(prompt(doc, others[:shots]))
    outputs = complete(cfg, params, tokenizer, prompts, new_tokens=new_tokens, batch_size=batch_size, mesh=mesh)
    samples = []
    for i, (doc, text, out) in enumerate(zip(asked, prompts, outputs)):
        gold = extract_answer(doc.answer)
        got, strict = extract_answer(out), extract_answer(out, strict=True)
        samples.append({"index": i, "prompt": text, "output": out, "gold": gold, "extracted": got,
                        "exact_match": float(got is not None and got == gold),
                        "exact_match_strict": float(strict is not None and strict == gold)})
    metrics = {key: float(np.mean([s[key] for s in samples])) for key in ("exact_match", "exact_match_strict")}
    metrics["questions"] = len(samples)
    return {"metrics": metrics, "samples": samples}
