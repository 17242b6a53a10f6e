"""``python -m maxlm.data clean SOURCE --out DIR``: raw documents in, clean JSONL shards out.

Stages, in order, each counted in ``DIR/report.json`` and a printed summary:

    read         bad input (unreadable, empty, binary, oversized, malformed JSON, missing field)
                 dropped; invalid UTF-8 replaced by U+FFFD and counted
    normalise    Unicode NFC; control and zero-width characters removed; lone surrogates replaced;
                 line ends, exotic spaces, trailing blanks and runs of blank lines tidied
    quality      Gopher/C4 heuristics with per-source thresholds (maxlm.data.quality), boilerplate
                 lines removed
    exact_dedup  identical normalised text (first copy kept)
    near_dedup   MinHash + LSH over word shingles (datasketch; maxlm.data.dedup)
    pii          e-mails, phones, ID numbers, IP addresses and card numbers -> placeholders
    perplexity   optional: score with a maxlm run's checkpoint, drop the worst percentile

Every dropped document is also listed, with its stage and reason, in ``DIR/audit/dropped.jsonl``; the
kept ones go to ``DIR/part-NNNNN.jsonl`` as ``{"id": ..., "text": ...}``, ready for
``jsonl:DIR/*.jsonl`` in ``train-tokenizer``, ``prepare`` or ``DataConfig.source``. ``DIR`` appears
whole or not at all (built in a hidden sibling, report.json last; see maxlm.data.atomic).

Two engines, one output: ``local`` (this process, with ``workers`` processes for the per-document
stages) and ``ray`` (maxlm.data.clean_ray: the per-document stages and the dedup decisions as Ray Data
tasks on a cluster); both book and write the documents here, through ``_account``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import re
import time
import unicodedata

import numpy as np
from tqdm import tqdm

from maxlm.data import atomic, dedup, pii, quality
from maxlm.data.sources import Problems, Utf8Tally, input_paths, open_source, utf8_summary

STAGES = ("read", "normalise", "quality", "exact_dedup", "near_dedup", "pii", "perplexity")

_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u2060\ufeff\ufff9-\ufffb]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPACE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f]")
_BLANKS = re.compile(r"\n{3,}")


def normalise(text: str) -> tuple[str, collections.Counter]:
    """(normalised text, counts of what changed: nfc, control_chars, surrogates, whitespace)."""
    stats: collections.Counter = collections.Counter()
    if _SURROGATE.search(text):  # from JSON escapes such as "\\ud800": not encodable as UTF-8
        text, n = _SURROGATE.subn("\ufffd", text)
        stats["surrogates"] += n
    text, n = _CONTROL.subn("", text)
    stats["control_chars"] += n
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
        stats["nfc_docs"] += 1
    before = text
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACE.sub(" ", text)
    if " \n" in text or "\t\n" in text or text.endswith((" ", "\t")):
        text = "\n".join(line.rstrip(" \t") for line in text.split("\n"))
    text = _BLANKS.sub("\n\n", text).strip("\n")
    if text != before:
        stats["whitespace_docs"] += 1
    return text, stats


@dataclasses.dataclass(frozen=True)
class CleanOptions:
    quality: quality.QualityConfig = quality.PRESETS["web"]
    exact_dedup: bool = True
    near_dedup: bool = True
    near_threshold: float = 0.8
    num_perm: int = 256
    shingle: int = 5
    pii: bool = True
    perplexity_run: str = ""  # a maxlm run directory; "" turns the stage off
    perplexity_drop: float = 10.0  # percent of documents with the highest perplexity to drop
    perplexity_tokens: int = 512  # tokens scored per document (its beginning)
    max_doc_bytes: int = 32 << 20
    workers: int = 0  # processes for the per-document stages; 0 runs them here
    docs_per_shard: int = 50_000
    limit: int = 0  # stop after this many documents (0: all)


class _Stage:
    def __init__(self, name: str):
        self.name, self.docs_in, self.docs_out = name, 0, 0
        self.dropped: collections.Counter = collections.Counter()
        self.fixed: collections.Counter = collections.Counter()
        self.examples: dict[str, list] = {}

    def example(self, key: str, value, keep: int = 5) -> None:
        shown = self.examples.setdefault(key, [])
        if len(shown) < keep:
            shown.append(value)

    def to_dict(self) -> dict:
        out = {"stage": self.name, "in": self.docs_in, "out": self.docs_out,
               "dropped": {k: v for k, v in sorted(self.dropped.items()) if v},
               "fixed": {k: v for k, v in sorted(self.fixed.items()) if v}}
        if self.examples:
            out["examples"] = self.examples
        return out


_WORKER_OPTS: "CleanOptions | None" = None


def _init_worker(opts: "CleanOptions") -> None:
    global _WORKER_OPTS
    _WORKER_OPTS = opts


def _process(text: str, opts: "CleanOptions") -> dict:
    """The per-document stages (pure, so they run in worker processes): normalise, quality,
    the exact-dedup key, the MinHash signature, PII. Dedup decisions are made by the caller."""
    out = {}
    text, out["normalise"] = normalise(text)
    if not text.strip():
        out["drop"] = ("normalise", "empty_after_normalise")
        return out
    text, reason, out["quality"] = quality.check(text, opts.quality)
    if reason:
        out["drop"] = ("quality", reason)
        return out
    out["key"] = dedup.exact_key(text) if opts.exact_dedup else None
    out["sig"] = dedup.signature(text, opts.num_perm, opts.shingle) if opts.near_dedup else None
    if opts.pii:
        text, out["pii"] = pii.scrub(text)
    out["text"] = text
    return out


def _process_record(rec, opts: "CleanOptions | None" = None):
    """(record without its text, per-document result or None for a record that was bad)."""
    opts = opts or _WORKER_OPTS
    res = None if rec.problem else _process(rec.text, opts)
    rec.text = None
    return rec, res


class _Writer:
    """JSONL shards of kept documents, and dropped.jsonl of everything dropped."""

    def __init__(self, out_dir: str, docs_per_shard: int, prefix: str = "part"):
        self.dir, self.per_shard, self.prefix = out_dir, docs_per_shard, prefix
        self.shards: list[dict] = []
        self._f = None
        self.docs = self.bytes = 0

    def write(self, doc_id: str, text: str) -> None:
        if self._f is None or self.shards[-1]["docs"] >= self.per_shard:
            self._open()
        line = json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n"
        data = line.encode("utf-8")
        self._f.write(data)
        self.shards[-1]["docs"] += 1
        self.docs += 1
        self.bytes += len(data)

    def _open(self) -> None:
        if self._f:
            self._f.close()
        name = f"{self.prefix}-{len(self.shards):05d}.jsonl"
        self.shards.append({"file": name, "docs": 0})
        self._f = open(os.path.join(self.dir, name), "wb")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


# Top-level names a clean output holds; an existing --out with anything else is never replaced.
OWNED = r"(part|kept)-\d{5}\.jsonl|report\.json|audit"


class LocalDedup:
    """The dedup decisions of the single-machine engine, made as the documents stream by in order:
    exact (first copy kept) and near (maxlm.data.dedup.NearDedup). ``maxlm.data.clean_ray`` answers
    the same two questions from decisions its cluster made beforehand."""

    def __init__(self, opts: CleanOptions):
        self.seen: set[bytes] = set()
        self.near = dedup.NearDedup(opts.near_threshold, opts.num_perm, opts.shingle) if opts.near_dedup else None

    def exact_duplicate(self, index: int, key: bytes) -> bool:
        """Whether document ``index`` (position in the source) repeats an earlier one's text."""
        if key in self.seen:
            return True
        self.seen.add(key)
        return False

    def near_duplicate(self, index: int, doc_id: str, sig) -> tuple[str | None, float]:
        """(id of the kept document it near-duplicates or None, estimated Jaccard)."""
        return self.near.add(doc_id, sig)


def clean(source: str, out_dir: str, opts: CleanOptions = CleanOptions(), progress: bool = True,
          overwrite: bool = False, engine: str = "local", address: str = "") -> dict:
    """Run every stage over ``source`` into ``out_dir``; returns the report (also written there).

    ``engine="ray"`` runs the per-document stages and the dedup decisions as Ray Data tasks
    (maxlm.data.clean_ray) on a local Ray instance with ``opts.workers`` CPUs, or on the cluster at
    ``address``; the output is the same. The output is built in a hidden sibling and appears at
    ``out_dir`` only when complete, its report.json written last (maxlm.data.atomic). A finished
    ``out_dir`` is replaced only with ``overwrite``; an ``out_dir`` that is, holds or lies inside an
    input is refused."""
    if engine not in ("local", "ray"):
        raise ValueError(f"engine = {engine!r}: use 'local' or 'ray'")
    if engine == "ray":
        from maxlm.data import clean_ray  # fails with one line when Ray is missing

        clean_ray.check()
    inputs = input_paths(source)
    if opts.perplexity_run:
        inputs.append(("--perplexity-run", opts.perplexity_run))
    atomic.check_disjoint(out_dir, inputs)
    src = open_source(source, opts.max_doc_bytes)
    with atomic.Output(out_dir, "clean", overwrite=overwrite, marker="report.json", owned=OWNED) as tmp:
        if engine == "ray":
            with clean_ray.session(address, opts.workers, progress) as info:
                return _clean_into(src, source, tmp, out_dir, opts, progress,
                                   engine=lambda total: clean_ray.run(src, total, opts, progress), info=info)
        return _clean_into(src, source, tmp, out_dir, opts, progress)


def _clean_into(src, source: str, tmp: str, out_dir: str, opts: CleanOptions, progress: bool,
                engine=None, info: dict | None = None) -> dict:
    """The stages, writing into ``tmp``; report.json, the completion marker, goes last.

    ``engine(total)``, when given, returns ((record, result) pairs in source order, the dedup
    decisions): the records are booked and written here exactly as the local engine's are."""
    t0 = time.perf_counter()
    stages = {name: _Stage(name) for name in STAGES}
    dedups = LocalDedup(opts)  # also checks the near-dedup options before any work
    ppl = bool(opts.perplexity_run)
    writer = _Writer(tmp, opts.docs_per_shard, "kept" if ppl else "part")
    os.makedirs(os.path.join(tmp, "audit"))  # not matched by OUT/*.jsonl
    dropped_f = open(os.path.join(tmp, "audit", "dropped.jsonl"), "w", encoding="utf-8")
    utf8 = Utf8Tally()

    def drop(stage: str, reason: str, doc_id: str, detail: str = "", **extra) -> None:
        stages[stage].dropped[reason] += 1
        stages[stage].example(reason, f"{doc_id}: {detail}" if detail else doc_id)
        dropped_f.write(json.dumps({"id": doc_id, "stage": stage, "reason": reason, "detail": detail,
                                    **extra}, ensure_ascii=False) + "\n")

    for kind, where, n, detail in src.problems.entries or ():  # paths that were never documents
        dropped_f.write(json.dumps({"id": where, "stage": "listing", "reason": kind, "detail": detail,
                                    "count": n}, ensure_ascii=False) + "\n")
    total = min(len(src), opts.limit) if opts.limit else len(src)
    records = (src.read(i) for i in range(total))
    pool = None
    if engine is not None:
        results, dedups = engine(total)
    elif opts.workers > 0:
        # Reading happens here while the workers run the per-document stages; imap keeps the order.
        pool = multiprocessing.get_context("spawn").Pool(opts.workers, _init_worker, (opts,))
        results = pool.imap(_process_record, records, chunksize=16)
    else:
        results = (_process_record(rec, opts) for rec in records)
    bar = tqdm(total=total, desc=f"clean {source}", unit="doc", disable=not progress, dynamic_ncols=True)
    read = stages["read"]
    try:
        for n, (rec, res) in enumerate(results, 1):
            read.docs_in += 1
            if rec.problem:
                drop("read", rec.problem, rec.id, rec.detail)
            else:
                read.docs_out += 1
                if rec.replaced:
                    read.fixed["invalid_utf8_docs"] += 1
                    read.fixed["invalid_utf8_bytes"] += rec.replaced
                    read.example("invalid_utf8", rec.id)
                    utf8.add(rec)
                _account(n - 1, rec, res, stages, drop, dedups, opts, writer)
            if n % 64 == 0:
                bar.update(64)
                bar.set_postfix(kept=writer.docs, refresh=False)
        bar.update(total - bar.n)
    finally:
        bar.close()
        if pool:
            pool.terminate()
            pool.join()
        writer.close()
    if ppl:
        writer = _perplexity_stage(tmp, writer, opts, stages["perplexity"], drop, progress)
    else:
        stages["perplexity"].docs_in = stages["perplexity"].docs_out = stages["pii"].docs_out
    dropped_f.close()
    report = {
        "format": "maxlm-clean-v1", "source": source, "source_repr": repr(src), "out": out_dir,
        "options": _options_dict(opts), "engine": info or {"name": "local", "workers": opts.workers},
        "seconds": round(time.perf_counter() - t0, 3),
        "listing": src.problems.to_dict(),
        "stages": [stages[name].to_dict() for name in STAGES],
        "invalid_utf8": utf8.to_dict(),
        "output": {"docs": writer.docs, "bytes": writer.bytes, "shards": writer.shards},
    }
    report["docs_per_s"] = round(stages["read"].docs_in / max(report["seconds"], 1e-9), 1)
    with open(os.path.join(tmp, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    return report


def _account(index, rec, res, stages, drop, dedups, opts, writer) -> None:
    """Book one document through the stages after read, in order, and write it if kept."""
    for name in ("normalise", "quality"):  # the per-document stages: counted fixes, or a drop
        stage = stages[name]
        stage.docs_in += 1
        stage.fixed.update(res.get(name, {}))
        if res.get("drop", ("",))[0] == name:
            drop(name, res["drop"][1], rec.id)
            return
        stage.docs_out += 1
    ex = stages["exact_dedup"]
    ex.docs_in += 1
    if res["key"] is not None and dedups.exact_duplicate(index, res["key"]):
        drop("exact_dedup", "duplicate", rec.id)
        return
    ex.docs_out += 1
    nd = stages["near_dedup"]
    nd.docs_in += 1
    if opts.near_dedup:
        of, j = dedups.near_duplicate(index, rec.id, res["sig"])
        if of is not None:
            drop("near_dedup", "near_duplicate", rec.id, f"of {of}, estimated Jaccard {j:.2f}",
                 duplicate_of=of, jaccard=round(j, 4))
            return
    nd.docs_out += 1
    p = stages["pii"]
    p.docs_in += 1
    found = res.get("pii", {})
    if found:
        p.fixed.update(found)
        p.fixed["docs"] += 1
    p.docs_out += 1
    writer.write(rec.id, res["text"])


def _perplexity_stage(out_dir, kept_writer, opts, stage, drop, progress) -> "_Writer":
    """Score the kept documents, drop the top ``perplexity_drop`` percent, write the final shards."""
    from maxlm.data.perplexity import PerplexityScorer

    scorer = PerplexityScorer(opts.perplexity_run, max_tokens=opts.perplexity_tokens)
    kept = [os.path.join(out_dir, s["file"]) for s in kept_writer.shards]

    def docs():
        for path in kept:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)
    scores = scorer.score((d["text"] for d in docs()), total=kept_writer.docs, progress=progress)
    stage.docs_in = len(scores)
    cut = float(np.percentile(scores, 100.0 - opts.perplexity_drop)) if len(scores) else 0.0
    stage.fixed["threshold_perplexity"] = round(cut, 4)
    writer = _Writer(out_dir, opts.docs_per_shard)
    # Drop strictly above the cut, then (ties) enough at the cut to honour the percentile.
    budget = int(round(len(scores) * opts.perplexity_drop / 100.0))
    above = int(np.sum(scores > cut))
    ties = max(budget - above, 0)
    for doc, score in zip(docs(), scores):
        if score > cut or (score == cut and ties > 0 and opts.perplexity_drop > 0):
            if score == cut:
                ties -= 1
            drop("perplexity", "high_perplexity", doc["id"], f"perplexity {score:.2f} > {cut:.2f}",
                 perplexity=round(float(score), 4))
            continue
        writer.write(doc["id"], doc["text"])
    writer.close()
    stage.docs_out = writer.docs
    for path in kept:
        os.remove(path)
    return writer


def _options_dict(opts: CleanOptions) -> dict:
    out = dataclasses.asdict(opts)
    out["quality"] = {k: (list(map(list, v)) if isinstance(v, tuple) else v)
                      for k, v in dataclasses.asdict(opts.quality).items()}
    return out


def summary(report: dict) -> str:
    """The report as a few readable lines."""
    engine = report.get("engine", {})
    on = f", on Ray: {engine['address']}, {engine['cpus']} CPUs" if engine.get("name") == "ray" else ""
    lines = [f"clean {report['source']} -> {report['out']} "
             f"({report['seconds']:.1f} s, {report['docs_per_s']:,.0f} docs/s{on})"]
    listing = report["listing"]["counts"]
    if listing:
        lines.append("  listing       skipped: " + ", ".join(f"{k} {v:,}" for k, v in listing.items()))
    for st in report["stages"]:
        text = f"  {st['stage']:<12}{st['in']:>10,} in {st['out']:>10,} out"
        if st["dropped"]:
            text += "   dropped: " + ", ".join(f"{k} {v:,}" for k, v in st["dropped"].items())
        if st["fixed"]:
            label = "replaced" if st["stage"] == "pii" else "fixed"
            text += f"   {label}: " + ", ".join(f"{k} {v:,}" for k, v in st["fixed"].items())
        lines.append(text)
    if utf8_summary(report.get("invalid_utf8")):
        lines.append(utf8_summary(report["invalid_utf8"]))
    out = report["output"]
    lines.append(f"  wrote {out['docs']:,} documents ({out['bytes'] / 1e6:,.1f} MB) in "
                 f"{len(out['shards'])} shard(s); every drop is listed in "
                 f"{os.path.join(report['out'], 'audit', 'dropped.jsonl')}; report: "
                 f"{os.path.join(report['out'], 'report.json')}")
    return "\n".join(lines)


def check_accounting(report: dict) -> None:
    """Every document that entered a stage either left it or was dropped with a count."""
    prev_out = None
    for st in report["stages"]:
        dropped = sum(st["dropped"].values())
        if st["in"] != st["out"] + dropped:
            raise AssertionError(f"stage {st['stage']}: {st['in']} in != {st['out']} out + {dropped} dropped")
        if prev_out is not None and st["in"] != prev_out:
            raise AssertionError(f"stage {st['stage']}: {st['in']} in != {prev_out} out of the stage before")
        prev_out = st["out"]
    if prev_out != report["output"]["docs"]:
        raise AssertionError(f"{prev_out} documents left the last stage but {report['output']['docs']} were written")


__all__ = ["CleanOptions", "LocalDedup", "Problems", "check_accounting", "clean", "normalise", "summary"]
