"""Preference data (DPO, reward models): JSONL pairs -> cleaned, templated, masked pair rows.

One JSON object per line, TRL's preference format, plain or conversational:

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [{"role": "assistant", ...}]}

A plain ``prompt`` is one user turn; a plain reply is one assistant turn; a list of messages is
taken as it is (the prompt may hold a whole conversation, system turn and earlier replies
included). Both sequences of a pair are ``prompt + reply`` rendered through the ONE chat template
(``maxlm.data.chat.encode_chat``): they share the prompt's tokens exactly, and their weights cover
exactly the tokens of the pair's own reply (its text, the template's closing newline and eos; the
prompt's earlier assistant turns carry none), as SFT's mask does.

Or ``synthetic:TASK[:N[:KINDS]]`` (TASK as ``maxlm.data.sft``'s: reverse, upper, sort, capitalize,
or a mixture ``a+b``): the SFT task's instruction as the prompt, the correct transformation chosen,
and a wrong one rejected, the ``KINDS`` (``+``-joined, default all of ``WRONG``) in turn: the word
unchanged, the right answer reversed, one letter of it replaced, one letter dropped, or (``other``,
mixtures only) the answer another task of the mixture gives. Generations that follow the rule more
often are measured by exact match through maxlm's generation. The kinds differ in what a judge must
compare: ``unchanged``, ``dropped`` and ``other`` show in the reply's case, length and the prompt's
instruction; ``reversed`` and ``substituted`` only letter by letter against the prompt's word.

Stages, each counted in the report (``maxlm.data.sft.Report``; ``summary`` prints it):

    read         not JSON, not an object, a missing or non-string/non-list field, a message without
                 role/content strings or with an unknown role, a prompt ending in an assistant turn, a
                 reply without an assistant turn: dropped and listed with FILE:LINE
    normalise    ``maxlm.data.clean.normalise`` on every message, as for SFT
    empty_reply  a chosen or rejected reply empty after normalising: dropped, FILE:LINE
    same_reply   chosen == rejected: nothing to prefer, dropped, FILE:LINE
    exact_dup    the same pair again: dropped
    too_long     the prompt plus either reply longer than TrainConfig.seq_len tokens: dropped,
                 FILE:LINE (a reply is never cut)

Rows are not packed: each pair is one row of ``seq_len`` tokens per side (``PAIR_BATCH`` in
``maxlm.posttrain.dpo``), so the sequence log-probs are plain masked sums.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any

import grain
import numpy as np

from maxlm.data import chat, clean, dedup
from maxlm.data.pipeline import DataIterator, _grain_seed
from maxlm.data.sft import (Report, SFTDataError, _held_out, json_records, synthetic_answer, synthetic_examples,
                            synthetic_spec)
from maxlm.data.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")
WRONG = ("unchanged", "reversed", "substituted", "dropped")  # the synthetic rejected replies, in turn
KINDS = WRONG + ("other",)  # "other": another task's answer (mixtures only)


class PreferenceDataError(SFTDataError):
    """Unusable preference data as a whole (no file, nothing left); str(err) is one line."""


@dataclasses.dataclass
class Pair:
    prompt: list[dict[str, str]]  # the conversation up to the replies (ends with a user/system turn)
    chosen: list[dict[str, str]]  # the preferred reply's messages (at least one assistant turn)
    rejected: list[dict[str, str]]
    where: str  # FILE:LINE, or synthetic:TASK#I

    def messages(self, side: str) -> list[dict[str, str]]:
        return self.prompt + getattr(self, side)


# ---------------------------------------------------------------------------------------------
# Reading


def wrong_answer(task: str, word: str, kind: str, rng: random.Random, others: tuple[str, ...] = ()) -> str:
    """A reply that breaks the rule of ``task`` on ``word`` (never the right one); ``others``: the
    mixture's other tasks, whose answers ``kind`` "other" gives."""
    right = synthetic_answer(task, word)
    if kind == "other":
        wrong = [a for a in (synthetic_answer(t, word) for t in others) if a != right]
        if wrong:
            return rng.choice(wrong)
    if kind == "unchanged" and word != right:
        return word
    if kind == "reversed" and right[::-1] != right:
        return right[::-1]
    if kind == "dropped":
        i = rng.randrange(len(right))
        return right[:i] + right[i + 1:]
    i = rng.randrange(len(right))  # substituted (and the fallback of the others)
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in (right[i].lower(), right[i].upper())]
    new = rng.choice(letters)
    return right[:i] + (new.upper() if right[i].isupper() else new) + right[i + 1:]


def synthetic_pairs(task: str, n: int, seed: int = 0, kinds: tuple[str, ...] = WRONG) -> list[dict]:
    """n preference records: SFT's synthetic instruction, the right answer chosen, a wrong one
    (``kinds``, in turn) rejected."""
    rng = random.Random(f"preference/{task}/{seed}")
    tasks = task.split("+")
    out = []
    for i, rec in enumerate(synthetic_examples(task, n, seed)):
        t = tasks[i % len(tasks)]
        kind = kinds[(i // len(tasks)) % len(kinds)]
        out.append({"prompt": f"{rec['instruction']}\n\n{rec['input']}", "chosen": rec["output"],
                    "rejected": wrong_answer(t, rec["input"], kind, rng, tuple(x for x in tasks if x != t))})
    return out


def synthetic_pair_spec(spec: str) -> tuple[str, int, tuple[str, ...]]:
    """(task, n, kinds) of ``synthetic:TASK[:N[:KINDS]]``; PreferenceDataError (one line) when bad."""
    task, n, field = synthetic_spec(spec, "KINDS", PreferenceDataError)
    kinds = WRONG if field is None else tuple(field.split("+"))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise PreferenceDataError(f"{spec!r}: unknown kind of wrong reply {unknown[0]!r}; known: {', '.join(KINDS)}")
    if "other" in kinds and "+" not in task:
        raise PreferenceDataError(f"{spec!r}: the kind 'other' needs a mixture of tasks (a+b), whose answers it swaps")
    return task, n, kinds


def _messages(value: Any, name: str, default_role: str) -> tuple[list[dict] | None, str]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}], ""
    if not isinstance(value, list):
        return None, f"{name!r} is a {type(value).__name__}, not a string or a list of messages"
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None, f"{name}[{i}] is not an object with string 'role' and 'content'"
        if m["role"] not in chat.ROLES:
            return None, f"{name}[{i}] has role {m['role']!r} (not one of {', '.join(chat.ROLES)})"
    return [{"role": m["role"], "content": m["content"]} for m in value], ""


def pair_of(record: Any, where: str) -> tuple[Pair | None, str]:
    """(Pair, "") or (None, why the record is bad)."""
    if not isinstance(record, dict):
        return None, f"not a JSON object ({type(record).__name__})"
    for field in ("prompt",) + SIDES:
        if field not in record:
            return None, f"missing field {field!r}"
    prompt, why = _messages(record["prompt"], "prompt", "user")
    if prompt is None:
        return None, why
    if not prompt:
        return None, "'prompt' is an empty list"
    if prompt[-1]["role"] == "assistant":
        return None, "'prompt' ends with an assistant turn: nothing is left to reply to"
    sides = {}
    for side in SIDES:
        msgs, why = _messages(record[side], side, "assistant")
        if msgs is None:
            return None, why
        if not any(m["role"] == "assistant" for m in msgs):
            return None, f"{side!r} has no assistant message"
        sides[side] = msgs
    return Pair(prompt, sides["chosen"], sides["rejected"], where), ""


def read(spec: str, report: Report | None = None) -> tuple[list[Pair], Report]:
    """Parse every line of the JSONL files ``spec`` names (globs, ';'-separated) or a synthetic
    task; bad lines are counted and listed in the report, never raised."""
    report = report or Report()
    pairs: list[Pair] = []
    if spec.startswith("synthetic:"):
        task, n, kinds = synthetic_pair_spec(spec)
        for i, rec in enumerate(synthetic_pairs(task, n, kinds=kinds)):
            report.lines += 1
            pairs.append(pair_of(rec, f"{spec}#{i}")[0])
        return pairs, report
    for where, record in json_records(spec, report):
        pair, why = pair_of(record, where)
        if pair is None:
            report.drop("bad_line", where, why)
            continue
        pairs.append(pair)
    return pairs, report


# ---------------------------------------------------------------------------------------------
# Cleaning and tokenizing


def clean_pairs(pairs: list[Pair], report: Report, normalise: bool = True) -> list[Pair]:
    seen: set[bytes] = set()
    kept = []
    for p in pairs:
        def norm(messages):
            if not normalise:
                return messages
            out = []
            for m in messages:
                text, stats = clean.normalise(m["content"])
                report.fixed.update(stats)
                out.append({**m, "content": text})
            return out
        p = Pair(norm(p.prompt), norm(p.chosen), norm(p.rejected), p.where)
        empty = [s for s in SIDES if any(not m["content"].strip() for m in getattr(p, s) if m["role"] == "assistant")]
        if empty:
            report.drop("empty_reply", p.where, f"the {empty[0]} reply is empty")
            continue
        if p.chosen == p.rejected:
            report.drop("same_reply", p.where, "chosen and rejected are the same")
            continue
        key = dedup.exact_key(json.dumps([p.prompt, p.chosen, p.rejected], sort_keys=True))
        if key in seen:
            report.drop("exact_dup")
            continue
        seen.add(key)
        kept.append(p)
    return kept


def encode_pair(tokenizer: Tokenizer, pair: Pair) -> dict[str, np.ndarray]:
    """{"chosen", "chosen_mask", "rejected", "rejected_mask"}: each side's ids through the chat
    template, its mask 1 on exactly that side's reply tokens (not on the shared prompt)."""
    prompt = chat.encode_prompt(tokenizer, pair.prompt)
    out = {}
    for side in SIDES:
        ids, mask = chat.encode_chat(tokenizer, pair.messages(side))
        if not np.array_equal(ids[:prompt.size], prompt):
            raise chat.ChatError("the template does not render the prompt as a prefix of the prompt with its reply")
        mask = mask.copy()
        mask[:prompt.size] = 0  # the prompt's own assistant turns (a conversation's history) are not the reply
        out[side], out[f"{side}_mask"] = ids, mask
    return out


def tokenize(pairs: list[Pair], tokenizer: Tokenizer, seq_len: int, report: Report) -> tuple[list[dict], list[Pair]]:
    out, kept = [], []
    for p in pairs:
        try:
            row = encode_pair(tokenizer, p)
        except chat.ChatError as err:
            report.drop("bad_line", p.where, str(err))
            continue
        longest = max(SIDES, key=lambda s: row[s].size)
        if row[longest].size > seq_len:
            report.drop("too_long", p.where, f"prompt + {longest} reply of {row[longest].size} tokens > "
                                             f"TrainConfig.seq_len = {seq_len}")
            continue
        out.append(row)
        kept.append(p)
    report.used += len(out)
    return out, kept


@dataclasses.dataclass
class PreferenceData:
    train: list[dict]
    eval: list[dict]
    eval_pairs: list[Pair]  # the held-out pairs, for generation (their prompt, the chosen reply wanted)
    report: Report
    eval_report: Report | None
    digest: str


def load(data: str, eval_data: str, eval_fraction: float, tokenizer: Tokenizer, seq_len: int,
         normalise: bool = True) -> PreferenceData:
    """Read, clean, split (``eval_data``, else ``eval_fraction`` of ``data`` by a hash of the prompt,
    so a prompt's pairs stay on one side) and tokenize."""
    pairs, report = read(data)
    pairs = clean_pairs(pairs, report, normalise)
    eval_report = None
    if eval_data:
        held, eval_report = read(eval_data)
        held = clean_pairs(held, eval_report, normalise)
    else:
        split = [_held_out(_Prompt(p.prompt), eval_fraction) for p in pairs]
        held = [p for p, h in zip(pairs, split) if h]
        pairs = [p for p, h in zip(pairs, split) if not h]
    train, _ = tokenize(pairs, tokenizer, seq_len, report)
    eval_rows, held = tokenize(held, tokenizer, seq_len, eval_report or report)
    if not train:
        raise PreferenceDataError(f"{data!r}: no usable training pair ({report.summary('preference data').splitlines()[0]})")
    digest = hashlib.sha256(b"".join(r[k].tobytes() for r in train for k in sorted(r))).hexdigest()[:16]
    return PreferenceData(train, eval_rows, held, report, eval_report, digest)


@dataclasses.dataclass
class _Prompt:  # what sft._held_out hashes
    messages: list


# ---------------------------------------------------------------------------------------------
# Rows and batches


def side_features(ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One side of a pair as a padded row: inputs, targets, positions, segment ids (1 on the
    sequence, 0 on padding) and weights, 1 where the target is a reply token."""
    n = ids.size
    inputs = np.full(seq_len, pad_id, np.int32)
    inputs[:n] = ids
    targets = np.full(seq_len, pad_id, np.int32)
    targets[:n - 1] = ids[1:]
    weights = np.zeros(seq_len, np.float32)
    weights[:n - 1] = mask[1:]
    segment_ids = np.zeros(seq_len, np.int32)
    segment_ids[:n] = 1
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
            "positions": np.arange(seq_len, dtype=np.int32), "weights": weights}


def pair_row(row: dict[str, np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """A pair as one batch row: ``chosen_*`` and ``rejected_*`` features side by side, and
    ``weights`` = 1 (0 on the padding rows of an eval batch), the pair's weight: the loss and the
    metrics are averaged over pairs."""
    out: dict[str, Any] = {"weights": np.float32(1.0)}
    for side in SIDES:
        for k, v in side_features(row[side], row[f"{side}_mask"], seq_len, pad_id).items():
            out[f"{side}_{k}"] = v
    for k in ("ref_chosen_logps", "ref_rejected_logps"):
        if k in row:
            out[k] = np.float32(row[k])
    return out


def train_iterator(data: PreferenceData, tokenizer: Tokenizer, *, seq_len: int, global_batch: int, seed: int,
                   prefetch: int = 2, process_index: int = 0, process_count: int = 1,
                   extra_identity: dict | None = None) -> DataIterator:
    """Endless shuffled batches of this process's pairs; checkpointable (get_state / set_state)."""
    rows = global_batch // process_count
    mine = data.train[process_index::process_count]
    if not mine:
        raise PreferenceDataError(f"{len(data.train)} training pair(s) cannot give each of {process_count} "
                                  "processes one")
    ds = grain.MapDataset.source(mine).shuffle(seed=_grain_seed(seed)).repeat()
    ds = ds.map(lambda r: pair_row(r, seq_len, tokenizer.pad_id)).to_iter_dataset().batch(rows, drop_remainder=True)
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    identity = {"DPOConfig.data": data.digest, "DataConfig.tokenizer": tokenizer.fingerprint, "seed": seed,
                "TrainConfig.seq_len": seq_len, "TrainConfig.global_batch": global_batch,
                "process_count": process_count, "process_index": process_index, **(extra_identity or {})}
    return DataIterator(iter(ds), identity)


def eval_batches(rows_in: list[dict], tokenizer: Tokenizer, *, seq_len: int, global_batch: int,
                 num_batches: int | None, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """Batches of held-out pairs in order (up to ``num_batches``; None: all), the last padded
    with empty rows (``weights`` = 0)."""
    rows = global_batch // process_count
    mine = rows_in[process_index::process_count]
    if num_batches is not None:
        mine = mine[:rows * num_batches]
    if not mine:
        return []
    feats = [pair_row(r, seq_len, tokenizer.pad_id) for r in mine]
    empty = {k: np.zeros_like(v) for k, v in feats[0].items()}
    feats += [empty] * (-len(feats) % rows)
    return [{k: np.stack([r[k] for r in feats[i:i + rows]]) for k in feats[0]} for i in range(0, len(feats), rows)]
