"""``python -m maxlm.data clean --engine ray``: the same output as the single-machine engine.

The Ray engine runs as users run it, in its own process with its own local Ray instance: Ray's core
worker ends its process abruptly (quick exit) on some shutdown and raylet faults, and the process
must never be a pytest worker."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxlm.data import clean, dedup
from maxlm.data.__main__ import main as data_main
from test_data_clean import corpus
from test_resilience import ENV

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


def files(root: Path) -> dict[str, bytes]:
    """Every output file that the engine decides: the shards and the audit list, by path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jsonl"))}


def run_both(tmp_path, source, *extra):
    """Run both engines on ``source``, check they wrote the same files; returns (Ray report, Ray output dir)."""
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    assert data_main(["clean", source, "--out", str(local), "--quiet", "--engine", "local", "--workers", "0", *extra]) == 0
    argv = ["clean", source, "--out", str(ray_out), "--quiet", "--engine", "ray", "--workers", "2", *extra]
    proc = subprocess.run([sys.executable, "-m", "maxlm.data", *argv], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert files(ray_out) == files(local) and len(files(local)) >= 2
    reports = [json.loads((out / "report.json").read_text()) for out in (local, ray_out)]
    assert reports[1]["stages"] == reports[0]["stages"] and reports[1]["output"] == reports[0]["output"]
    assert reports[0]["engine"]["name"] == "local" and reports[1]["engine"]["name"] == "ray"
    clean.check_accounting(reports[1])
    return reports[1], ray_out


def test_ray_engine_matches_local_on_the_clean_corpus(tmp_path):
    """The clean CLI's corpus (junk, an exact and a hidden near duplicate, PII): same files."""
    report, out = run_both(tmp_path, corpus(tmp_path / "raw.jsonl"))
    assert report["output"]["docs"] == 13
    dropped = [json.loads(line) for line in (out / "audit" / "dropped.jsonl").read_text().splitlines()]
    near = next(d for d in dropped if d["reason"] == "near_duplicate")
    assert near["id"] == "raw.jsonl:14" and near["duplicate_of"] == "raw.jsonl:2"


def chain(rng, vocab, words=200, step=3):
    """A, B, C: B is A with ``step`` words replaced (Jaccard ~0.86), C is B with ``step`` more
    (~0.86 to B, ~0.73 to A). The local rule drops B (a duplicate of A) but keeps C, whose only
    near duplicate was dropped: a connected-components 'keep the first' rule would drop C too."""
    a = list(rng.choice(vocab, words))
    b, c = list(a), None
    for pos in (30, 100, 170):
        b[pos] = "zz" + b[pos]
    c = list(b)
    for pos in (65, 135, 190):
        c[pos] = "qq" + c[pos]
    return [" ".join(x) for x in (a, b, c)]


def test_ray_engine_matches_local_on_planted_near_duplicates(tmp_path):
    """Planted near duplicates at Jaccard 0.95 ... 0.5 among unrelated documents, exact copies and
    chains A ~ B ~ C: the same documents kept, in the same shards, with the same audit lines."""
    docs, pairs = dedup.planted_corpus(n_base=120, targets=(0.95, 0.85, 0.8, 0.7, 0.5), copies_per_target=8)
    rng = np.random.default_rng(3)
    vocab = np.array(["".join(rng.choice(list("abcdefghij"), 6)) for _ in range(5000)])
    chains = [chain(rng, vocab) for _ in range(3)]
    a, b, c = (dedup.shingles(t) for t in chains[0])
    assert dedup.jaccard(a, b) > 0.85 and dedup.jaccard(b, c) > 0.85 and dedup.jaccard(a, c) < 0.75
    docs = docs + [t for ch in chains for t in ch] + docs[:5]  # and 5 exact copies
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    report, out = run_both(tmp_path, f"jsonl:{path}", "--quality", "none", "--docs-per-shard", "64")
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["exact_dedup"]["dropped"] == {"duplicate": 5}
    assert stages["near_dedup"]["dropped"]["near_duplicate"] >= 20
    assert len(report["output"]["shards"]) >= 3
    dropped = {d["id"]: d for d in map(json.loads, (out / "audit" / "dropped.jsonl").read_text().splitlines())}
    kept = {json.loads(line)["id"] for p in sorted(out.glob("part-*.jsonl")) for line in p.read_text().splitlines()}
    first = len(docs) - 5 - 9
    for k in range(3):
        ia, ib, ic = (f"planted.jsonl:{first + 3 * k + j + 1}" for j in range(3))
        assert ia in kept and ic in kept and dropped[ib]["duplicate_of"] == ia


def test_ray_engine_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    source = corpus(tmp_path / "raw.jsonl")
    out = str(tmp_path / "out")
    for address, says in (("127.0.0.1:1", "no Ray cluster answers there"), ("nonsense", "HOST:PORT")):
        assert data_main(["clean", source, "--out", out, "--quiet", "--engine", "ray", "--address", address]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--address {address}" in err and says in err, err
    assert data_main(["clean", source, "--out", out, "--quiet", "--address", "auto"]) == 2
    assert "only used with --engine ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert data_main(["clean", source, "--out", out, "--quiet", "--engine", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'maxlm[ray]'" in err, err
    assert not Path(out).exists()
