"""Supervised fine-tuning data: instruction or chat JSONL -> cleaned, templated, masked, packed rows.

Input, one JSON object per line, in either format (``SFTConfig.format``; ``auto`` tells them apart
line by line):

    instruction   {"instruction": "...", "input": "... (optional)", "output": "..."}
    chat          {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}

or ``synthetic:TASK[:N]``, N generated examples of a deterministic string task (``reverse``,
``upper``, ``sort``, ``capitalize``: a base model cannot do them, SFT teaches them; the tests and
configs/sft_tiny.gin use it), or a mixture ``synthetic:reverse+capitalize:N`` (N in all, the
tasks taking turns). An instruction is a chat of one user turn and one assistant turn
(``chat.instruction_messages``), so both formats go through the one chat template.

Stages, each counted in the report (``load`` returns it; the run prints ``summary``):

    read         a line that is not JSON, not an object, lacks a field, has a non-list ``messages``, a
                 message without role/content strings, an unknown role, or no assistant turn: dropped
                 and listed with FILE:LINE
    normalise    ``maxlm.data.clean.normalise`` on every message (Unicode NFC, control characters,
                 whitespace), as for pre-training documents
    empty_reply  an assistant turn empty after normalising: dropped, listed with FILE:LINE
    short_reply  an assistant turn shorter than ``SFTConfig.min_reply_chars``: dropped (counted)
    quality      ``maxlm.data.quality`` with ``SFTConfig.quality``'s preset, on each reply
    exact_dedup  the same conversation again (after normalising): dropped
    near_dedup   MinHash near-duplicates of the conversation (``maxlm.data.dedup``), when on
    pii          e-mails, phones, IDs ... replaced by placeholders in every message, when on
    too_long     a prompt, or the whole example, longer than TrainConfig.seq_len tokens: dropped,
                 listed with FILE:LINE (an example is never cut: its reply would lose its end)

The kept examples are tokenized by ``chat.encode_chat`` (mask 1 on exactly the reply tokens and
their eos), shuffled, repeated and packed whole into rows by Grain's first-fit packer, with segment
ids and positions; ``weights`` then cover exactly the targets that are reply tokens of the same
example. The batch is ``maxlm.train.tasks.LM_BATCH``, so SFT's loss is pre-training's
cross-entropy under another mask.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import hashlib
import json
import os
import random
import string
from typing import Any, Iterator

import grain
import numpy as np

from maxlm.data import chat, clean, dedup, pii, quality
from maxlm.data.pipeline import DataIterator, _grain_seed, features
from maxlm.data.tokenizer import Tokenizer
from maxlm.storage import local_input

FORMATS = ("auto", "instruction", "chat")
SYNTHETIC = ("reverse", "upper", "sort", "capitalize")
_SHOWN = 20  # bad lines listed by FILE:LINE in the summary (all are in the report)


class SFTDataError(ValueError):
    """Unusable SFT data as a whole (no file, nothing left); str(err) is one line."""


@dataclasses.dataclass
class Example:
    messages: list[dict[str, str]]
    where: str  # FILE:LINE, or synthetic:TASK#I


@dataclasses.dataclass
class Report:
    """What happened to every input line: ``used`` + sum(``dropped``) == ``lines``."""

    lines: int = 0
    used: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bad_lines: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (FILE:LINE, reason)
    fixed: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def drop(self, reason: str, where: str | None = None, detail: str = "") -> None:
        self.dropped[reason] += 1
        if where is not None:
            self.bad_lines.append((where, f"{reason}: {detail}" if detail else reason))

    def summary(self, name: str = "SFT data") -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        text = f"{name}: {self.used} of {self.lines} examples used; dropped: {drops}"
        if self.bad_lines:
            shown = "; ".join(f"{w} ({r})" for w, r in self.bad_lines[:_SHOWN])
            more = f"; and {len(self.bad_lines) - _SHOWN} more" if len(self.bad_lines) > _SHOWN else ""
            text += f"\n  bad lines: {shown}{more}"
        return text

    def to_dict(self) -> dict:
        return {"lines": self.lines, "used": self.used, "dropped": dict(self.dropped),
                "bad_lines": [list(x) for x in self.bad_lines], "fixed": dict(self.fixed)}


# ---------------------------------------------------------------------------------------------
# Reading


def synthetic_answer(task: str, word: str) -> str:
    return {"reverse": word[::-1], "upper": word.upper(), "sort": "".join(sorted(word)),
            "capitalize": word.capitalize()}[task]


def synthetic_spec(spec: str, extra: str = "", error: type[SFTDataError] = SFTDataError) -> tuple[str, int, str | None]:
    """(TASK, N, the field after N or None) of ``synthetic:TASK[:N]``, N 2000 when left out; ``extra``
    names the one more field a reader takes (preference data's ``KINDS``). ``error`` (one line) when N
    is not a number or more fields follow than the reader takes."""
    _, task, *rest = spec.split(":")
    if len(rest) > (2 if extra else 1) or (rest and not rest[0].isdigit()):
        raise error(f"{spec!r}: expected synthetic:TASK[:N{f'[:{extra}]' if extra else ''}], N a number")
    return task, int(rest[0]) if rest else 2000, rest[1] if len(rest) == 2 else None


def synthetic_examples(task: str, n: int, seed: int = 0, min_len: int = 3, max_len: int = 7) -> list[dict]:
    """n instruction records of a deterministic string task on random lowercase words; ``task``
    may be a mixture ``a+b`` (the tasks take turns, each with its own words)."""
    tasks = task.split("+")
    unknown = [t for t in tasks if t not in SYNTHETIC]
    if unknown:
        raise SFTDataError(f"unknown synthetic task {unknown[0]!r}; known: {', '.join(SYNTHETIC)} "
                           "(a mixture joins them with +)")
    rngs = {t: random.Random(f"{t}/{seed}") for t in tasks}
    verb = {"reverse": "Reverse", "upper": "Uppercase", "sort": "Sort the letters of", "capitalize": "Capitalize"}
    out = []
    for i in range(n):
        t = tasks[i % len(tasks)]
        rng = rngs[t]
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        out.append({"instruction": f"{verb[t]} the word.", "input": word, "output": synthetic_answer(t, word)})
    return out


def _messages_of(record: Any, fmt: str) -> tuple[list[dict] | None, str]:
    """(messages, "") or (None, why the record is bad)."""
    if not isinstance(record, dict):
        return None, f"not a JSON object ({type(record).__name__})"
    if fmt == "auto":
        fmt = "chat" if "messages" in record else "instruction"
    if fmt == "chat":
        messages = record.get("messages")
        if messages is None:
            return None, "missing field 'messages'"
        if not isinstance(messages, list):
            return None, f"'messages' is a {type(messages).__name__}, not a list"
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None, f"messages[{i}] is not an object with string 'role' and 'content'"
            if m["role"] not in chat.ROLES:
                return None, f"messages[{i}] has role {m['role']!r} (not one of {', '.join(chat.ROLES)})"
        if not any(m["role"] == "assistant" for m in messages):
            return None, "no assistant message"
        return [{"role": m["role"], "content": m["content"]} for m in messages], ""
    for field in ("instruction", "output"):
        if field not in record:
            return None, f"missing field {field!r}"
        if not isinstance(record[field], str):
            return None, f"{field!r} is a {type(record[field]).__name__}, not a string"
    extra = record.get("input", "")
    if not isinstance(extra, str):
        return None, f"'input' is a {type(extra).__name__}, not a string"
    if not record["instruction"].strip():
        return None, "empty 'instruction'"
    return chat.instruction_messages(record["instruction"], extra, record["output"]), ""


def _files(spec: str) -> list[str]:
    paths: list[str] = []
    for part in [p.strip() for p in spec.split(";") if p.strip()]:
        found = sorted(glob.glob(local_input(part), recursive=True))
        if not found:
            raise SFTDataError(f"no file matches {part!r}")
        paths += [p for p in found if os.path.isfile(p)]
    return paths


def json_records(spec: str, report: Report) -> Iterator[tuple[str, Any]]:
    """(FILE:LINE, parsed JSON) of every line of the JSONL files ``spec`` names (globs,
    ';'-separated), each counted in ``report``; empty and non-JSON lines are dropped there."""
    for path in _files(spec):
        try:
            with open(path, "rb") as f:
                raw_lines = f.read().split(b"\n")
        except OSError as err:
            raise SFTDataError(f"{path}: cannot read it ({err.strerror})") from None
        if raw_lines and raw_lines[-1] == b"":
            raw_lines.pop()
        for n, raw in enumerate(raw_lines, 1):
            where = f"{path}:{n}"
            report.lines += 1
            if not raw.strip():
                report.drop("bad_line", where, "empty line")
                continue
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as err:
                report.drop("bad_line", where, f"not JSON ({' '.join(str(err).split())[:80]})")


def read(spec: str, fmt: str = "auto", report: Report | None = None) -> tuple[list[Example], Report]:
    """Parse every line of the JSONL files ``spec`` names (globs, ';'-separated) or a synthetic
    task; bad lines are counted and listed in the report, never raised."""
    if fmt not in FORMATS:
        raise SFTDataError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    report = report or Report()
    examples: list[Example] = []
    if spec.startswith("synthetic:"):
        task, n, _ = synthetic_spec(spec)
        for i, rec in enumerate(synthetic_examples(task, n)):
            report.lines += 1
            examples.append(Example(_messages_of(rec, "instruction")[0], f"{spec}#{i}"))
        return examples, report
    for where, record in json_records(spec, report):
        messages, why = _messages_of(record, fmt)
        if messages is None:
            report.drop("bad_line", where, why)
            continue
        examples.append(Example(messages, where))
    return examples, report


# ---------------------------------------------------------------------------------------------
# Cleaning and tokenizing


@dataclasses.dataclass(frozen=True)
class Options:
    """The SFT data rules (``maxlm.config.SFTConfig`` carries them from a config)."""

    format: str = "auto"
    min_reply_chars: int = 1
    normalise: bool = True
    quality: str = "none"  # a maxlm.data.quality preset judged on each reply
    exact_dedup: bool = True
    near_dedup: bool = False
    near_threshold: float = 0.8
    pii: bool = False

    @classmethod
    def of(cls, sft_cfg: Any) -> "Options":
        return cls(**{f.name: getattr(sft_cfg, f.name) for f in dataclasses.fields(cls)})


def clean_examples(examples: list[Example], opts: Options, report: Report) -> list[Example]:
    """The cleaning stages of ``maxlm.data.clean`` applied to conversations (module docstring)."""
    judge = quality.PRESETS[opts.quality]
    seen: set[bytes] = set()
    near = dedup.NearDedup(opts.near_threshold) if opts.near_dedup else None
    kept = []
    for ex in examples:
        messages = ex.messages
        if opts.normalise:
            messages = []
            for m in ex.messages:
                text, stats = clean.normalise(m["content"])
                report.fixed.update(stats)
                messages.append({**m, "content": text})
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if any(not r.strip() for r in replies):
            report.drop("empty_reply", ex.where, "an assistant reply is empty")
            continue
        if any(len(r) < opts.min_reply_chars for r in replies):
            report.drop("short_reply")
            continue
        if opts.quality != "none":
            reasons = [quality.check(r, judge)[1] for r in replies]
            if any(reasons):
                report.drop(f"quality_{next(r for r in reasons if r)}")
                continue
        whole = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)
        if opts.exact_dedup:
            key = dedup.exact_key(whole)
            if key in seen:
                report.drop("exact_dup")
                continue
            seen.add(key)
        if near is not None and near.add(ex.where, near.signature(whole))[0] is not None:
            report.drop("near_dup")
            continue
        if opts.pii:
            scrubbed = []
            for m in messages:
                text, counts = pii.scrub(m["content"])
                report.fixed.update({f"pii_{k}": v for k, v in counts.items()})
                scrubbed.append({**m, "content": text})
            messages = scrubbed
        kept.append(Example(messages, ex.where))
    return kept


def tokenize(examples: list[Example], tokenizer: Tokenizer, seq_len: int,
             report: Report) -> tuple[list[dict], list[Example]]:
    """({"inputs": ids, "mask": reply mask} per example that fits in ``seq_len`` tokens, those examples)."""
    out, kept = [], []
    for ex in examples:
        try:
            ids, mask = chat.encode_chat(tokenizer, ex.messages)
        except chat.ChatError as err:
            report.drop("bad_line", ex.where, str(err))
            continue
        if ids.size > seq_len:
            first_reply = int(np.argmax(mask))
            part = "prompt" if first_reply >= seq_len else "example"
            report.drop("too_long", ex.where, f"{part} of {first_reply if part == 'prompt' else ids.size} "
                                              f"tokens > TrainConfig.seq_len = {seq_len}")
            continue
        out.append({"inputs": ids, "mask": mask})
        kept.append(ex)
    report.used = len(out)
    return out, kept


def _held_out(ex: Example, fraction: float) -> bool:
    """A stable split by the conversation's text (not its position), as for raw documents."""
    text = json.dumps(ex.messages, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2**64 < fraction


@dataclasses.dataclass
class SFTData:
    """The examples of one run, tokenized: train and eval, with what was dropped."""

    train: list[dict]
    eval: list[dict]
    eval_examples: list[Example]  # the held-out conversations, for exact-match generation
    report: Report
    eval_report: Report | None
    digest: str  # identifies the training examples (for the data-state fingerprint)


def load(data: str, eval_data: str, eval_fraction: float, opts: Options, tokenizer: Tokenizer,
         seq_len: int) -> SFTData:
    """Read, clean, split (``eval_data``, else ``eval_fraction`` of ``data`` by hash) and tokenize."""
    examples, report = read(data, opts.format)
    examples = clean_examples(examples, opts, report)
    eval_report = None
    if eval_data:
        held, eval_report = read(eval_data, opts.format)
        held = clean_examples(held, opts, eval_report)
    else:
        held = [ex for ex in examples if _held_out(ex, eval_fraction)]
        examples = [ex for ex in examples if not _held_out(ex, eval_fraction)]
    train, _ = tokenize(examples, tokenizer, seq_len, report)
    held_report = eval_report or Report()
    eval_rows, held = tokenize(held, tokenizer, seq_len, held_report)
    if eval_report is None:  # the held-out examples came out of ``data``: count them as used
        report.used += len(eval_rows)
        for reason, n in held_report.dropped.items():
            report.dropped[reason] += n
        report.bad_lines += held_report.bad_lines
    if not train:
        raise SFTDataError(f"{data!r}: no usable training example ({report.summary().splitlines()[0]})")
    digest = hashlib.sha256(b"".join(r["inputs"].tobytes() + r["mask"].tobytes() for r in train)).hexdigest()[:16]
    return SFTData(train, eval_rows, held, report, eval_report, digest)


# ---------------------------------------------------------------------------------------------
# Packing and batches


def _row(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """LM features of one packed row; a target carries weight only if it is a reply token of the
    same example as its input."""
    row = features(packed["inputs"], packed["inputs_segment_ids"], packed["inputs_positions"], pad_id)
    reply = np.zeros_like(row["weights"])
    reply[:-1] = packed["mask"][1:]
    row["weights"] = row["weights"] * reply
    return row


def packed_rows(examples: list[dict], seq_len: int, pad_id: int, *, seed: int, train: bool,
                bins: int = 8) -> grain.IterDataset:
    """Examples packed whole into rows of seq_len (first fit over ``bins`` open rows)."""
    ds = grain.MapDataset.source(examples)
    ds = ds.shuffle(seed=seed).repeat() if train else ds
    packed = grain.experimental.FirstFitPackIterDataset(
        ds.to_iter_dataset(), length_struct={"inputs": seq_len, "mask": seq_len},
        num_packing_bins=bins, seed=seed, shuffle_bins=train)
    return packed.map(functools.partial(_row, pad_id=pad_id))


def train_iterator(data: SFTData, tokenizer: Tokenizer, *, seq_len: int, global_batch: int, seed: int,
                   bins: int = 8, prefetch: int = 2, process_index: int = 0, process_count: int = 1) -> DataIterator:
    """Endless batches of this process's rows; checkpointable (get_state / set_state)."""
    rows = global_batch // process_count
    mine = data.train[process_index::process_count]
    if not mine:
        raise SFTDataError(f"{len(data.train)} training example(s) cannot give each of {process_count} processes one")
    ds = packed_rows(mine, seq_len, tokenizer.pad_id, seed=_grain_seed(seed), train=True, bins=bins)
    identity = {"SFTConfig.data": data.digest, "DataConfig.tokenizer": tokenizer.fingerprint, "seed": seed,
                "SFTConfig.packing_bins": bins, "TrainConfig.seq_len": seq_len,
                "TrainConfig.global_batch": global_batch, "process_count": process_count,
                "process_index": process_index}
    ds = ds.batch(rows, drop_remainder=True)
    if prefetch > 0:  # pack the next batches while the step runs, as pre-training's pipeline does
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return DataIterator(iter(ds), identity)


def eval_batches(data: SFTData, tokenizer: Tokenizer, *, seq_len: int, global_batch: int, num_batches: int,
                 bins: int = 8, process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """Up to ``num_batches`` batches of the held-out examples, packed once, in order (the last one
    padded with empty rows, which carry no weight)."""
    rows = global_batch // process_count
    mine = data.eval[process_index::process_count]
    if not mine:
        return []
    packed = list(packed_rows(mine, seq_len, tokenizer.pad_id, seed=0, train=False, bins=bins))
    packed = packed[:rows * num_batches]
    empty = {k: np.full_like(v, tokenizer.pad_id if k in ('inputs', 'targets') else 0)
             for k, v in packed[0].items()}
    packed += [empty] * (-len(packed) % rows)
    return [{k: np.stack([r[k] for r in packed[i:i + rows]]) for k in packed[0]}
            for i in range(0, len(packed), rows)]
