"""Data pipeline on raw sources: byte tokenizer, file sources, packing invariants, determinism,
process sharding, exact resumption and the held-out split. (More in tests/test_data_*.py.)"""

import json
import os
import re

import grain
import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import ByteTokenizer, get_tokenizer, make_eval_batches, make_train_iterator
from maxlm.data import pipeline, sources

TOK = ByteTokenizer()
KEYS = {"inputs", "targets", "segment_ids", "positions", "weights"}


@pytest.fixture
def corpus(tmp_path):
    """24 small documents, each naming itself, in nested folders; returns the glob."""
    for i in range(24):
        folder = tmp_path / "corpus" / f"part{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i:02d}.txt").write_text(f"<doc{i:02d}> " + "x" * (5 + 7 * i))
    return str(tmp_path / "corpus" / "**" / "*.txt")


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def doc_names(batches):
    """Document markers in stream order (train rows are packed back to back, never padded)."""
    stream = np.concatenate([row for b in batches for row in b["inputs"]])
    return re.findall(r"<(doc\d+)>", TOK.decode(stream))


def test_tokenizer_round_trip():
    for text in ["", "hello world", "你好，世界", "mixed: naïve café 🙂"]:
        ids = TOK.encode(text)
        assert ids.dtype == np.int32 and ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
        assert len(TOK.encode(text, add_bos=False, add_eos=False)) == len(text.encode("utf-8"))
        assert TOK.decode(ids) == text
    bad = TOK.encode(b"ok\xff\xfe!", add_bos=False, add_eos=False)
    assert bad.tolist() == [111, 107, 255, 254, 33]
    assert TOK.decode(bad) == "ok\ufffd\ufffd!"
    assert TOK.decode([TOK.pad_id, 104, 300, 105, TOK.eos_id]) == "hi"  # specials and ids >= 256 drop
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id, TOK.vocab_size) == (256, 257, 258, 259)


def test_get_tokenizer():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="'bpe' is neither 'byte' nor an existing tokenizer.json") as err:
        get_tokenizer("bpe")
    assert "\n" not in str(err.value)


def test_stdlib_source_and_split():
    files = sources.get_source("stdlib")
    assert len(files) > 500 and list(files.relpaths) == sorted(files.relpaths)
    for rel in files.relpaths:
        parts = set(rel.split(os.sep))
        assert not parts & {"site-packages", "dist-packages", "__pycache__"}, rel
    assert any(rel == "os.py" for rel in files.relpaths)
    assert repr(files) == repr(sources.get_source("stdlib"))
    train, held = sources.split(files, 0.02)
    assert not set(train.relpaths) & set(held.relpaths)
    assert len(train) + len(held) == len(files)
    assert 0.005 < len(held) / len(files) < 0.05
    assert sources.split(files, 0.02)[1].relpaths == held.relpaths


def test_glob_source(corpus, tmp_path, monkeypatch):
    files = sources.get_source(corpus)
    assert len(files) == 24 and files.relpaths[0] == os.path.join("part0", "doc00.txt")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sources.get_source("~/corpus/**/*.txt").relpaths == files.relpaths
    train, held = sources.split(files, 0.0)  # even a zero fraction holds one document out
    assert len(held) == 1 and len(train) == 23
    missing = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match="matched no") as err:
        sources.get_source("files:" + missing)
    assert missing in str(err.value) and "\n" not in str(err.value)


def test_undecodable_file_is_read_not_fatal(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 \xff\xfe end")
    (tmp_path / "good.txt").write_text("fine")
    files = sources.get_source(str(tmp_path / "*.txt"))
    assert files[0] == "caf\ufffd \ufffd\ufffd end"
    assert files.read(0).replaced == 3
    batches = make_eval_batches(DataConfig(source=str(tmp_path / "*.txt")), seq_len=8,
                                global_batch=2, num_batches=2)
    assert len(batches) == 2


def test_batch_format_and_packing_invariants(corpus):
    for source, seq_len in [("stdlib", 128), (corpus, 64)]:
        it = make_train_iterator(DataConfig(source=source), seq_len=seq_len, global_batch=4)
        for batch in take(it, 6):
            assert set(batch) == KEYS
            for key, value in batch.items():
                assert value.shape == (4, seq_len), key
                assert value.dtype == (np.float32 if key == "weights" else np.int32), key
            for i, t, s, p, w in zip(*(batch[k] for k in ("inputs", "targets", "segment_ids",
                                                          "positions", "weights"))):
                starts = np.r_[True, s[1:] != s[:-1]]
                assert s[0] == 1 and set(np.diff(s)) <= {0, 1}  # pieces numbered 1, 2, 3 ...
                assert np.array_equal(p, np.arange(seq_len) - np.maximum.accumulate(
                    np.where(starts, np.arange(seq_len), 0)))
                assert np.all(p[i == TOK.bos_id] == 0)  # a document starts a piece
                ends = np.r_[s[1:] != s[:-1], True]
                assert np.all(w[ends] == 0) and np.all(w[~ends] == 1)
                assert np.array_equal(t[:-1][w[:-1] == 1], i[1:][w[:-1] == 1])
                assert np.all(t[w == 0] == TOK.pad_id)


def test_packing_splits_long_documents_and_pads_the_tail():
    docs = grain.MapDataset.source(["ab", "cde", "0123456789" * 3])
    rows = list(pipeline._packed_docs(docs, TOK, seq_len=16).batch(1, drop_remainder=True))
    first = rows[0]
    assert first["inputs"][0, :9].tolist() == [256, 97, 98, 257, 256, 99, 100, 101, 257]
    assert first["segment_ids"][0].tolist() == [1] * 4 + [2] * 5 + [3] * 7
    assert first["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    last = rows[-1]
    pad = last["segment_ids"][0] == 0
    assert pad.any() and np.all(last["inputs"][0][pad] == TOK.pad_id)
    assert np.all(last["weights"][0][pad] == 0) and np.all(last["targets"][0][pad] == TOK.pad_id)
    stream = np.concatenate([r["inputs"][0] for r in rows])
    assert TOK.decode(stream) == "abcde" + "0123456789" * 3  # no token lost at the splits


def test_determinism_and_reshuffle_each_epoch(corpus):
    # The document order itself, without the row-window shuffle on top (tests/test_data_shuffle.py).
    run = lambda seed: take(make_train_iterator(DataConfig(source=corpus, seed=seed, shuffle_rows=0),
                                                seq_len=64, global_batch=4), 30)
    a, b, c = run(0), run(0), run(1)
    assert same(a, b) and not same(a, c)
    train, _ = sources.split(sources.get_source(corpus), 0.02)
    n = len(train)
    order = doc_names(a)
    assert len(order) >= 3 * n
    epochs = [order[k * n:(k + 1) * n] for k in range(3)]
    expected = sorted(re.search(r"doc\d+", p).group() for p in train.relpaths)
    assert all(sorted(e) == expected for e in epochs)  # each epoch visits every document once
    assert epochs[0] != epochs[1] != epochs[2]


def test_process_sharding_is_disjoint(corpus):
    seen = []
    for index in range(2):
        it = make_train_iterator(DataConfig(source=corpus, shuffle_rows=0), seq_len=64, global_batch=4,
                                 process_index=index, process_count=2)
        batches = take(it, 15)
        assert batches[0]["inputs"].shape == (2, 64)
        seen.append(set(doc_names(batches)))
    train, _ = sources.split(sources.get_source(corpus), 0.02)
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == len(train)
    with pytest.raises(ValueError, match="not divisible"):
        make_train_iterator(DataConfig(source=corpus), seq_len=64, global_batch=5, process_count=2)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_restores_exactly(corpus, prefetch):
    cfg = DataConfig(source=corpus, prefetch=prefetch)
    make = lambda: make_train_iterator(cfg, seq_len=64, global_batch=4)
    it = make()
    states, stream = [], []
    for _ in range(4):
        states.append(json.loads(json.dumps(it.get_state())))  # as grain's Orbax handler stores it
        stream.append(take(it, 5))
    for k, state in enumerate(states):
        resumed = make()
        resumed.set_state(state)
        assert same(take(resumed, 5 * (4 - k)), sum(stream[k:], []))


def test_state_restores_with_worker_processes(corpus):
    cfg = DataConfig(source=corpus, worker_count=2)
    it = make_train_iterator(cfg, seq_len=64, global_batch=4)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 6)
    it.close()
    resumed = make_train_iterator(cfg, seq_len=64, global_batch=4)
    resumed.set_state(state)
    assert same(take(resumed, 6), expected)
    resumed.close()


def test_eval_batches_fixed_and_held_out(corpus):
    cfg = DataConfig(source=corpus, eval_fraction=0.2)
    first = make_eval_batches(cfg, seq_len=32, global_batch=4, num_batches=3)
    assert len(first) == 3 and first[0]["inputs"].shape == (4, 32)
    assert same(first, make_eval_batches(cfg, seq_len=32, global_batch=4, num_batches=3))
    train = set(doc_names(take(make_train_iterator(cfg, seq_len=32, global_batch=4), 40)))
    assert not set(doc_names(first)) & train
    stdlib = make_eval_batches(DataConfig(), seq_len=128, global_batch=8, num_batches=2)
    assert same(stdlib, make_eval_batches(DataConfig(), seq_len=128, global_batch=8, num_batches=2))
