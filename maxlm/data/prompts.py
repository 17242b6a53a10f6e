"""Prompts with verifiable answers (RL from rewards: ``maxlm.posttrain.grpo``).

One JSON object per line, a prompt (a string, one user turn, or a list of chat messages ending
with a user or system turn) and the answer a verifier compares replies with:

    {"prompt": "What is 3 + 4?", "answer": "7"}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}], "answer": "..."}

or ``synthetic:TASK[:N]`` (SFT's string tasks, ``maxlm.data.sft``: the instruction as the prompt,
the transformation of the word as the answer). Bad lines (not JSON, a missing or ill-typed field, a
prompt ending in an assistant turn) are dropped and listed with FILE:LINE; prompts whose tokens
and ``max_new_tokens`` do not fit ``TrainConfig.seq_len`` are dropped as ``too_long``; repeated
prompts as ``exact_dup``. Held-out prompts (``eval_fraction``, by a hash of the prompt) measure the
reward before and after training.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import grain
import numpy as np

from maxlm.data import chat
from maxlm.data.pipeline import DataIterator, _grain_seed
from maxlm.data.preference import _messages
from maxlm.data.sft import Example, Report, SFTDataError, _held_out, json_records, synthetic_examples, synthetic_spec
from maxlm.data.tokenizer import Tokenizer


class PromptDataError(SFTDataError):
    """Unusable prompt data as a whole (no file, nothing left); str(err) is one line."""


@dataclasses.dataclass
class Prompt:
    messages: list[dict[str, str]]  # the conversation to reply to
    answer: str  # what the verifier compares a reply with
    where: str  # FILE:LINE, or synthetic:TASK#I
    ids: np.ndarray | None = None  # the prompt's tokens through the chat template


def prompt_of(record: Any, where: str) -> tuple[Prompt | None, str]:
    if not isinstance(record, dict):
        return None, f"not a JSON object ({type(record).__name__})"
    for field in ("prompt", "answer"):
        if field not in record:
            return None, f"missing field {field!r}"
    messages, why = _messages(record["prompt"], "prompt", "user")
    if messages is None:
        return None, why
    if not messages or messages[-1]["role"] == "assistant":
        return None, "'prompt' is empty or ends with an assistant turn: nothing is left to reply to"
    if not isinstance(record["answer"], str):
        return None, f"'answer' is a {type(record['answer']).__name__}, not a string"
    return Prompt(messages, record["answer"], where), ""


def read(spec: str, report: Report | None = None) -> tuple[list[Prompt], Report]:
    """Every prompt of the JSONL files ``spec`` names (globs, ';'-separated) or of a synthetic task."""
    report = report or Report()
    if spec.startswith("synthetic:"):
        task, n, _ = synthetic_spec(spec, error=PromptDataError)
        out = []
        for i, rec in enumerate(synthetic_examples(task, n)):
            report.lines += 1
            out.append(Prompt(chat.instruction_messages(rec["instruction"], rec["input"]), rec["output"],
                              f"{spec}#{i}"))
        return out, report
    out = []
    for where, record in json_records(spec, report):
        prompt, why = prompt_of(record, where)
        if prompt is None:
            report.drop("bad_line", where, why)
            continue
        out.append(prompt)
    return out, report


@dataclasses.dataclass
class PromptData:
    train: list[Prompt]
    eval: list[Prompt]
    report: Report
    digest: str


def load(spec: str, eval_fraction: float, tokenizer: Tokenizer, seq_len: int, max_new_tokens: int) -> PromptData:
    """Read, tokenize through the chat template, drop what cannot fit, dedup and split."""
    prompts, report = read(spec)
    kept, seen = [], set()
    for p in prompts:
        p.ids = chat.encode_prompt(tokenizer, p.messages)
        if p.ids.size + max_new_tokens > seq_len:
            report.drop("too_long", p.where, f"{p.ids.size} prompt tokens + max_new_tokens {max_new_tokens} > "
                        f"TrainConfig.seq_len = {seq_len}")
            continue
        key = p.ids.tobytes()
        if key in seen:
            report.drop("exact_dup")
            continue
        seen.add(key)
        kept.append(p)
    report.used = len(kept)
    held = [_held_out(Example(p.messages, p.where), eval_fraction) for p in kept]
    train = [p for p, h in zip(kept, held) if not h]
    evals = [p for p, h in zip(kept, held) if h]
    if not train:
        raise PromptDataError(f"{spec!r}: no usable training prompt ({report.summary('prompts').splitlines()[0]})")
    digest = hashlib.sha256(b"".join(p.ids.tobytes() + p.answer.encode() for p in train)).hexdigest()[:16]
    return PromptData(train, evals, report, digest)


def index_iterator(data: PromptData, *, prompts_per_step: int, seed: int, process_index: int = 0,
                   process_count: int = 1) -> DataIterator:
    """Endless batches ``{"index": [prompts_per_step]}`` of shuffled training-prompt indices;
    checkpointable (get_state / set_state), so a resumed run draws the same prompts."""
    ds = grain.MapDataset.range(len(data.train)).shuffle(seed=_grain_seed(seed)).repeat()
    ds = ds[process_index::process_count] if process_count > 1 else ds
    ds = ds.map(lambda i: {"index": np.int32(i)}).to_iter_dataset().batch(prompts_per_step, drop_remainder=True)
    identity = {"GRPOConfig.prompts": data.digest, "seed": seed, "prompts_per_step": prompts_per_step,
                "process_count": process_count, "process_index": process_index}
    return DataIterator(iter(ds), identity)
