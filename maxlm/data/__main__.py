"""``python -m maxlm.data {clean,train-tokenizer,prepare}``: from raw files to packed training shards.

examples (each command has its own --help):
    python -m maxlm.data clean "jsonl:raw/web/*.jsonl:text" --out data/clean/web --quality web
    python -m maxlm.data train-tokenizer "jsonl:data/clean/*/*.jsonl" --vocab-size 32000 --out data/tokenizer.json
    python -m maxlm.data prepare "jsonl:data/clean/web/*.jsonl" --tokenizer data/tokenizer.json \\
        --seq-len 2048 --out data/packed/web

Each command shows progress, prints a readable summary and writes a JSON report. A mistake in the
arguments or the input is one line on stderr and exit status 2. maxlm/data/README.md walks through
the whole flow, up to a training run on the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

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
    p.add_argument("source", help=SOURCE_HELP)
    p.add_argument("--out", required=True, help="output directory (its previous output is replaced)")
    p.add_argument("--quality", default="web", choices=sorted(PRESETS),
                   help="threshold preset for this source (default: web)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one quality threshold, e.g. min_words=20 (repeatable); see "
                   "maxlm/data/quality.py QualityConfig for the names")
    p.add_argument("--no-exact-dedup", action="store_true", help="skip exact deduplication")
    p.add_argument("--no-near-dedup", action="store_true", help="skip MinHash near-deduplication")
    p.add_argument("--near-threshold", type=float, default=0.8,
                   help="Jaccard similarity at or above which a document is a near duplicate (default: 0.8)")
    p.add_argument("--num-perm", type=int, default=256,
                   help="MinHash permutations: more give a less noisy Jaccard estimate (default: 256)")
    p.add_argument("--shingle", type=int, default=5, help="words per shingle (a CJK character is a word; default: 5)")
    p.add_argument("--no-pii", action="store_true", help="skip PII scrubbing")
    p.add_argument("--perplexity-run", default="", metavar="RUN_DIR",
                   help="score documents with this maxlm run's latest checkpoint (off by default)")
    p.add_argument("--perplexity-drop", type=float, default=10.0, metavar="PERCENT",
                   help="drop this percentage of documents with the highest perplexity (default: 10)")
    p.add_argument("--perplexity-tokens", type=int, default=512, help="tokens scored per document (default: 512)")
    p.add_argument("--max-doc-bytes", type=int, default=32 << 20, help="longer documents are dropped and counted")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                   help="processes for the per-document stages (default: CPU count, at most 8; 0: none)")
    p.add_argument("--docs-per-shard", type=int, default=50_000, help="documents per output file")
    p.add_argument("--limit", type=int, default=0, help="stop after this many documents (0: all)")
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
    p.add_argument("source", nargs="+", help=SOURCE_HELP + " (several are read one after another)")
    p.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    p.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, specials included")
    p.add_argument("--min-frequency", type=int, default=2, help="a merge must occur this often (default: 2)")
    p.add_argument("--max-docs", type=int, default=0, help="train on at most this many documents per source (0: all)")
    p.add_argument("--max-doc-bytes", type=int, default=32 << 20, help="longer documents are skipped and counted")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise and pack a source into memory-mapped training shards",
                       description="Tokenise a source and pack it into fixed-length rows with segment ids "
                       "and positions, in .npy shards with an index.json, for DataConfig.source = 'packed:DIR'.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  python -m maxlm.data prepare "jsonl:data/clean/web/*.jsonl" --tokenizer data/tokenizer.json --seq-len 2048 --out data/packed/web
  python -m maxlm.data prepare stdlib --seq-len 256 --out data/packed/stdlib

A run whose TrainConfig.seq_len divides --seq-len can train on the result too (rows are cut).""")
    p.add_argument("source", help=SOURCE_HELP)
    p.add_argument("--out", required=True, help="output directory (its previous shards are replaced)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (default: byte)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per packed row (TrainConfig.seq_len)")
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="documents held out for evaluation, chosen by a hash of their id (default: 0.01)")
    p.add_argument("--rows-per-shard", type=int, default=0, help="rows per shard (default: ~64M tokens)")
    p.add_argument("--max-doc-bytes", type=int, default=32 << 20, help="longer documents are dropped and counted")
    p.add_argument("--limit", type=int, default=0, help="stop after this many documents (0: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m maxlm.data",
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
        if not sep:
            raise ValueError(f"--set {item!r} should be NAME=VALUE")
        overrides[name.strip()] = value.strip()
    opts = clean.CleanOptions(
        quality=quality.config_from(args.quality, overrides), exact_dedup=not args.no_exact_dedup,
        near_dedup=not args.no_near_dedup, near_threshold=args.near_threshold, num_perm=args.num_perm,
        shingle=args.shingle, pii=not args.no_pii, perplexity_run=args.perplexity_run,
        perplexity_drop=args.perplexity_drop, perplexity_tokens=args.perplexity_tokens,
        max_doc_bytes=args.max_doc_bytes, workers=args.workers, docs_per_shard=args.docs_per_shard,
        limit=args.limit)
    if not 0 <= opts.perplexity_drop < 100:
        raise ValueError(f"--perplexity-drop = {opts.perplexity_drop} must lie in [0, 100)")
    report = clean.clean(args.source, args.out, opts, progress=not args.quiet)
    print(clean.summary(report))
    return report


def run_train_tokenizer(args) -> dict:
    from tqdm import tqdm

    from maxlm.data.sources import Problems, open_source
    from maxlm.data.tokenizer import BPETokenizer, train_bpe

    t0 = time.perf_counter()
    srcs = [open_source(s, args.max_doc_bytes) for s in args.source]
    counts = [min(len(s), args.max_docs) if args.max_docs else len(s) for s in srcs]
    problems, stats = Problems(), {"docs": 0, "bytes": 0}
    for s in srcs:
        problems.merge(s.problems)
    sample: list[str] = []
    bar = tqdm(total=sum(counts), desc="train-tokenizer", unit="doc", disable=args.quiet, dynamic_ncols=True)

    def texts():
        for src, n in zip(srcs, counts):
            for i in range(n):
                rec = src.read(i)
                bar.update(1)
                if rec.problem:
                    problems.add(rec.problem, rec.id, detail=rec.detail)
                    continue
                stats["docs"] += 1
                stats["bytes"] += len(rec.text.encode("utf-8", errors="replace"))
                if len(sample) < 200:
                    sample.append(rec.text)
                yield rec.text
    tok = train_bpe(texts(), args.vocab_size, min_frequency=args.min_frequency, length=sum(counts),
                    show_progress=not args.quiet)
    bar.close()
    if stats["docs"] == 0:
        raise ValueError(f"train-tokenizer: no readable document in {args.source} ({dict(problems.counts)})")
    out = os.path.abspath(os.path.expanduser(args.out))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tok.save(out)
    bpe = BPETokenizer(out)
    sample_bytes = sum(len(t.encode("utf-8", errors="replace")) for t in sample)
    sample_tokens = sum(len(ids) - 2 for ids in bpe.encode_batch(sample))
    round_trip = sum(bpe.decode(bpe.encode(t)) == t for t in sample)
    report = {"out": out, "sources": args.source, "vocab_size": bpe.vocab_size,
              "vocab_size_asked": args.vocab_size, "fingerprint": bpe.fingerprint,
              "special_tokens": {"bos": bpe.bos_id, "eos": bpe.eos_id, "pad": bpe.pad_id},
              "docs": stats["docs"], "bytes": stats["bytes"], "bad_input": problems.to_dict(),
              "sample_docs": len(sample), "sample_bytes_per_token": round(sample_bytes / max(sample_tokens, 1), 3),
              "byte_tokenizer_bytes_per_token": 1.0, "sample_round_trips": round_trip,
              "seconds": round(time.perf_counter() - t0, 3)}
    with open(os.path.splitext(out)[0] + ".report.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    bad = ", ".join(f"{k} {v:,}" for k, v in problems.counts.items())
    print(f"train-tokenizer: {stats['docs']:,} documents ({stats['bytes'] / 1e6:,.1f} MB) -> {out} "
          f"({report['seconds']:.1f} s)\n"
          f"  vocab {bpe.vocab_size:,} tokens (bos {bpe.bos_id}, eos {bpe.eos_id}, pad {bpe.pad_id}), "
          f"{bpe.fingerprint}"
          + (f" (asked for {args.vocab_size:,}: the corpus has no more merges of frequency >= "
             f"{args.min_frequency})" if bpe.vocab_size < args.vocab_size else "") + "\n"
          f"  {report['sample_bytes_per_token']:.2f} bytes/token on {len(sample)} sample documents "
          f"(byte-level: 1.00); {round_trip}/{len(sample)} decode back exactly\n"
          + (f"  bad input skipped: {bad}\n" if bad else "")
          + f"  use with DataConfig.tokenizer = \"{args.out}\" and ModelConfig.vocab_size >= {bpe.vocab_size}; "
          f"report: {os.path.splitext(out)[0] + '.report.json'}")
    return report


def run_prepare(args) -> dict:
    from maxlm.data import prepare

    if not 0 <= args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction = {args.eval_fraction} must lie in [0, 1)")
    report = prepare.prepare(args.source, args.out, args.tokenizer, args.seq_len,
                             eval_fraction=args.eval_fraction, rows_per_shard=args.rows_per_shard,
                             max_doc_bytes=args.max_doc_bytes, limit=args.limit, progress=not args.quiet)
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
