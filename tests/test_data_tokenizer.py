"""Tokenizers: a BPE trained with Hugging Face tokenizers behaves like the byte tokenizer, in any language."""

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import SPECIAL_TOKENS, BPETokenizer, ByteTokenizer, check_vocab, get_tokenizer
from maxlm.data.__main__ import main as data_main
from maxlm.data.tokenizer import train_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。我们今天讨论语言模型。" * 3,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
    "Mixed 中英文 text with numbers 12345 and emoji 🙂🚀 and accents: naïve café.",
]
SAMPLES = ["", "hello world", "你好，世界！", "  leading spaces\tand\ttabs\n\n", "emoji 🙂 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
           "x = [i**2 for i in range(10)]  # code", "Ünïcödé ßtraße", "\ufffd replacement", "日本語とかな"]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    tok = train_bpe(iter(CORPUS * 20), vocab_size=400, show_progress=False)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_bpe_has_the_byte_tokenizer_interface(bpe_path):
    bpe, byte = get_tokenizer(bpe_path), ByteTokenizer()
    assert isinstance(bpe, BPETokenizer)
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)  # special tokens are defined once, first
    assert bpe.vocab_size == 400 and byte.vocab_size == 259
    for tok in (bpe, byte):
        for text in SAMPLES:
            ids = tok.encode(text)
            assert ids.dtype == np.int32 and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            bare = tok.encode(text, add_bos=False, add_eos=False)
            assert np.array_equal(ids[1:-1], bare)
            assert tok.decode(ids) == text, (tok, text)  # byte-level: every string round-trips
        assert tok.decode([tok.pad_id, *tok.encode("hi", False, False), tok.vocab_size + 5, tok.eos_id]) == "hi"
        batch = tok.encode_batch(SAMPLES)
        assert all(np.array_equal(a, tok.encode(t)) for a, t in zip(batch, SAMPLES))


def test_bpe_compresses_english_chinese_and_code(bpe_path):
    bpe = get_tokenizer(bpe_path)
    for text in CORPUS[:3]:  # English, Chinese, code
        assert len(bpe.encode(text)) < 0.5 * len(text.encode("utf-8")), text[:20]


def test_bpe_file_carries_specials_and_bos_post_processor(bpe_path):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(bpe_path)
    assert [raw.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert raw.encode("hi").ids[0] == 0  # consumers (vLLM, transformers) get bos prepended
    assert get_tokenizer(bpe_path).encode("hi", add_bos=True).tolist().count(0) == 1  # never doubled


def test_bpe_pickles_for_worker_processes(bpe_path):
    bpe = get_tokenizer(bpe_path)
    again = pickle.loads(pickle.dumps(bpe))
    assert again.fingerprint == bpe.fingerprint and again.vocab_size == bpe.vocab_size
    assert np.array_equal(again.encode(CORPUS[1]), bpe.encode(CORPUS[1]))
    assert get_tokenizer(bpe_path) is bpe  # cached while the file is unchanged


def test_check_vocab(bpe_path, tmp_path):
    check_vocab(DataConfig(tokenizer=bpe_path), 400)
    check_vocab(DataConfig(), 259)
    with pytest.raises(ValueError) as err:
        check_vocab(DataConfig(tokenizer=bpe_path), 259)
    text = str(err.value)
    assert "\n" not in text and "has 400 tokens but ModelConfig.vocab_size = 259" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        get_tokenizer(str(bad))
    with pytest.raises(ValueError, match="is below 259"):
        train_bpe(iter(["abc"]), vocab_size=100, show_progress=False)


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i, text in enumerate(CORPUS * 10):
            f.write(json.dumps({"text": f"{i} {text}"}, ensure_ascii=False) + "\n")
        f.write("{broken\n")
    out = tmp_path / "tok" / "tokenizer.json"
    assert data_main(["train-tokenizer", f"jsonl:{corpus}", "--vocab-size", "1000", "--out", str(out),
                      "--quiet"]) == 0
    assert "(asked for 1,000: the corpus has no more merges" in capsys.readouterr().out
    assert data_main(["train-tokenizer", f"jsonl:{corpus}", "--vocab-size", "400", "--out", str(out),
                      "--overwrite", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "vocab 400 tokens (bos 0, eos 1, pad 2)" in printed and "malformed_json 1" in printed
    report = json.loads((tmp_path / "tok" / "tokenizer.report.json").read_text())
    assert report["docs"] == 40 and report["bad_input"]["counts"] == {"malformed_json": 1}
    assert report["sample_round_trips"] == report["sample_docs"] == 40
    assert report["sample_bytes_per_token"] > 2.0
    assert get_tokenizer(str(out)).vocab_size == 400


@pytest.mark.parametrize("command", [["clean"], ["train-tokenizer"], ["prepare"]])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        data_main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "examples:" in out and "usage: python -m maxlm.data" in out


def test_cli_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "maxlm.data", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "clean,train-tokenizer,prepare" in proc.stdout and "examples" in proc.stdout
