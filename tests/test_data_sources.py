"""Source specs, mixtures, JSONL and Parquet sources, and bad input: counted, reported, never a crash."""

import json
import logging
import os

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import check_config, clean, make_eval_batches, make_train_iterator, prepare, sources, spec
from maxlm.data.__main__ import main as data_main

MB = 1 << 20


def one_line(err):
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("text,kind,path,field", [
    ("stdlib", "stdlib", "", "text"),
    ("files:corpus/**/*.txt", "files", "corpus/**/*.txt", "text"),
    ("corpus/**/*.py", "files", "corpus/**/*.py", "text"),
    ("jsonl:web/*.jsonl", "jsonl", "web/*.jsonl", "text"),
    ("jsonl:web/*.jsonl:content", "jsonl", "web/*.jsonl", "content"),
    ("jsonl:web/*.jsonl:meta.body", "jsonl", "web/*.jsonl", "meta.body"),
    ("web/part-*.jsonl", "jsonl", "web/part-*.jsonl", "text"),
    ("parquet:books/*.parquet:body", "parquet", "books/*.parquet", "body"),
    ("books/*.parquet", "parquet", "books/*.parquet", "text"),
    ("packed:data/packed/web", "packed", "data/packed/web", "text"),
])
def test_parse_source(text, kind, path, field):
    s = spec.parse_source(text)
    assert (s.kind, s.path, s.field, s.text) == (kind, path, field, text)


def test_parse_mixture_and_check_config():
    mix = spec.parse_mixture("packed:a; packed:b;\n files:c/*.txt ; stdlib", "6, 2, 1, 1")
    assert [s.text for s, _ in mix] == ["packed:a", "packed:b", "files:c/*.txt", "stdlib"]
    assert [w for _, w in mix] == pytest.approx([0.6, 0.2, 0.1, 0.1])
    assert [w for _, w in spec.parse_mixture("stdlib; files:x/*")] == [0.5, 0.5]
    bad = [
        (dict(source="stdlib; files:x/*", weights="0.5"), "has 1 value(s) but DataConfig.source has 2"),
        (dict(source="stdlib; files:x/*", weights="0.5, -1"), "every weight must be positive"),
        (dict(source="stdlib", weights="lots"), "is not a list of numbers"),
        (dict(source="stdlib; stdlib"), "lists 'stdlib' twice"),
        (dict(source="s3:bucket/x"), "unknown kind 's3'"),
        (dict(source=" ; "), "DataConfig.source is empty"),
        (dict(eval_fraction=1.0), "DataConfig.eval_fraction = 1.0 must lie in [0, 1)"),
        (dict(worker_count=-1), "must be >= 0"),
        (dict(max_doc_bytes=0), "DataConfig.max_doc_bytes = 0 must be positive"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError) as err:
            check_config(DataConfig(**fields))
        assert message in one_line(err), fields
    check_config(DataConfig())


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
            f.write("\n")


def test_jsonl_source(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "first doc"}, "", {"text": "第二", "meta": {"body": "x"}},
                                       {"content": "no text field"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "third"}])
    src = sources.open_source(f"jsonl:{tmp_path}/*.jsonl")
    assert len(src) == 4  # the blank line is layout, counted but not a document
    assert src.problems.counts["blank_lines"] == 1
    recs = list(src.records())
    assert [r.id for r in recs] == ["a.jsonl:1", "a.jsonl:3", "a.jsonl:4", "b.jsonl:1"]
    assert [r.text for r in recs] == ["first doc", "第二", None, "third"]
    assert recs[2].problem == "missing_field" and "'text' is absent" in recs[2].detail
    nested = sources.open_source(f"jsonl:{tmp_path}/a.jsonl:meta.body")
    assert nested.read(1).text == "x"
    assert repr(src) == repr(sources.open_source(f"jsonl:{tmp_path}/*.jsonl"))
    assert np.array_equal(src.keys(), sources.open_source(f"jsonl:{tmp_path}/*.jsonl").keys())
    assert len(set(src.keys().tolist())) == 4


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["p0", None, "p2", "  ", "p4"], "n": [0, 1, 2, 3, 4]}),
                   tmp_path / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"body": ["other column"]}), tmp_path / "b.parquet")
    (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    src = sources.open_source(f"{tmp_path}/*.parquet")
    assert len(src) == 5
    assert src.problems.counts == {"missing_field": 1, "unreadable": 1}
    recs = list(src.records())
    assert [r.id for r in recs] == [f"a.parquet:row{i}" for i in range(5)]
    assert [r.problem for r in recs] == [None, "missing_field", None, "empty", None]
    assert src[4] == "p4" and src[1] == ""
    body = sources.open_source(f"parquet:{tmp_path}/b.parquet:body")
    assert body.read(0).text == "other column"


def make_bad_corpus(root):
    """Good documents plus one of each kind of bad input; returns the two globs."""
    files = root / "files"
    files.mkdir()
    for i in range(6):
        (files / f"good{i}.txt").write_text(f"document {i}: " + "plain words here " * 10)
    (files / "latin1.txt").write_bytes("café naïve ".encode("latin-1") * 20)  # invalid UTF-8
    (files / "empty.txt").write_bytes(b"")
    (files / "blob.txt").write_bytes(b"\x7fELF\x02\x01\x00\x00" + bytes(range(256)) * 8)  # binary
    with open(files / "huge.txt", "wb") as f:  # a single 100 MB line
        f.write(b"x" * (100 * MB))
    os.symlink(files / "nowhere.txt", files / "dangling.txt")  # unreadable path
    (files / "vanishing.txt").write_text("listed, then deleted before it is read")
    jsonl = root / "jsonl"
    jsonl.mkdir()
    rows = [{"text": f"json document {i} " + "with words " * 10} for i in range(5)]
    rows += ['{"text": "unterminated', {"body": "no text"}, {"text": 42}]
    write_jsonl(jsonl / "web.jsonl", rows)
    with open(jsonl / "web.jsonl", "ab") as f:
        f.write(b'{"text": "caf\xe9 ' + b"bytes " * 10 + b'"}\n')  # invalid UTF-8 inside JSON
        f.write(b'{"text": "' + b"y" * (100 * MB) + b'"}\n')  # a single 100 MB JSONL line
    (jsonl / "empty.jsonl").write_bytes(b"")
    return f"files:{files}/*.txt", f"jsonl:{jsonl}/*.jsonl"


@pytest.mark.slow
def test_bad_input_is_counted_and_reported_never_a_crash(tmp_path, caplog, capsys):
    files_spec, jsonl_spec = make_bad_corpus(tmp_path)
    # 1. The clean CLI: each kind counted in the report; every document accounted for.
    src = sources.open_source(files_spec)
    assert src.problems.counts == {"empty": 1, "oversized": 1, "unreadable": 1}
    os.remove(tmp_path / "files" / "vanishing.txt")  # gone between listing and reading
    gone = src.read(src.relpaths.index("vanishing.txt"))
    assert (gone.problem, gone.detail) == ("unreadable", "No such file or directory")
    out = tmp_path / "clean_files"
    assert data_main(["clean", files_spec, "--out", str(out), "--quality", "none", "--workers", "0",
                      "--quiet"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["listing"]["counts"] == {"empty": 1, "oversized": 1, "unreadable": 1}
    read = report["stages"][0]
    assert read["dropped"] == {"binary": 1}
    assert read["fixed"] == {"invalid_utf8_bytes": 40, "invalid_utf8_docs": 1}
    assert "oversized 1" in printed and "binary 1" in printed and "invalid_utf8_docs 1" in printed
    clean.check_accounting(report)
    dropped = [json.loads(line) for line in (out / "audit" / "dropped.jsonl").read_text().splitlines()]
    assert sorted((d["stage"], d["reason"]) for d in dropped) == [
        ("listing", "empty"), ("listing", "oversized"), ("listing", "unreadable"), ("read", "binary")]
    assert report["output"]["docs"] == 7  # six good files and the repaired latin-1 one

    jout = tmp_path / "clean_jsonl"
    assert data_main(["clean", jsonl_spec, "--out", str(jout), "--quality", "none", "--workers", "0",
                      "--quiet"]) == 0
    report = json.loads((jout / "report.json").read_text())
    assert report["listing"]["counts"] == {"empty": 1}
    read = report["stages"][0]
    assert read["dropped"] == {"malformed_json": 1, "missing_field": 2, "oversized": 1}
    assert read["fixed"] == {"invalid_utf8_bytes": 1, "invalid_utf8_docs": 1}
    assert read["in"] == 10 and report["output"]["docs"] == 6
    clean.check_accounting(report)

    # 2. prepare counts the same problems.
    rep = prepare.prepare(jsonl_spec, str(tmp_path / "packed"), "byte", 64, eval_fraction=0.0, progress=False)
    assert rep["read"]["counts"] == {"invalid_utf8_docs": 1, "malformed_json": 1, "missing_field": 2,
                                     "oversized": 1}
    assert rep["docs_dropped"] == 4 and rep["docs_packed"] == 6

    # 3. Training straight from the bad raw files: bad documents are skipped and logged, not fatal.
    caplog.set_level(logging.WARNING, logger="maxlm.data")
    cfg = DataConfig(source=files_spec, eval_fraction=0.2, prefetch=0)
    it = make_train_iterator(cfg, seq_len=64, global_batch=4)
    batches = [next(it) for _ in range(20)]
    it.close()
    assert all(b["inputs"].shape == (4, 64) for b in batches)
    assert "skipped" in caplog.text and "binary" in caplog.text
    assert make_eval_batches(cfg, seq_len=64, global_batch=4, num_batches=2)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert data_main(["clean", f"files:{tmp_path}/nothing/*.txt", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m maxlm.data clean: error:") and "matched no" in err[0]
    assert data_main(["clean", "stdlib", "--out", str(tmp_path / "o"), "--set", "min_wordz=3", "--quiet"]) == 2
    assert "quality setting 'min_wordz' is unknown" in capsys.readouterr().err
    assert data_main(["prepare", "stdlib", "--out", str(tmp_path / "p"), "--seq-len", "64",
                      "--tokenizer", str(tmp_path / "missing.json"), "--quiet"]) == 2
    assert "neither 'byte' nor an existing tokenizer.json" in capsys.readouterr().err


def test_a_split_without_readable_documents_fails_fast(tmp_path):
    """An endless stream would skip bad documents forever: refuse up front instead."""
    for i in range(4):
        (tmp_path / f"b{i}.txt").write_bytes(b"\x00\x01 binary")
    with pytest.raises(ValueError) as err:
        make_train_iterator(DataConfig(source=f"files:{tmp_path}/*.txt"), seq_len=16, global_batch=2)
    assert "none of the 3 train document(s) of process 0 is readable text ({'binary': 3})" in one_line(err)
