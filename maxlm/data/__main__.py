"""``python -m maxlm.data {clean,train-tokenizer,prepare}``: from raw files to packed training shards.

examples (each command has its own --help):
    python -m maxlm.data clean "jsonl:raw/web/*.jsonl:text" --out data/clean/web --quality web
    python -m maxlm.data train-tokenizer "jsonl:data/clean/*/*.jsonl" --vocab-size 32000 --out data/tokenizer.json
    python -m maxlm.data prepare "jsonl:data/clean/web/*.jsonl" --tokenizer data/tokenizer.json \\
        --seq-len 2048 --out data/packed/web

Each command shows progress, prints a readable summary and writes a JSON report. A mistake in the
arguments or the input is one line on stderr and exit status 2. An output appears whole or not at
all; an existing one is replaced only with --overwrite, and an --out that is, contains or lies
inside an input is refused. maxlm/data/README.md walks through the whole flow, up to a training run
on the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Sequence


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr (not the usage block) and exit status 2."""

    LISTS = ("source", "set")  # the options whose value is a list (of strings)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        # Python 3.11's argparse turns "--opt=--" into [] rather than rejecting it.
        for key, value in vars(parsed).items():
            if isinstance(value, list) and (key not in self.LISTS
                                            or not all(isinstance(v, str) for v in value)):
                self.error(f"argument {'--' * (key not in ('source',))}{key.replace('_', '-')}: "
                           "'--' is not a value")
        return parsed


def _number(kind: type, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
            hi_open: bool = False, note: str = ""):
    """An argparse ``type=`` that parses ``kind`` and checks the range, naming what is allowed."""
    show = (lambda v: f"{v:,}") if kind is int else (lambda v: f"{v:g}")
    left = "" if lo is None else f"{'>' if lo_open else '>='} {show(lo)}"
    right = "" if hi is None else f"{'<' if hi_open else '<='} {show(hi)}"
    bounds = " and ".join(p for p in (left, right) if p)
    allowed = f"{'an integer' if kind is int else 'a number'} {bounds}{f' ({note})' if note else ''}".strip()

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: give {allowed}") from None
        ok = kind is int or math.isfinite(value)  # no nan, no infinity
        ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
        ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: give {allowed}")
        return value
    parse.__name__ = kind.__name__  # what argparse calls the type in its own messages
    return parse


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not allowed: give a file or directory")
    return text


def _source(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty source is not allowed: give a source spec or glob")
    return text


# Ranges that several options share.
FRACTION_01 = _number(float, 0, 1, lo_open=True)
NONNEG = _number(int, 0)
POSITIVE = _number(int, 1)
MAX_DOC_BYTES = _number(int, 1, 1 << 40)
WORKERS = _number(int, 0, 256)
OVERWRITE_HELP = ("replace a finished output at --out; the old one stays until the new one is complete "
                  "(without it, an existing output is an error)")

SOURCE_HELP = ("a source spec: stdlib, files:GLOB, jsonl:GLOB[:FIELD], parquet:GLOB[:COLUMN], or a bare "
               "glob (read by its extension); quote it so the shell does not expand the glob")


def _clean_parser(sub) -> None:
    from maxlm.data.quality import PRESETS

    p = sub.add_parser("clean", help="normalise, filter, deduplicate and scrub raw documents",
                       description="Normalise, quality-filter, deduplicate (exact and MinHash near-dedup) "
                       "and PII-scrub one source into JSONL shards, with a report of every count.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  python -m maxlm.data clean "jsonl:raw/web/*.jsonl:text" --out data/clean/web
  python -m maxlm.data clean "files:raw/code/**/*.py" --out data/clean/code --quality code
  python -m maxlm.data clean "raw/books/*.parquet" --out data/clean/books --quality books --set min_words=500
  python -m maxlm.data clean "jsonl:data/clean/web/*.jsonl" --out data/clean/web_ppl \\
      --quality none --no-near-dedup --perplexity-run runs/tiny --perplexity-drop 10

outputs: OUT/part-NNNNN.jsonl ({"id", "text"} per line), OUT/audit/dropped.jsonl (every dropped
document with its stage and reason), OUT/report.json (the counts of every stage).""")
    p.add_argument("source", type=_source, help=SOURCE_HELP)
    p.add_argument("--out", required=True, type=_path,
                   help="output directory; it appears only when complete (report.json is written last)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--quality", default="web", choices=sorted(PRESETS),
                   help="threshold preset for this source (default: web)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one quality threshold, e.g. min_words=20 (repeatable); see "
                   "maxlm/data/quality.py QualityConfig for the names")
    p.add_argument("--no-exact-dedup", action="store_true", help="skip exact deduplication")
    p.add_argument("--no-near-dedup", action="store_true", help="skip MinHash near-deduplication")
    p.add_argument("--near-threshold", type=FRACTION_01, default=0.8,
                   help="Jaccard similarity at or above which a document is a near duplicate (default: 0.8)")
    p.add_argument("--num-perm", type=_number(int, 16, 1024), default=256,
                   help="MinHash permutations: more give a less noisy Jaccard estimate (default: 256)")
    p.add_argument("--shingle", type=_number(int, 1, 100), default=5,
                   help="words per shingle (a CJK character is a word; default: 5)")
    p.add_argument("--no-pii", action="store_true", help="skip PII scrubbing")
    p.add_argument("--perplexity-run", default="", metavar="RUN_DIR",
                   help="score documents with this maxlm run's latest checkpoint (off by default)")
    p.add_argument("--perplexity-drop", type=_number(float, 0, 100, hi_open=True), default=10.0,
                   metavar="PERCENT",
                   help="drop this percentage of documents with the highest perplexity (default: 10)")
    p.add_argument("--perplexity-tokens", type=_number(int, 2, 1 << 20), default=512,
                   help="tokens scored per document (default: 512)")
    p.add_argument("--max-doc-bytes", type=MAX_DOC_BYTES, default=32 << 20,
                   help="longer documents are dropped and counted")
    p.add_argument("--workers", type=WORKERS, default=min(os.cpu_count() or 1, 8),
                   help="processes for the per-document stages (default: CPU count, at most 8; 0: none); "
                   "with --engine ray and no --address, the CPUs of the local Ray instance")
    p.add_argument("--engine", default="local", choices=("local", "ray"),
                   help="local: this machine's processes (default); ray: Ray Data tasks, the same output "
                   "(needs pip install 'maxlm[ray]')")
    p.add_argument("--address", default="", metavar="ADDR",
                   help="with --engine ray: a running Ray cluster (auto, HOST:PORT or ray://HOST:PORT); "
                   "default: start one on this machine")
    p.add_argument("--docs-per-shard", type=POSITIVE, default=50_000, help="documents per output file")
    p.add_argument("--limit", type=NONNEG, default=0, help="stop after this many documents (0: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _tokenizer_parser(sub) -> None:
    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json",
                       description="Train a byte-level BPE (Hugging Face tokenizers) on one or more sources "
                       "and save it as tokenizer.json, with bos/eos/pad special tokens at ids 0, 1, 2.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  python -m maxlm.data train-tokenizer "jsonl:data/clean/*/*.jsonl" --vocab-size 32000 --out data/tokenizer.json
  python -m maxlm.data train-tokenizer stdlib --vocab-size 4096 --out /tmp/tok/tokenizer.json --max-docs 500

Use it with DataConfig.tokenizer = "data/tokenizer.json" and a ModelConfig.vocab_size of at least
--vocab-size. Next to it, tokenizer.report.json holds the counts and the compression measured.""")
    p.add_argument("source", nargs="+", type=_source,
                   help=SOURCE_HELP + " (several are read one after another)")
    p.add_argument("--out", required=True, type=_path,
                   help="path of the tokenizer.json to write (written whole, or not at all)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--vocab-size", type=_number(int, 259, 1 << 24, note="3 special tokens + 256 bytes at least"),
                   required=True, help="tokens in the vocabulary, specials included")
    p.add_argument("--min-frequency", type=POSITIVE, default=2, help="a merge must occur this often (default: 2)")
    p.add_argument("--max-docs", type=NONNEG, default=0,
                   help="train on at most this many documents per source (0: all)")
    p.add_argument("--max-doc-bytes", type=MAX_DOC_BYTES, default=32 << 20,
                   help="longer documents are skipped and counted")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise and pack a source into memory-mapped training shards",
                       description="Tokenise a source and pack it into fixed-length rows with segment ids "
                       "and positions, in .npy shards with an index.json, for DataConfig.source = 'packed:DIR'.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  python -m maxlm.data prepare "jsonl:data/clean/web/*.jsonl" --tokenizer data/tokenizer.json --seq-len 2048 --out data/packed/web
  python -m maxlm.data prepare stdlib --seq-len 256 --out data/packed/stdlib

A run whose TrainConfig.seq_len divides --seq-len can train on the result too (rows are cut).""")
    p.add_argument("source", type=_source, help=SOURCE_HELP)
    p.add_argument("--out", required=True, type=_path,
                   help="output directory; it appears only when complete (index.json is written last)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--tokenizer", default="byte", type=_path, help="'byte' or a tokenizer.json (default: byte)")
    p.add_argument("--seq-len", type=_number(int, 2, 1 << 20), required=True,
                   help="tokens per packed row (TrainConfig.seq_len)")
    p.add_argument("--eval-fraction", type=_number(float, 0, 1, hi_open=True), default=0.01,
                   help="documents held out for evaluation, chosen by a hash of their id (default: 0.01)")
    p.add_argument("--rows-per-shard", type=_number(int, 0, 1 << 24), default=0,
                   help="rows per shard (default: ~64M tokens); at most 256M tokens per shard")
    p.add_argument("--max-doc-bytes", type=MAX_DOC_BYTES, default=32 << 20,
                   help="longer documents are dropped and counted")
    p.add_argument("--limit", type=NONNEG, default=0, help="stop after this many documents (0: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m maxlm.data",
                                description="From raw files to packed training shards: clean, train a "
                                "tokenizer, prepare.",
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{clean,train-tokenizer,prepare}")
    _clean_parser(sub)
    _tokenizer_parser(sub)
    _prepare_parser(sub)
    return p


def run_clean(args) -> dict:
    from maxlm.data import clean, quality

    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {item!r} should be NAME=VALUE, e.g. --set min_words=20")
        overrides[name.strip()] = value.strip()
    if args.perplexity_run and not os.path.isfile(os.path.join(os.path.expanduser(args.perplexity_run),
                                                               "config.gin")):
        raise ValueError(f"--perplexity-run {args.perplexity_run}: no config.gin there (give a maxlm run "
                         "directory, e.g. runs/tiny)")
    opts = clean.CleanOptions(
        quality=quality.config_from(args.quality, overrides), exact_dedup=not args.no_exact_dedup,
        near_dedup=not args.no_near_dedup, near_threshold=args.near_threshold, num_perm=args.num_perm,
        shingle=args.shingle, pii=not args.no_pii, perplexity_run=args.perplexity_run,
        perplexity_drop=args.perplexity_drop, perplexity_tokens=args.perplexity_tokens,
        max_doc_bytes=args.max_doc_bytes, workers=args.workers, docs_per_shard=args.docs_per_shard,
        limit=args.limit)
    if args.address and args.engine != "ray":
        raise ValueError(f"--address {args.address}: only used with --engine ray")
    report = clean.clean(args.source, args.out, opts, progress=not args.quiet, overwrite=args.overwrite,
                         engine=args.engine, address=args.address)
    print(clean.summary(report))
    return report


def _tokenizer_texts(srcs, counts, problems, utf8, stats, sample, bar):
    """The texts of every readable document, in order; bad ones counted instead."""
    for src, n in zip(srcs, counts):
        for i in range(n):
            rec = src.read(i)
            bar.update(1)
            if rec.problem:
                problems.add(rec.problem, rec.id, detail=rec.detail)
                continue
            utf8.add(rec)
            stats["docs"] += 1
            stats["bytes"] += len(rec.text.encode("utf-8", errors="replace"))
            if len(sample) < 200:
                sample.append(rec.text)
            yield rec.text


def run_train_tokenizer(args) -> dict:
    from tqdm import tqdm

    from maxlm.data import atomic
    from maxlm.data.sources import Problems, Utf8Tally, input_paths, open_source
    from maxlm.data.tokenizer import BPETokenizer, train_bpe

    t0 = time.perf_counter()
    out = os.path.abspath(os.path.expanduser(args.out))
    report_path = os.path.splitext(out)[0] + ".report.json"
    inputs = [pair for spec in args.source for pair in input_paths(spec)]
    for path in (out, report_path):
        atomic.check_disjoint(path, inputs)
    srcs = [open_source(s, args.max_doc_bytes) for s in args.source]
    counts = [min(len(s), args.max_docs) if args.max_docs else len(s) for s in srcs]
    problems, utf8, stats, sample = Problems(), Utf8Tally(), {"docs": 0, "bytes": 0}, []
    for s in srcs:
        problems.merge(s.problems)
    with atomic.Output(out, "train-tokenizer", overwrite=args.overwrite) as tmp:
        bar = tqdm(total=sum(counts), desc="train-tokenizer", unit="doc", disable=args.quiet,
                   dynamic_ncols=True)
        texts = _tokenizer_texts(srcs, counts, problems, utf8, stats, sample, bar)
        tok = train_bpe(texts, args.vocab_size, min_frequency=args.min_frequency, length=sum(counts),
                        show_progress=not args.quiet)
        bar.close()
        if stats["docs"] == 0:
            raise ValueError(f"no readable document in {args.source} ({dict(problems.counts)})")
        tok.save(tmp)
        bpe = BPETokenizer(tmp)
        sample_bytes = sum(len(t.encode("utf-8", errors="replace")) for t in sample)
        sample_tokens = sum(len(ids) - 2 for ids in bpe.encode_batch(sample))
        round_trip = sum(bpe.decode(bpe.encode(t)) == t for t in sample)
        report = {"out": out, "sources": args.source, "vocab_size": bpe.vocab_size,
                  "vocab_size_asked": args.vocab_size, "fingerprint": bpe.fingerprint,
                  "special_tokens": {"bos": bpe.bos_id, "eos": bpe.eos_id, "pad": bpe.pad_id},
                  "docs": stats["docs"], "bytes": stats["bytes"], "bad_input": problems.to_dict(),
                  "invalid_utf8": utf8.to_dict(), "sample_docs": len(sample),
                  "sample_bytes_per_token": round(sample_bytes / max(sample_tokens, 1), 3),
                  "byte_tokenizer_bytes_per_token": 1.0, "sample_round_trips": round_trip,
                  "seconds": round(time.perf_counter() - t0, 3)}
        # The report first, the tokenizer (what everything else reads) last, each replaced whole.
        atomic.write_file(report_path, json.dumps(report, indent=2, ensure_ascii=False), "train-tokenizer")
    print(_tokenizer_summary(args, report, report_path))
    return report


def _tokenizer_summary(args, report: dict, report_path: str) -> str:
    from maxlm.data.sources import utf8_summary

    bad = ", ".join(f"{k} {v:,}" for k, v in report["bad_input"]["counts"].items())
    vocab, sp = report["vocab_size"], report["special_tokens"]
    utf8 = utf8_summary(report["invalid_utf8"])
    return (f"train-tokenizer: {report['docs']:,} documents ({report['bytes'] / 1e6:,.1f} MB) -> "
            f"{report['out']} ({report['seconds']:.1f} s)\n"
            f"  vocab {vocab:,} tokens (bos {sp['bos']}, eos {sp['eos']}, pad {sp['pad']}), "
            f"{report['fingerprint']}"
            + (f" (asked for {args.vocab_size:,}: the corpus has no more merges of frequency >= "
               f"{args.min_frequency})" if vocab < args.vocab_size else "") + "\n"
            f"  {report['sample_bytes_per_token']:.2f} bytes/token on {report['sample_docs']} sample documents "
            f"(byte-level: 1.00); {report['sample_round_trips']}/{report['sample_docs']} decode back exactly\n"
            + (f"  bad input skipped: {bad}\n" if bad else "") + (f"{utf8}\n" if utf8 else "")
            + f"  use with DataConfig.tokenizer = \"{args.out}\" and ModelConfig.vocab_size >= {vocab}; "
            f"report: {report_path}")


def run_prepare(args) -> dict:
    from maxlm.data import prepare

    if args.rows_per_shard * args.seq_len > 1 << 28:
        raise ValueError(f"--rows-per-shard {args.rows_per_shard} x --seq-len {args.seq_len} is more than "
                         f"{1 << 28:,} tokens per shard (held in memory while it fills); use fewer rows")
    report = prepare.prepare(args.source, args.out, args.tokenizer, args.seq_len,
                             eval_fraction=args.eval_fraction, rows_per_shard=args.rows_per_shard,
                             max_doc_bytes=args.max_doc_bytes, limit=args.limit, progress=not args.quiet,
                             overwrite=args.overwrite)
    print(prepare.summary(report))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"clean": run_clean, "train-tokenizer": run_train_tokenizer, "prepare": run_prepare}[args.command]
    try:
        command(args)
    except (ValueError, OSError) as err:
        print(f"python -m maxlm.data {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
