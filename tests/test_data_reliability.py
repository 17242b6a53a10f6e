"""Reliability of the data commands (`python -m maxlm.data clean|train-tokenizer|prepare`): nothing
lost, one clear line, one writer per output. Each test is a regression test for a finding of the
reliability review: it failed before the fix (a deleted input, a half output packed without
complaint, a compressed file read as bytes, an option accepted that ruins the run, a traceback)."""

import contextlib
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxlm.config import DataConfig
from maxlm.data import clean, make_eval_batches, make_train_iterator, sources
from maxlm.data.__main__ import main as data_main
from maxlm.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def cli(*args) -> tuple[int, str, str]:
    """Run `python -m maxlm.data ARGS` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = data_main([str(a) for a in args])
        except SystemExit as exit_:  # argparse
            rc = exit_.code
    return rc, out.getvalue(), err.getvalue()


def one_error_line(err: str, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def tree(root) -> dict[str, str]:
    """Every entry under root, hidden ones included: path -> sha256 (files) or "dir"."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(directory, name), root)] = "dir"
        for name in files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


def sentences(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n)) + "."


def write_corpus(path: Path, docs: int, seed: int = 0, words_per_doc: int = 60) -> str:
    """A JSONL corpus of distinct random-word documents; returns its spec."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(3000)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": sentences(rng, vocab, words_per_doc)}) + "\n" for _ in range(docs))
    return f"jsonl:{path.parent}/*.jsonl"


def write_tokenizer(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    train_bpe(iter(["some words to merge, some more words"] * 20), 300, show_progress=False).save(str(path))
    return str(path)


CLEAN = ["--workers", "0", "--quality", "none", "--quiet"]


# ---- --out must not be, contain or lie inside an input ------------------------------------------

def commands(src: str, out: Path, tok: str) -> dict[str, list]:
    return {"clean": ["clean", src, "--out", out, *CLEAN],
            "prepare": ["prepare", src, "--tokenizer", tok, "--seq-len", "32", "--out", out, "--quiet"],
            "train-tokenizer": ["train-tokenizer", src, "--vocab-size", "300", "--out", out, "--quiet"]}


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
@pytest.mark.parametrize("command", ["clean", "prepare", "train-tokenizer"])
def test_out_overlapping_an_input_is_refused_and_the_input_is_intact(tmp_path, command, where):
    """The input is a previous clean output (part-00000.jsonl, report.json): the old clean deleted
    those names in --out before writing, so --out equal to the input destroyed it and exited 0."""
    data = tmp_path / "data"
    src = write_corpus(data / "clean" / "part-00000.jsonl", 20)
    (data / "clean" / "report.json").write_text("{}")
    tok = write_tokenizer(tmp_path / "tok" / "tokenizer.json")
    out = {"equal": data / "clean", "inside": data / "clean" / "sub", "containing": data}[where]
    if command == "train-tokenizer":  # its --out is a file: the input file itself, or beside it
        if where != "inside":
            src = f"jsonl:{data / 'clean' / 'part-00000.jsonl'}"
        out = {"equal": data / "clean" / "part-00000.jsonl", "inside": data / "clean" / "tokenizer.json",
               "containing": data / "clean"}[where]
    before = tree(tmp_path)
    rc, _, err = cli(*commands(src, out, tok)[command])
    assert rc == 2
    relation = {"equal": " is the input", "inside": " lies inside the input", "containing": " contains the input"}
    line = one_error_line(err, f"python -m maxlm.data {command}: error: --out {out}")
    assert relation[where] in line and str(data / "clean") in line
    assert tree(tmp_path) == before  # sha256 of every input file, and nothing added


def test_prepare_refuses_a_tokenizer_inside_its_out(tmp_path):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 20)
    tok = write_tokenizer(tmp_path / "packed" / "tokenizer.json")
    rc, _, err = cli("prepare", src, "--tokenizer", tok, "--seq-len", "32", "--out", tmp_path / "packed", "--quiet")
    assert rc == 2
    one_error_line(err, "contains the input", "(--tokenizer)")


# ---- atomic outputs: whole or nothing, replaced only with --overwrite ---------------------------

def hidden_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("command", ["clean", "prepare", "train-tokenizer"])
def test_rerun_refuses_a_finished_output_unless_overwrite(tmp_path, command):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 40)
    tok = write_tokenizer(tmp_path / "tok" / "tokenizer.json")
    out = tmp_path / "out" / ("tokenizer.json" if command == "train-tokenizer" else "result")
    args = commands(src, out, tok)[command]
    assert cli(*args)[0] == 0
    before = tree(tmp_path / "out")
    rc, _, err = cli(*args)
    assert rc == 2 and tree(tmp_path / "out") == before
    one_error_line(err, "already", "pass --overwrite to replace it")
    limit = ["--max-docs", "20"] if command == "train-tokenizer" else ["--limit", "20"]
    assert cli(*args, "--overwrite", *limit)[0] == 0
    assert tree(tmp_path / "out") != before and not hidden_leftovers(tmp_path / "out")
    if command != "train-tokenizer":  # a directory holding anything else is never replaced
        (out / "notes.txt").write_text("mine")
        before = tree(tmp_path / "out")
        rc, _, err = cli(*args, "--overwrite")
        assert rc == 2 and tree(tmp_path / "out") == before
        one_error_line(err, "holds files this command did not write (notes.txt)")


def test_a_failing_rerun_leaves_the_previous_output_and_no_temporary(tmp_path, monkeypatch):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 40)
    out = tmp_path / "out" / "clean"
    clean.clean(src, str(out), clean.CleanOptions(quality=clean.quality.PRESETS["none"]), progress=False)
    before = tree(tmp_path / "out")
    calls = []

    def failing_write(self, doc_id, text):
        calls.append(doc_id)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        return original(self, doc_id, text)
    original = clean._Writer.write
    monkeypatch.setattr(clean._Writer, "write", failing_write)
    rc, _, err = cli("clean", src, "--out", out, "--overwrite", *CLEAN)
    assert rc == 2 and len(calls) == 7
    one_error_line(err, "No space left on device")
    assert tree(tmp_path / "out") == before  # the old output whole, no temporary left behind


def test_train_tokenizer_that_fails_keeps_the_old_tokenizer(tmp_path):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 30)
    out = tmp_path / "tok" / "tokenizer.json"
    assert cli("train-tokenizer", src, "--vocab-size", "300", "--out", out, "--quiet")[0] == 0
    before = tree(tmp_path / "tok")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"body": "no text field"}\n' * 3)
    rc, _, err = cli("train-tokenizer", f"jsonl:{bad}/*.jsonl", "--vocab-size", "300", "--out", out,
                     "--overwrite", "--quiet")
    assert rc == 2
    one_error_line(err, "no readable document")
    assert tree(tmp_path / "tok") == before


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_runs_are_cleaned_or_restored_and_a_live_writer_is_respected(tmp_path):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 30)
    parent = tmp_path / "out"
    out = parent / "clean"
    assert cli("clean", src, "--out", out, *CLEAN)[0] == 0
    finished = tree(out)
    # A killed --overwrite run that had set the old output aside: the next run puts it back.
    os.rename(out, parent / f".clean.old-{dead_pid()}")
    (parent / f".clean.tmp-{dead_pid()}" / "audit").mkdir(parents=True)  # a killed run's half output
    rc, _, err = cli("clean", src, "--out", out, *CLEAN)
    assert rc == 2 and "already holds a finished clean output" in err
    assert tree(out) == finished and not hidden_leftovers(parent)
    # Another run writing the same output now: refused, its temporary untouched.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = parent / f".clean.tmp-{sleeper.pid}"
        busy.mkdir()
        rc, _, err = cli("clean", src, "--out", out, "--overwrite", *CLEAN)
        assert rc == 2 and busy.is_dir() and tree(out) == finished
        one_error_line(err, f"another run (pid {sleeper.pid}) is writing {out}")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert cli("clean", src, "--out", out, "--overwrite", *CLEAN)[0] == 0
    assert not hidden_leftovers(parent)


def test_prepare_and_training_refuse_an_unfinished_clean_output(tmp_path):
    """What the old clean left when killed: shards and audit/, no report.json."""
    half = tmp_path / "clean" / "web"
    write_corpus(half / "part-00000.jsonl", 30)
    (half / "audit").mkdir()
    (half / "audit" / "dropped.jsonl").write_text("")
    for spec in (f"jsonl:{half}/*.jsonl", f"jsonl:{tmp_path}/clean/*/*.jsonl"):
        rc, _, err = cli("prepare", spec, "--seq-len", "32", "--out", tmp_path / "packed", "--quiet")
        assert rc == 2
        one_error_line(err, f"{half} is an unfinished `clean` output", "no report.json")
        with pytest.raises(ValueError, match="unfinished `clean` output") as exc:
            make_train_iterator(DataConfig(source=spec), seq_len=32, global_batch=2)
        assert "\n" not in str(exc.value)
    assert not (tmp_path / "packed").exists()


def start_clean(src: str, out: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "maxlm.data", "clean", src, "--out", str(out), *CLEAN,
                             "--docs-per-shard", "100", *extra], env=ENV, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_at(proc: subprocess.Popen, tmp: Path, delay: float, after_start: bool) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after it starts, or after its temporary output ``tmp``
    appears; False when it had exited by then."""
    t0 = time.monotonic()
    if after_start:
        while not tmp.exists() and proc.poll() is None:
            time.sleep(0.005)
        t0 = time.monotonic()
    while time.monotonic() - t0 < delay and proc.poll() is None:
        time.sleep(0.005)
    exited = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return not exited


def prepare_refuses(spec: str, out: Path) -> bool:
    rc, _, err = cli("prepare", spec, "--seq-len", "64", "--out", out, "--quiet")
    assert "Traceback" not in err
    return rc == 2 and not out.exists()


def content(out: Path) -> dict[str, str]:
    """A clean output's files, but for report.json (it holds timings)."""
    return {k: v for k, v in tree(out).items() if k != "report.json"}


@pytest.mark.slow
def test_clean_killed_at_random_points_never_leaves_an_output_that_prepare_accepts(tmp_path):
    """Must show: a `clean` killed at random points (at least 5 kills) never leaves an output that
    `prepare` accepts as complete. Half the kills come at random times from the start, half at
    random times once the output is being written; a run then completes over the leftovers, and
    kills of an --overwrite rerun leave the previous output whole."""
    rng = random.Random(20240611)
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 1500, words_per_doc=100)
    parent = tmp_path / "clean"
    parent.mkdir()
    t0 = time.monotonic()
    assert start_clean(src, tmp_path / "reference").wait(timeout=300) == 0
    took, reference = time.monotonic() - t0, content(tmp_path / "reference")
    out, kills, mid_write = parent / "web", 0, 0
    for attempt in range(24):
        if kills >= 6 and mid_write >= 3:
            break
        after_start = attempt % 2 == 1
        delay = rng.uniform(0.05, 0.9) * took * (0.5 if after_start else 1.0)
        proc = start_clean(src, out)
        killed = kill_at(proc, parent / f".web.tmp-{proc.pid}", delay, after_start)
        if out.exists() and (out / "report.json").exists():  # published before the kill: whole
            assert content(out) == reference
            shutil.rmtree(out)
            continue
        assert killed
        kills += 1
        mid_write += (parent / f".web.tmp-{proc.pid}").exists()
        assert not out.exists()
        assert prepare_refuses(f"jsonl:{out}/*.jsonl", tmp_path / "p")
        assert prepare_refuses(f"jsonl:{parent}/*/*.jsonl", tmp_path / "p")  # globs skip temporaries
        for tmp in parent.glob(".web.tmp-*"):  # named directly, a temporary is refused too
            assert prepare_refuses(f"jsonl:{tmp}/*.jsonl", tmp_path / "p"), tmp.name
    assert kills >= 5 and mid_write >= 3, (kills, mid_write)
    assert start_clean(src, out).wait(timeout=300) == 0
    assert not hidden_leftovers(parent)  # the killed runs' temporaries are gone
    assert content(out) == reference
    finished = tree(out)
    assert cli("prepare", f"jsonl:{out}/*.jsonl", "--seq-len", "64", "--out", tmp_path / "p", "--quiet")[0] == 0
    for _ in range(3):  # an --overwrite rerun killed while it writes: the old output stays whole
        proc = start_clean(src, out, "--overwrite", "--limit", "1000")
        kill_at(proc, parent / f".web.tmp-{proc.pid}", rng.uniform(0.05, 0.9) * took * 0.5, True)
        if tree(out) == finished:
            continue
        if not out.exists():  # killed between its two renames: set aside, the next run restores it
            assert any(parent.glob(".web.old-*")), "the old output was lost"
            continue
        assert json.loads((out / "report.json").read_text())["output"]["docs"] == 1000  # the new, whole
        finished = tree(out)
    print(f"clean killed {kills} times ({mid_write} while writing), then 3 killed --overwrite reruns: "
          "prepare refused every leftover")


# ---- compressed sources, byte-order marks, CRLF, invalid UTF-8 ---------------------------------

ROWS = [{"text": f"document {i}: " + "plain words in a row " * 8} for i in range(6)]


def jsonl_bytes(rows, newline=b"\n") -> bytes:
    return b"".join(json.dumps(r).encode() + newline for r in rows)


def cleaned_texts(out: Path) -> list[str]:
    return [json.loads(line)["text"] for p in sorted(out.glob("part-*.jsonl")) for line in p.read_text().splitlines()]


def test_gzip_jsonl_and_text_files_are_decompressed(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "plain.jsonl").write_bytes(jsonl_bytes(ROWS[:3]))
    (raw / "packed.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(ROWS[3:])))
    (raw / "broken.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(ROWS))[:40])  # truncated
    assert cli("clean", f"jsonl:{raw}/*", "--out", tmp_path / "c", *CLEAN)[0] == 0
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert report["stages"][0]["in"] == 6 and report["output"]["docs"] == 6
    assert report["listing"]["counts"] == {"unreadable": 1}  # the truncated file, counted
    assert "corrupt gz data" in report["listing"]["examples"]["unreadable"][0]
    assert sorted(cleaned_texts(tmp_path / "c")) == sorted(r["text"].strip() for r in ROWS)
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt.gz").write_bytes(gzip.compress(b"\xef\xbb\xbfhello from a gzipped text file"))
    src = sources.open_source(f"files:{files}/*.gz")
    assert src.read(0).text == "hello from a gzipped text file"  # decompressed, BOM dropped


def test_zstd_jsonl_is_decompressed_or_names_the_missing_package(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    zst = raw / "web.jsonl.zst"
    try:
        import zstandard
        packed = zstandard.ZstdCompressor().compress(jsonl_bytes(ROWS))
        zst.write_bytes(packed)
        (raw / "cut.jsonl.zst").write_bytes(packed[:len(packed) // 2])  # truncated: counted, not silent
        src = sources.open_source(f"{raw}/*.jsonl.zst")
        assert [src.read(i).text for i in range(len(src))] == [r["text"] for r in ROWS]
        assert src.problems.counts == {"unreadable": 1} and "truncated" in src.problems.examples["unreadable"][0]
    except ImportError:
        zst.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 16)  # a zstd frame header
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if it were not installed
    rc, _, err = cli("clean", str(zst), "--out", tmp_path / "c", *CLEAN)
    assert rc == 2 and not (tmp_path / "c").exists()
    one_error_line(err, str(zst), "pip install zstandard")


def test_bom_crlf_and_invalid_utf8_lines(tmp_path):
    """The first record behind a byte-order mark is kept; CRLF works; invalid UTF-8 lines are kept
    (U+FFFD), counted and listed with their line numbers in the report and one summary line."""
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [json.dumps(r).encode() for r in ROWS]
    lines[2] = lines[2].replace(b"plain", b"pl\xe9in", 1)  # Latin-1 byte
    lines[4] = lines[4].replace(b"words", b"wo\xff\xferds", 1)
    (raw / "web.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n")
    for command in (["clean", f"jsonl:{raw}/*.jsonl", "--out", tmp_path / "c", *CLEAN],
                    ["prepare", f"jsonl:{raw}/*.jsonl", "--seq-len", "64", "--out", tmp_path / "p", "--quiet"],
                    ["train-tokenizer", f"jsonl:{raw}/*.jsonl", "--vocab-size", "300", "--out",
                     tmp_path / "t" / "tokenizer.json", "--quiet"]):
        rc, printed, err = cli(*command)
        assert rc == 0, err
        summary = [line for line in printed.splitlines() if "invalid UTF-8" in line]
        assert len(summary) == 1 and "web.jsonl:3, web.jsonl:5" in summary[0], printed
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert report["stages"][0]["dropped"] == {} and report["output"]["docs"] == 6
    assert report["invalid_utf8"]["where"] == ["web.jsonl:3", "web.jsonl:5"]
    assert report["invalid_utf8"]["docs"] == 2
    for name in ("p/report.json", "t/tokenizer.report.json"):
        assert json.loads((tmp_path / name).read_text())["invalid_utf8"]["where"] == ["web.jsonl:3", "web.jsonl:5"]
    texts = cleaned_texts(tmp_path / "c")
    assert texts[0].startswith("document 0") and "\ufffd" in texts[2] and "\r" not in "".join(texts)


def test_json_escaped_lone_surrogates_are_replaced_not_a_crash(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "web.jsonl").write_text('{"text": "half a pair \\ud800 then more words"}\n' * 3 + jsonl_bytes(ROWS).decode())
    rc, printed, err = cli("train-tokenizer", f"jsonl:{raw}/*.jsonl", "--vocab-size", "300", "--out",
                           tmp_path / "t.json", "--quiet")
    assert rc == 0, err
    assert "3 document(s) replaced by U+FFFD" in printed


# ---- numeric options: one line naming the option, the value and what is allowed ----------------

@pytest.mark.parametrize("args,fragment", [
    (["clean", "--shingle", "0"], "argument --shingle: '0' is not allowed: give an integer >= 1"),
    (["clean", "--num-perm", "8"], "argument --num-perm: '8' is not allowed: give an integer >= 16"),
    (["clean", "--near-threshold", "0"], "argument --near-threshold: '0' is not allowed: give a number > 0 and <= 1"),
    (["clean", "--near-threshold", "1.5"], "argument --near-threshold: '1.5' is not allowed"),
    (["clean", "--workers", "-1"], "argument --workers: '-1' is not allowed: give an integer >= 0"),
    (["clean", "--docs-per-shard", "0"], "argument --docs-per-shard: '0' is not allowed: give an integer >= 1"),
    (["clean", "--limit", "-5"], "argument --limit: '-5' is not allowed: give an integer >= 0"),
    (["clean", "--perplexity-drop", "100"], "argument --perplexity-drop: '100' is not allowed"),
    (["clean", "--set", "min_words=-3"], "quality setting min_words='-3' is out of range"),
    (["prepare", "--seq-len", "1"], "argument --seq-len: '1' is not allowed: give an integer >= 2"),
    (["prepare", "--eval-fraction", "1"], "argument --eval-fraction: '1' is not allowed: give a number >= 0 and < 1"),
    (["train-tokenizer", "--vocab-size", "100"], "argument --vocab-size: '100' is not allowed: give an integer >= 259"),
    (["train-tokenizer", "--min-frequency", "0"], "argument --min-frequency: '0' is not allowed"),
])
def test_numeric_options_are_validated_in_one_line(tmp_path, args, fragment):
    src = write_corpus(tmp_path / "raw" / "web.jsonl", 10)
    base = {"clean": ["--out", tmp_path / "o", "--workers", "0", "--quiet"],
            "prepare": ["--out", tmp_path / "o", "--seq-len", "32", "--quiet"],
            "train-tokenizer": ["--out", tmp_path / "o.json", "--vocab-size", "300", "--quiet"]}[args[0]]
    rc, _, err = cli(args[0], src, *base, *args[1:])
    assert rc == 2 and not (tmp_path / "o").exists() and not (tmp_path / "o.json").exists()
    one_error_line(err, f"python -m maxlm.data {args[0]}: error: ", fragment)


# ---- empty sources: one line naming the source, in the commands and in training -----------------

def empty_sources(root: Path) -> dict[str, str]:
    (root / "empty").mkdir()
    (root / "empty" / "a.txt").write_bytes(b"")
    (root / "empty" / "b.jsonl").write_bytes(b"")
    (root / "blank").mkdir()
    (root / "blank" / "a.jsonl").write_bytes(b"\n  \n\r\n\n")
    (root / "gz").mkdir()
    (root / "gz" / "a.jsonl.gz").write_bytes(gzip.compress(b"\n\n"))
    return {"nothing": f"jsonl:{root}/nowhere/*.jsonl", "empty files": f"files:{root}/empty/*",
            "empty jsonl": f"jsonl:{root}/empty/*.jsonl", "blank lines": f"jsonl:{root}/blank/*.jsonl",
            "blank gz": f"{root}/gz/*.jsonl.gz"}


def test_empty_sources_are_one_clear_line_in_commands_and_training(tmp_path):
    for what, spec in empty_sources(tmp_path).items():
        for command in (["clean", spec, "--out", tmp_path / "c", *CLEAN],
                        ["prepare", spec, "--seq-len", "32", "--out", tmp_path / "p", "--quiet"],
                        ["train-tokenizer", spec, "--vocab-size", "300", "--out", tmp_path / "t.json", "--quiet"]):
            rc, _, err = cli(*command)
            assert rc == 2, (what, command[0])
            line = one_error_line(err, repr(spec))
            assert "matched no readable files" in line or "holds no documents" in line, line
        cfg = DataConfig(source=spec)
        for make, kwargs in ((make_train_iterator, {}), (make_eval_batches, {"num_batches": 1})):
            with pytest.raises(ValueError) as exc:
                make(cfg, seq_len=32, global_batch=2, **kwargs)
            assert "\n" not in str(exc.value) and repr(spec) in str(exc.value), what
    assert not any((tmp_path / name).exists() for name in ("c", "p", "t.json"))


# ---- fuzz: every option of every command, bad values rejected cleanly ---------------------------

INT, FLOAT = "int", "float"
# (option, kind, low, high, low open, high open) for every numeric option.
MAX_DOC_BYTES = ("--max-doc-bytes", INT, 1, 1 << 40, False, False)
NUMERIC = {
    "clean": [("--near-threshold", FLOAT, 0, 1, True, False), ("--num-perm", INT, 16, 1024, False, False),
              ("--shingle", INT, 1, 100, False, False), ("--perplexity-drop", FLOAT, 0, 100, False, True),
              ("--perplexity-tokens", INT, 2, 1 << 20, False, False), MAX_DOC_BYTES,
              ("--workers", INT, 0, 256, False, False), ("--docs-per-shard", INT, 1, None, False, False),
              ("--limit", INT, 0, None, False, False)],
    "prepare": [("--seq-len", INT, 2, 1 << 20, False, False), ("--eval-fraction", FLOAT, 0, 1, False, True),
                ("--rows-per-shard", INT, 0, 1 << 24, False, False), MAX_DOC_BYTES,
                ("--limit", INT, 0, None, False, False)],
    "train-tokenizer": [("--vocab-size", INT, 259, 1 << 24, False, False),
                        ("--min-frequency", INT, 1, None, False, False),
                        ("--max-docs", INT, 0, None, False, False), MAX_DOC_BYTES],
}


def numeric_values(rng: random.Random, kind, lo, hi, lo_open, hi_open) -> list[str]:
    """Out-of-range, wrong-type and empty values for one option (a few drawn from rng)."""
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
    bad = ["", " ", letters, "1,000", "0x10", "--"]
    if kind == INT:
        bad += [str(lo - 1), str(rng.randint(-10**9, lo - 1)), f"{lo + 0.5}", "1e3", "nan"]
        bad += [str(hi + 1), str(rng.randint(hi + 1, hi * 1000)), "1" + "0" * 400] if hi is not None else []
    else:
        bad += [str(lo) if lo_open else str(lo - 1e-3), str(rng.uniform(-1e6, lo - 1e-9))]
        bad += ["nan", "inf", "-inf", "1e400"]
        bad += [str(hi) if hi_open else str(hi + 1e-3), str(rng.uniform(hi + 1e-6, hi * 1e6))]
    return bad


def fuzz_cases(w: dict, rng: random.Random) -> dict[str, list[list[str]]]:
    """Each command's valid base invocation with one option made bad (or one unknown option)."""
    root, raw = w["root"], w["raw"]
    bad_sources = ["", "   ", "s3:bucket/x", f"jsonl:{root}/nowhere/*.jsonl", f"packed:{w['packed']}",
                   "files:", f"files:{root}/emptyfiles/*", f"jsonl:{root}/blank/*.jsonl", "parquet:"]
    dir_outs = ["", str(w["afile"]), str(raw), str(raw / "sub"), str(root), str(w["other"]), ".."]
    cases = {}
    for command, base in w["base"].items():
        variants = [[command, s, *base[2:]] for s in bad_sources]
        for option, *spec in NUMERIC[command]:
            variants += [[*base, f"{option}={value}"] for value in numeric_values(rng, *spec)]
        outs = dir_outs if command != "train-tokenizer" else ["", str(w["other"]), str(raw / "tok.json"),
                                                               str(raw / "web.jsonl"), str(raw)]
        variants += [[*base, f"--out={o}"] for o in outs]
        variants += [[*base, "--bogus=1"], [*base, "--quiet=yes"]]
        cases[command] = variants
    cases["clean"] += [[*w["base"]["clean"], f"--quality={q}"] for q in ("", "bogus", "WEB")]
    cases["clean"] += [[*w["base"]["clean"], f"--set={s}"] for s in (
        "", "=", "=3", "min_words", "min_words=", "min_words=abc", "min_words=-3", "min_words=1.5",
        "max_symbol_ratio=nan", "max_symbol_ratio=inf", "nope=1", "remove_boilerplate=maybe",
        "top_ngram_chars=2:1.5", "top_ngram_chars=0:0.1", "top_ngram_chars=x", f"min_words={rng.randint(-99, -1)}")]
    cases["clean"] += [[*w["base"]["clean"], f"--perplexity-run={p}"]
                       for p in (str(root / "nowhere"), str(w["afile"]), str(w["other"]))]
    cases["prepare"] += [[*w["base"]["prepare"], f"--tokenizer={t}"]
                         for t in ("", "bytes", str(root / "missing.json"), str(w["afile"]), str(w["other"]))]
    cases["prepare"] += [[*w["base"]["prepare"], "--rows-per-shard=16777216"]]  # x seq-len: too big a shard
    return cases


def fuzz_workspace(root: Path) -> dict:
    raw = root / "raw"
    src = write_corpus(raw / "web.jsonl", 30)
    tok = write_tokenizer(root / "tok" / "tokenizer.json")
    (root / "emptyfiles").mkdir()
    (root / "emptyfiles" / "a.txt").write_bytes(b"")
    (root / "blank").mkdir()
    (root / "blank" / "a.jsonl").write_text("\n\n")
    (root / "other").mkdir()
    (root / "other" / "mine.txt").write_text("not an output")
    (root / "afile.txt").write_text("a file")
    out = root / "out"
    base = {"clean": ["clean", src, f"--out={out / 'clean'}", "--overwrite", *CLEAN],
            "prepare": ["prepare", src, f"--tokenizer={tok}", "--seq-len=32", f"--out={out / 'packed'}",
                        "--overwrite", "--quiet"],
            "train-tokenizer": ["train-tokenizer", src, "--vocab-size=300", f"--out={out / 'tok.json'}",
                                "--overwrite", "--quiet"]}
    for args in base.values():  # finished outputs that no rejected invocation may touch
        assert cli(*args)[0] == 0
    return {"root": root, "raw": raw, "base": base, "packed": out / "packed", "afile": root / "afile.txt",
            "other": root / "other"}


def test_fuzz_data_commands_reject_bad_values_cleanly(tmp_path, monkeypatch):
    """Seeded, table-driven: for each command and option, out-of-range, wrong-type and empty values
    (and bad sources, paths and unknown options). Each is rejected: non-zero exit, at most 3 lines
    on stderr, no traceback, and every file under the inputs and outputs unchanged (nothing added)."""
    monkeypatch.chdir(tmp_path)  # relative --out values ("..") land here
    work = tmp_path / "w"
    work.mkdir()
    w = fuzz_workspace(work)
    cases = fuzz_cases(w, random.Random(7))
    before = tree(tmp_path)
    for variants in cases.values():
        for args in variants:
            rc, _, err = cli(*args)
            lines = [line for line in err.splitlines() if line.strip()]
            assert rc not in (0, None) and len(lines) <= 3 and "Traceback" not in err, (args, rc, err)
            assert tree(tmp_path) == before, args
    counts = {command: len(variants) for command, variants in cases.items()}
    print(f"fuzz: clean {counts['clean']} inputs, prepare {counts['prepare']}, "
          f"train-tokenizer {counts['train-tokenizer']}; all rejected cleanly")
    assert min(counts.values()) >= 20
