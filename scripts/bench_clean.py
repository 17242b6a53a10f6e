"""Documents/s of ``python -m maxlm.data clean``: the single-machine engine against the Ray engine.

    python scripts/bench_clean.py                 # 20,000 documents, 3 rounds (~5-8 minutes on 2 cores)
    python scripts/bench_clean.py --docs 4000 --repeats 2     # a quick look

One generated corpus (English-like web pages that pass the web quality preset, with exact copies,
planted near duplicates and e-mail addresses and phone numbers mixed in), written once as JSONL and
cleaned with every stage on (web quality, exact and MinHash near-dedup, PII) by:

  local     the single-machine engine in this process (``--workers 0``)
  local2    the single-machine engine with 2 worker processes (``--workers 2``)
  ray1      ``--engine ray`` on a local Ray instance with 1 CPU
  ray2      ``--engine ray`` on a local Ray instance with 2 CPUs

Each round runs every configuration once, in an order that alternates between rounds, so all see
the same machine load; the figure is the median over rounds of documents read / seconds in
``clean.clean`` (the Ray instance is started, and its workers warmed by a 200-document run, before
the clock, and stopped after it: that start-up is printed separately). Every configuration's
output files are compared with the local engine's.
The load average is printed before and after: other work on the machine slows every column.

Last lines: ``ratio ray2/local docs_per_s = X`` and ``ratio ray2/ray1 docs_per_s = Y``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

STOP = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
        "but have an they you were her she there been one all we their has would when if so no will").split()


def make_corpus(path: str, docs: int, seed: int = 0) -> dict:
    """Write ``docs`` JSONL documents; ~5% exact copies, ~10% near duplicates, ~10% with PII."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(3, 10))) for _ in range(30000)]
    made: list[str] = []
    counts = {"exact": 0, "near": 0, "pii": 0}
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs):
            r = rng.random()
            if made and r < 0.05:
                text = made[int(rng.integers(len(made)))]
                counts["exact"] += 1
            elif made and r < 0.15:
                words = made[int(rng.integers(len(made)))].split(" ")
                for pos in rng.choice(len(words), max(1, len(words) // 100), replace=False):
                    words[pos] = vocab[int(rng.integers(len(vocab)))]
                text = " ".join(words)
                counts["near"] += 1
            else:
                sentences = []
                for _ in range(int(rng.integers(12, 25))):
                    n = int(rng.integers(8, 16))
                    words = [STOP[int(k) % len(STOP)] if rng.random() < 0.45 else vocab[int(k) % len(vocab)]
                             for k in rng.integers(0, 1 << 30, n)]
                    sentences.append(" ".join(words).capitalize() + ".")
                paragraphs = [" ".join(sentences[k:k + 5]) for k in range(0, len(sentences), 5)]
                text = "\n\n".join(paragraphs)
                if rng.random() < 0.1:
                    text += f"\n\nContact {vocab[i % len(vocab)]}@example.com or call +1 415 555 {i % 10000:04d}."
                    counts["pii"] += 1
                made.append(text)
            f.write(json.dumps({"text": text}) + "\n")
    return counts


def output_files(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".jsonl"):
                p = os.path.join(dirpath, name)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = f.read()
    return out


def run_one(name: str, source: str, out: str, warmup: str) -> tuple[float, dict, float]:
    """(seconds in clean.clean, report, Ray start-up seconds) for one configuration. A Ray instance
    is started, and its worker processes warmed by cleaning the small ``warmup`` source (they import
    maxlm once each), before the clock starts."""
    from maxlm.data import clean

    engine = "ray" if name.startswith("ray") else "local"
    workers = {"local": 0, "local2": 2, "ray1": 1, "ray2": 2}[name]
    opts = clean.CleanOptions(workers=workers)
    startup = 0.0
    if engine == "ray":
        import logging

        import ray

        t = time.perf_counter()
        ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        clean.clean(warmup, out + "_warmup", opts, progress=False, overwrite=True, engine=engine)
        startup = time.perf_counter() - t
    try:
        t = time.perf_counter()
        report = clean.clean(source, out, opts, progress=False, overwrite=True, engine=engine)
        seconds = time.perf_counter() - t
    finally:
        if engine == "ray":
            ray.shutdown()
    return seconds, report, startup


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--docs", type=int, default=20000, help="documents in the generated corpus (default: 20000)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported (default: 3)")
    p.add_argument("--configs", default="local,local2,ray1,ray2",
                   help="comma-separated subset of local, local2, ray1, ray2 (default: all)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if any(n not in ("local", "local2", "ray1", "ray2") for n in names) or "local" not in names:
        p.error("--configs: choose among local, local2, ray1, ray2, and include local")
    try:
        import ray  # noqa: F401
    except ImportError:
        print("bench_clean: the Ray engine needs Ray Data: pip install 'maxlm[ray]'", file=sys.stderr)
        return 2

    tmp = tempfile.mkdtemp(prefix="bench_clean_")
    try:
        path = os.path.join(tmp, "corpus.jsonl")
        counts = make_corpus(path, args.docs)
        make_corpus(os.path.join(tmp, "warmup.jsonl"), 200, seed=1)
        warmup = f"jsonl:{os.path.join(tmp, 'warmup.jsonl')}"
        size = os.path.getsize(path)
        print(f"corpus: {args.docs:,} documents, {size / 1e6:.1f} MB ({counts['exact']:,} exact copies, "
              f"{counts['near']:,} near duplicates, {counts['pii']:,} with PII)")
        print(f"machine: {os.cpu_count()} CPUs; load average before: "
              + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        source = f"jsonl:{path}"
        rates: dict[str, list[float]] = {n: [] for n in names}
        startups: list[float] = []
        reference = None
        for r in range(args.repeats):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                out = os.path.join(tmp, f"out_{name}")
                seconds, report, startup = run_one(name, source, out, warmup)
                if startup:
                    startups.append(startup)
                rate = args.docs / seconds
                rates[name].append(rate)
                files = output_files(out)
                if name == "local" and reference is None:
                    reference = files
                    kept = report["output"]["docs"]
                same = reference is None or files == reference
                print(f"round {r + 1} {name:<7} {seconds:7.2f} s {rate:9.1f} docs/s  "
                      f"kept {report['output']['docs']:,}  identical to local: {'yes' if same else 'NO'}",
                      flush=True)
                if reference is not None and not same:
                    print(f"bench_clean: {name} wrote different files from the local engine", file=sys.stderr)
                    return 1
        print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        if startups:
            print(f"Ray start-up (ray.init and a 200-document warm-up run, not in the times above): "
                  f"median {statistics.median(startups):.1f} s")
        print(f"\n| engine | workers | docs/s (median of {args.repeats}) |")
        print("|---|---|---|")
        for name in names:
            engine, workers = ("ray", name[3:]) if name.startswith("ray") else ("local", "2" if name == "local2" else "0")
            print(f"| {engine} | {workers} | {statistics.median(rates[name]):,.0f} |")
        print(f"\nkept {kept:,} of {args.docs:,} documents; all outputs identical to the local engine's")
        base = statistics.median(rates["local"])
        for name in names:
            if name != "local":
                print(f"ratio {name}/local docs_per_s = {statistics.median(rates[name]) / base:.2f}")
        if "ray1" in names and "ray2" in names:
            print(f"ratio ray2/ray1 docs_per_s = "
                  f"{statistics.median(rates['ray2']) / statistics.median(rates['ray1']):.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
