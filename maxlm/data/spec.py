"""Source specs and mixtures as written in ``DataConfig``, and the config checks the trainer calls.

One source is a string ``KIND:WHERE[:FIELD]``:

    stdlib                          the running interpreter's standard library (the default)
    files:GLOB                      text or code files, one document per file (``**`` recurses)
    jsonl:GLOB[:FIELD]              JSON Lines, one document per line, text in FIELD (default
                                    ``text``; ``meta.body`` reaches into nested objects)
    parquet:GLOB[:COLUMN]           Parquet files, one document per row (default column ``text``)
    packed:DIR                      shards written by ``python -m maxlm.data prepare``

A bare glob is read by its extension (``*.jsonl`` as JSONL, ``*.parquet`` as Parquet, anything else
as files); ``.gz`` and ``.zst`` files are decompressed as they are read (``*.jsonl.gz`` is JSONL).
Several sources separated by ``;`` (or new lines) form a mixture; ``DataConfig.weights`` gives
their sampling weights in the same order ("0.6, 0.2, 0.1, 0.1"), normalised to sum to 1:

    DataConfig.source = ("packed:data/packed/web; packed:data/packed/books; "
                         "packed:data/packed/code; stdlib")
    DataConfig.weights = "0.6, 0.2, 0.1, 0.1"

This module imports nothing heavy, so config validation can call ``check_config`` and
``check_vocab`` cheaply.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

KINDS = ("stdlib", "files", "jsonl", "parquet", "packed")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    kind: str  # one of KINDS
    path: str  # the glob or directory ("" for stdlib)
    field: str = "text"  # JSONL field or Parquet column
    text: str = ""  # as the user wrote it

    def __str__(self) -> str:
        return self.text or self.kind


def parse_source(text: str) -> SourceSpec:
    """One source spec -> SourceSpec; a ValueError (one line) names what is wrong."""
    raw = text.strip()
    if not raw:
        raise ValueError("DataConfig.source has an empty entry (sources are separated by ';')")
    if raw == "stdlib":
        return SourceSpec("stdlib", "", text=raw)
    kind, sep, rest = raw.partition(":")
    if sep and kind in KINDS and kind != "stdlib":
        if not rest:
            raise ValueError(f"DataConfig.source entry {raw!r} names no path after '{kind}:'")
        if kind in ("jsonl", "parquet"):
            head, sep2, tail = rest.rpartition(":")
            if sep2 and tail and "/" not in tail and not glob.has_magic(tail) and head:
                return SourceSpec(kind, head, tail, text=raw)
        return SourceSpec(kind, rest, text=raw)
    if sep and re.fullmatch(r"[a-z][a-z0-9]+", kind):
        raise ValueError(f"DataConfig.source entry {raw!r}: unknown kind {kind!r}; "
                         f"use one of {', '.join(k + ':' for k in KINDS if k != 'stdlib')} or stdlib")
    lower = raw.lower().removesuffix(".gz").removesuffix(".zst")  # compressed: read by what is inside
    if lower.endswith((".jsonl", ".ndjson")):
        return SourceSpec("jsonl", raw, text=raw)
    if lower.endswith(".parquet"):
        return SourceSpec("parquet", raw, text=raw)
    return SourceSpec("files", raw, text=raw)


def split_sources(source: str) -> list[str]:
    return [part.strip() for part in re.split(r"[;\n]", source) if part.strip()]


def parse_mixture(source: str, weights: str = "") -> list[tuple[SourceSpec, float]]:
    """``DataConfig.source`` and ``DataConfig.weights`` -> [(spec, weight)], weights summing to 1."""
    specs = [parse_source(part) for part in split_sources(source)]
    if not specs:
        raise ValueError("DataConfig.source is empty; use 'stdlib', a glob, or 'KIND:PATH' entries")
    if not weights.strip():
        values = [1.0] * len(specs)
    else:
        try:
            values = [float(w) for w in re.split(r"[,;\s]+", weights.strip()) if w]
        except ValueError:
            raise ValueError(f"DataConfig.weights = {weights!r} is not a list of numbers "
                             "(write e.g. '0.6, 0.2, 0.1, 0.1')") from None
        if len(values) != len(specs):
            raise ValueError(f"DataConfig.weights has {len(values)} value(s) but DataConfig.source "
                             f"has {len(specs)} source(s); give one weight per source")
        if any(not v > 0 for v in values):
            raise ValueError(f"DataConfig.weights = {weights!r}: every weight must be positive")
    total = sum(values)
    return [(spec, v / total) for spec, v in zip(specs, values)]


def check_config(data_cfg) -> None:
    """Reject an inconsistent DataConfig without reading any data; raises ValueError (one line).

    Call from ``maxlm.config.validate`` (cheap: parses strings only)."""
    mixture = parse_mixture(data_cfg.source, data_cfg.weights)
    seen = set()
    for spec, _ in mixture:
        if spec.text in seen:
            raise ValueError(f"DataConfig.source lists {spec.text!r} twice; raise its weight instead")
        seen.add(spec.text)
    if not 0.0 <= data_cfg.eval_fraction < 1.0:
        raise ValueError(f"DataConfig.eval_fraction = {data_cfg.eval_fraction} must lie in [0, 1)")
    if data_cfg.worker_count < 0 or data_cfg.prefetch < 0:
        raise ValueError(f"DataConfig.worker_count = {data_cfg.worker_count} and DataConfig.prefetch = "
                         f"{data_cfg.prefetch} must be >= 0")
    if data_cfg.max_doc_bytes < 1:
        raise ValueError(f"DataConfig.max_doc_bytes = {data_cfg.max_doc_bytes} must be positive")
    if data_cfg.read_threads < 1:
        raise ValueError(f"DataConfig.read_threads = {data_cfg.read_threads} must be at least 1")


def read_packed_index(directory: str) -> dict:
    """The index.json of a prepared directory; ValueError (one line) when it is missing or bad."""
    from maxlm.storage import local_input  # a bucket folder is read through the local cache

    path = os.path.join(local_input(directory), "index.json")
    try:
        with open(path) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"packed:{directory}: no index.json there (run `python -m maxlm.data prepare "
                         f"--out {directory} ...` first; an interrupted prepare leaves none)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"packed:{directory}: cannot read index.json ({err})") from None
    if index.get("format") != "maxlm-packed-v1":
        raise ValueError(f"packed:{directory}: index.json has format {index.get('format')!r}, "
                         "expected 'maxlm-packed-v1'")
    return index


def check_vocab(data_cfg, vocab_size: int) -> None:
    """Raise ValueError (one line) unless ModelConfig.vocab_size covers the tokenizer, and every
    packed source was tokenized with DataConfig.tokenizer. Loads the tokenizer (a file read)."""
    from maxlm.data.tokenizer import get_tokenizer

    tok = get_tokenizer(data_cfg.tokenizer)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"DataConfig.tokenizer = {data_cfg.tokenizer!r} has {tok.vocab_size} tokens "
                         f"but ModelConfig.vocab_size = {vocab_size}; set ModelConfig.vocab_size >= "
                         f"{tok.vocab_size}")
    for spec, _ in parse_mixture(data_cfg.source, data_cfg.weights):
        if spec.kind != "packed":
            continue
        meta = read_packed_index(spec.path)["tokenizer"]
        if meta["fingerprint"] != tok.fingerprint:
            raise ValueError(f"DataConfig.source entry {spec.text!r} was tokenized with "
                             f"{meta['name']!r} ({meta['fingerprint']}), but DataConfig.tokenizer = "
                             f"{data_cfg.tokenizer!r} ({tok.fingerprint}); use the same tokenizer or "
                             "re-run prepare")
        if meta["vocab_size"] > vocab_size:
            raise ValueError(f"DataConfig.source entry {spec.text!r} holds ids up to "
                             f"{meta['vocab_size'] - 1} but ModelConfig.vocab_size = {vocab_size}")
