"""``python -m maxlm.data prepare SOURCE --tokenizer T --seq-len N --out DIR``: tokenise and pack.

Documents are tokenised (bos + text + eos), concatenated and cut into rows of exactly ``seq_len``
tokens (a document that does not fit continues in the next row as a new piece). Each row stores

    tokens     [rows, seq_len]  token ids (uint16 when the vocabulary fits, else uint32)
    segments   [rows, seq_len]  1, 2, 3 ... per document piece in the row; 0 for padding
    positions  [rows, seq_len]  position inside the piece, from 0

as ``.npy`` shards that training memory-maps (random access, no parsing, nothing in RAM). Only the
very last row of a split is padded. Documents are split train/eval by a hash of their id, as the
raw pipeline does. ``DIR/index.json`` lists the shards with their sha256, the tokenizer's
fingerprint and the counts; ``DIR/report.json`` has the bad input met on the way. ``DIR`` appears
whole or not at all: it is built in a hidden sibling, index.json last, then renamed into place
(maxlm.data.atomic), so an interrupted run leaves no ``DIR`` and training has nothing to misread.
Train on it with ``DataConfig.source = "packed:DIR"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
from tqdm import tqdm

from maxlm.data import atomic
from maxlm.data.sources import Problems, Utf8Tally, input_paths, open_source, split, utf8_summary
from maxlm.data.spec import read_packed_index
from maxlm.data.tokenizer import get_tokenizer
from maxlm.storage import local_input

FIELDS = ("tokens", "segments", "positions")


class Packer:
    """Concatenate-then-split packing into fixed rows, written as shards of ``rows_per_shard``."""

    def __init__(self, out_dir: str, name: str, seq_len: int, token_dtype, pad_id: int, rows_per_shard: int):
        self.out_dir, self.name, self.seq_len, self.pad_id = out_dir, name, seq_len, pad_id
        self.rows_per_shard = rows_per_shard
        self.index_dtype = np.uint16 if seq_len <= 65535 else np.uint32
        self.buf = {"tokens": np.zeros((rows_per_shard, seq_len), token_dtype),
                    "segments": np.zeros((rows_per_shard, seq_len), self.index_dtype),
                    "positions": np.zeros((rows_per_shard, seq_len), self.index_dtype)}
        self.row = 0  # row being filled, within the shard buffer
        self.fill = 0  # tokens already in that row
        self.segment = 0  # last segment id used in that row
        self.shards: list[dict] = []
        self.docs = self.tokens = self.pad_tokens = self.rows = 0

    def add(self, ids: np.ndarray) -> None:
        self.docs += 1
        self.tokens += len(ids)
        start = 0
        while start < len(ids):
            take = min(len(ids) - start, self.seq_len - self.fill)
            self.segment += 1
            end = self.fill + take
            self.buf["tokens"][self.row, self.fill:end] = ids[start:start + take]
            self.buf["segments"][self.row, self.fill:end] = self.segment
            self.buf["positions"][self.row, self.fill:end] = np.arange(take)
            self.fill, start = end, start + take
            if self.fill == self.seq_len:
                self._next_row()

    def _next_row(self) -> None:
        self.row += 1
        self.rows += 1
        self.fill = self.segment = 0
        if self.row == self.rows_per_shard:
            self._write(self.row)

    def _write(self, rows: int) -> None:
        stem = f"{self.name}-{len(self.shards):05d}"
        entry = {"name": stem, "rows": rows, "sha256": {}}
        for field in FIELDS:
            path = os.path.join(self.out_dir, f"{stem}.{field}.npy")
            np.save(path, self.buf[field][:rows])
            entry["sha256"][field] = atomic.file_sha256(path)
        self.shards.append(entry)
        self.row = 0

    def close(self) -> dict:
        if self.fill:  # the one padded row of the split
            pad = self.seq_len - self.fill
            self.buf["tokens"][self.row, self.fill:] = self.pad_id
            self.buf["segments"][self.row, self.fill:] = 0
            self.buf["positions"][self.row, self.fill:] = 0
            self.pad_tokens += pad
            self.row += 1
            self.rows += 1
            self.fill = 0
        if self.row:
            self._write(self.row)
        return {"rows": self.rows, "docs": self.docs, "tokens": self.tokens, "pad_tokens": self.pad_tokens,
                "shards": self.shards}


# Top-level names a prepared directory holds; an existing --out with anything else is never replaced.
OWNED = r"(train|eval)-\d{5}\.(tokens|segments|positions)\.npy|index\.json|report\.json"


def prepare(source: str, out_dir: str, tokenizer: str = "byte", seq_len: int = 2048, *,
            eval_fraction: float = 0.01, rows_per_shard: int = 0, max_doc_bytes: int = 32 << 20,
            limit: int = 0, batch_docs: int = 256, progress: bool = True, overwrite: bool = False) -> dict:
    """Tokenise and pack ``source`` into ``out_dir``; returns the report (also in report.json).

    The directory appears only when complete, index.json written last (maxlm.data.atomic); a
    finished one is replaced only with ``overwrite``; one that is, holds or lies inside an input
    (the source or the tokenizer file) is refused."""
    if seq_len < 2:
        raise ValueError(f"--seq-len = {seq_len} must be at least 2 (an input and its target)")
    inputs = input_paths(source) + ([] if tokenizer == "byte" else [("--tokenizer", tokenizer)])
    atomic.check_disjoint(out_dir, inputs)
    tok = get_tokenizer(tokenizer)
    src = open_source(source, max_doc_bytes)
    with atomic.Output(out_dir, "prepare", overwrite=overwrite, marker="index.json", owned=OWNED) as tmp:
        return _prepare_into(src, tok, tmp, out_dir, source=source, tokenizer=tokenizer, seq_len=seq_len,
                             eval_fraction=eval_fraction, rows_per_shard=rows_per_shard, limit=limit,
                             batch_docs=batch_docs, progress=progress)


def _pack(src, tok, tmp: str, *, source: str, seq_len: int, eval_fraction: float, rows_per_shard: int,
          limit: int, batch_docs: int, progress: bool):
    """Read, tokenise and pack every document into shards in ``tmp``: (packers, problems, utf8, n)."""
    n = min(len(src), limit) if limit else len(src)
    held = np.zeros(len(src), dtype=bool)
    if eval_fraction > 0 and len(src) >= 2:
        held[split(src, eval_fraction)[1].indices] = True
    token_dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    rows_per_shard = rows_per_shard or max(1, (1 << 26) // seq_len)  # ~64M tokens per shard
    packers = {name: Packer(tmp, name, seq_len, token_dtype, tok.pad_id, rows_per_shard)
               for name in ("train", "eval")}
    problems, utf8 = Problems(), Utf8Tally()
    bar = tqdm(total=n, desc=f"prepare {source}", unit="doc", disable=not progress, dynamic_ncols=True)
    pending: list[tuple[str, str]] = []

    def flush():
        for (name, _), ids in zip(pending, tok.encode_batch([t for _, t in pending])):
            packers[name].add(ids)
        pending.clear()

    for i in range(n):
        rec = src.read(i)
        if rec.problem:
            problems.add(rec.problem, rec.id, detail=rec.detail)
        else:
            utf8.add(rec)
            if rec.replaced:
                problems.add("invalid_utf8_docs", rec.id)
            pending.append(("eval" if held[i] else "train", rec.text))
            if len(pending) >= batch_docs:
                flush()
        if i % 256 == 255:
            bar.update(256)
            bar.set_postfix(rows=packers["train"].rows)
    flush()
    bar.update(n - bar.n)
    bar.close()
    return packers, problems, utf8, n


def _prepare_into(src, tok, tmp: str, out_dir: str, *, source: str, tokenizer: str, seq_len: int,
                  eval_fraction: float, **pack_args) -> dict:
    """Pack into ``tmp``, then report.json, then index.json: the completion marker, last."""
    t0 = time.perf_counter()
    packers, problems, utf8, n = _pack(src, tok, tmp, source=source, seq_len=seq_len,
                                       eval_fraction=eval_fraction, **pack_args)
    splits = {name: p.close() for name, p in packers.items()}
    dropped = sum(problems.counts[k] for k in problems.counts if k != "invalid_utf8_docs")
    if splits["train"]["rows"] == 0:
        raise ValueError(f"prepare {source}: no document could be read ({dict(problems.counts)})")
    index = {
        "format": "maxlm-packed-v1", "seq_len": seq_len, "source": source, "source_repr": repr(src),
        "tokenizer": {"name": tokenizer, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
        "dtype": {"tokens": np.dtype(packers["train"].buf["tokens"].dtype).name,
                  "segments": np.dtype(packers["train"].index_dtype).name,
                  "positions": np.dtype(packers["train"].index_dtype).name},
        "eval_fraction": eval_fraction, "splits": splits,
    }
    seconds = time.perf_counter() - t0
    total_tokens = splits["train"]["tokens"] + splits["eval"]["tokens"]
    report = {
        "source": source, "out": out_dir, "tokenizer": index["tokenizer"], "seq_len": seq_len,
        "docs_in": n, "docs_packed": splits["train"]["docs"] + splits["eval"]["docs"],
        "docs_dropped": dropped, "invalid_utf8_bytes_replaced": utf8.replaced, "invalid_utf8": utf8.to_dict(),
        "listing": src.problems.to_dict(), "read": problems.to_dict(),
        "splits": {k: {f: v[f] for f in ("rows", "docs", "tokens", "pad_tokens")} for k, v in splits.items()},
        "seconds": round(seconds, 3), "tokens_per_s": round(total_tokens / max(seconds, 1e-9), 1),
    }
    with open(os.path.join(tmp, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    with open(os.path.join(tmp, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return report


def summary(report: dict) -> str:
    sp = report["splits"]
    lines = [f"prepare {report['source']} -> {report['out']} ({report['seconds']:.1f} s, "
             f"{report['tokens_per_s']:,.0f} tokens/s, tokenizer {report['tokenizer']['name']} "
             f"with {report['tokenizer']['vocab_size']:,} tokens)"]
    for name, s in sp.items():
        lines.append(f"  {name:<6}{s['docs']:>10,} docs {s['tokens']:>14,} tokens {s['rows']:>10,} rows "
                     f"of {report['seq_len']} ({s['pad_tokens']:,} padding)")
    bad = {**report["listing"]["counts"], **report["read"]["counts"]}
    if bad:
        lines.append("  bad input: " + ", ".join(f"{k} {v:,}" for k, v in bad.items())
                     + f" ({report['docs_dropped']:,} documents dropped)")
    if utf8_summary(report.get("invalid_utf8")):
        lines.append(utf8_summary(report["invalid_utf8"]))
    lines.append(f"  train with DataConfig.source = \"packed:{report['out']}\" and DataConfig.tokenizer = "
                 f"\"{report['tokenizer']['name']}\"; report: {os.path.join(report['out'], 'report.json')}")
    return "\n".join(lines)


class PackedRows:
    """Random access to the rows of one split of a prepared directory (a Grain data source).

    Item i is a dict of int32 arrays ``tokens``, ``segments``, ``positions`` of length seq_len."""

    def __init__(self, directory: str, split_name: str = "train"):
        self.directory = local_input(directory)
        index = read_packed_index(directory)
        self.index, self.split, self.seq_len = index, split_name, index["seq_len"]
        entry = index["splits"].get(split_name, {"rows": 0, "shards": []})
        self.shards = entry["shards"]
        self.ends = np.cumsum([s["rows"] for s in self.shards]) if self.shards else np.zeros(0, np.int64)
        digest = hashlib.sha1(json.dumps([s["sha256"] for s in self.shards]).encode()).hexdigest()[:12]
        # No path in the repr: a prepared directory may move; its shards' hashes say what it holds.
        self._repr = f"PackedRows(split={split_name!r}, rows={len(self)}, seq_len={self.seq_len}, digest={digest})"
        self._open_maps = None

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _maps(self, shard: int) -> dict[str, np.ndarray]:
        if self._open_maps is None:
            self._open_maps = {}
        maps = self._open_maps.get(shard)
        if maps is None:
            stem = os.path.join(self.directory, self.shards[shard]["name"])
            maps = {f: np.load(f"{stem}.{f}.npy", mmap_mode="r") for f in FIELDS}
            self._open_maps[shard] = maps
        return maps

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard = int(np.searchsorted(self.ends, index, side="right"))
        row = index - (int(self.ends[shard - 1]) if shard else 0)
        maps = self._maps(shard)
        return {f: maps[f][row].astype(np.int32) for f in FIELDS}

    def __getstate__(self):
        return {**self.__dict__, "_open_maps": None}

    def __repr__(self) -> str:
        return self._repr
