"""Packed shards, mixtures, the packing/loss invariant and exact resume with a fingerprinted state."""

import collections
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lm_loss, small_config

from maxlm import model
from maxlm.config import DataConfig
from maxlm.data import (
    DataStateMismatch,
    check_vocab,
    make_eval_batches,
    make_train_iterator,
    pipeline,
)
from maxlm.data.prepare import PackedRows, prepare

KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def write_docs(folder, letter, n, rng):
    """n documents made only of `letter` (so every token says which source it came from)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{letter}{i:03d}.txt").write_text(letter * int(rng.integers(5, 60)))
    return f"files:{folder}/*.txt"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Four single-letter corpora: a and b prepared into packed shards (seq 32), c and d raw files."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    specs = {}
    for letter in "abcd":
        specs[letter] = write_docs(root / letter, letter, 40, rng)
    for letter in "ab":
        prepare(specs[letter], str(root / f"packed_{letter}"), "byte", 32, eval_fraction=0.2,
                rows_per_shard=16, progress=False)
        specs[letter] = f"packed:{root / f'packed_{letter}'}"
    return specs


def test_prepare_layout_and_rows(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["ab", "cde", "0123456789" * 3, "xyz"]
    for i, t in enumerate(texts):
        (docs / f"{i}.txt").write_text(t)
    rep = prepare(f"files:{docs}/*.txt", str(tmp_path / "p"), "byte", 16, eval_fraction=0.0,
                  rows_per_shard=2, progress=False)
    assert rep["splits"]["train"] == {"rows": 3, "docs": 4, "tokens": 2 + 3 + 30 + 3 + 8, "pad_tokens": 2}
    index = json.loads((tmp_path / "p" / "index.json").read_text())
    assert [s["rows"] for s in index["splits"]["train"]["shards"]] == [2, 1]
    assert index["tokenizer"] == {"name": "byte", "fingerprint": "byte", "vocab_size": 259, "bos_id": 256,
                                  "eos_id": 257, "pad_id": 258}
    rows = PackedRows(str(tmp_path / "p"))
    first = rows[0]
    assert first["tokens"][:9].tolist() == [256, 97, 98, 257, 256, 99, 100, 101, 257]
    assert first["segments"].tolist() == [1] * 4 + [2] * 5 + [3] * 7
    assert first["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert rows[1]["segments"].tolist() == [1] * 16 and rows[1]["positions"].tolist() == list(range(16))
    last = rows[2]
    assert last["segments"].tolist()[-2:] == [0, 0] and last["tokens"].tolist()[-2:] == [258, 258]
    stream = np.concatenate([rows[i]["tokens"][rows[i]["segments"] > 0] for i in range(3)])
    assert stream[(stream < 256)].astype(np.uint8).tobytes().decode() == "".join(texts)  # nothing lost, nothing added
    # A run whose seq_len divides the prepared one trains on the same rows, cut.
    half = pipeline.SubRows(rows, 2)
    assert len(half) == 6 and half[0]["segments"].tolist() == [1] * 4 + [2] * 4
    assert half[1]["segments"].tolist() == [1] + [2] * 7  # pieces renumbered from 1 in each half
    assert half[1]["positions"].tolist() == [0] + list(range(7))


def test_packed_source_refuses_mismatches(corpora, tmp_path):
    with pytest.raises(ValueError, match="does not divide; re-run prepare with --seq-len 24"):
        make_train_iterator(DataConfig(source=corpora["a"]), seq_len=24, global_batch=2)
    tok = tmp_path / "tok.json"
    from maxlm.data.tokenizer import train_bpe
    train_bpe(iter(["some text"] * 10), 300, show_progress=False).save(str(tok))
    with pytest.raises(ValueError) as err:
        check_vocab(DataConfig(source=corpora["a"], tokenizer=str(tok)), 300)
    assert "was tokenized with 'byte' (byte), but DataConfig.tokenizer" in str(err.value)
    with pytest.raises(ValueError, match="no index.json there"):
        make_train_iterator(DataConfig(source=f"packed:{tmp_path}"), seq_len=32, global_batch=2)


def test_packing_loss_equals_token_weighted_mean_of_per_document_losses(corpora, tmp_path):
    """Must show: the loss of a packed batch equals the token-weighted mean of the losses of its
    documents computed one by one, so attention never crosses a document boundary."""
    rng = np.random.default_rng(3)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"{i}.txt").write_text("".join(rng.choice(list("abcdefgh "), int(rng.integers(3, 40)))))
    prepare(f"files:{docs}/*.txt", str(tmp_path / "packed"), "byte", 32, eval_fraction=0.0, progress=False)
    batch = next(make_train_iterator(DataConfig(source=f"packed:{tmp_path / 'packed'}"), seq_len=32,
                                     global_batch=8))
    assert (batch["segment_ids"].max(axis=1) >= 2).sum() >= 4  # rows hold several documents
    cfg = small_config(model=dict(max_seq_len=32), train=dict(seq_len=32))
    init = jax.jit(lambda: model.Transformer(cfg.model).init(jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32)))
    params = nn.unbox(init())["params"]
    loss_of = jax.jit(lambda p, b: lm_loss(cfg, p, b))
    loss_sum, weight = loss_of(params, {k: jnp.asarray(v) for k, v in batch.items()})
    packed_loss = float(loss_sum / weight)

    # Each document (piece) alone at the start of its own row: causality alone keeps the padding
    # after it invisible, so no segment ids are needed.
    rows = []
    for r in range(batch["inputs"].shape[0]):
        for s in np.unique(batch["segment_ids"][r]):
            mask = batch["segment_ids"][r] == s
            n = int(mask.sum())
            row = {k: np.zeros(32, np.float32 if k == "weights" else np.int32) for k in KEYS}
            row["inputs"][:n] = batch["inputs"][r][mask]
            row["targets"][:n] = batch["targets"][r][mask]
            row["weights"][:n] = batch["weights"][r][mask]
            row["positions"][:] = np.arange(32)
            row["segment_ids"][:] = 1
            rows.append(row)
    alone = {k: jnp.asarray(np.stack([row[k] for row in rows])) for k in KEYS}

    @jax.jit
    def per_document(p, b):
        logits, _ = model.Transformer(cfg.model).apply({"params": p}, b["inputs"], b["segment_ids"], b["positions"])
        return jax.vmap(lambda l, t, w: model.cross_entropy(l[None], t[None], w[None], cfg.model.vocab_size))(
            logits, b["targets"], b["weights"])
    sums, tokens = (np.asarray(x, np.float64) for x in per_document(params, alone))
    weighted_mean = float((sums / np.maximum(tokens, 1) * tokens).sum() / tokens.sum())
    print(f"packed loss {packed_loss:.6f}, token-weighted mean of {len(rows)} per-document losses "
          f"{weighted_mean:.6f}")
    assert tokens.sum() == float(weight)
    np.testing.assert_allclose(packed_loss, weighted_mean, rtol=1e-5)
    # The same batch with the document boundaries erased (one segment per row) gives another loss.
    leaky = {k: jnp.asarray(v) for k, v in batch.items()}
    leaky["segment_ids"] = jnp.ones_like(leaky["segment_ids"])
    leaked = loss_of(params, leaky)
    assert abs(float(leaked[0] / leaked[1]) - packed_loss) > 1e-3


def source_of_rows(batches):
    """The letter each row's document text is made of (rows never mix sources)."""
    letters = []
    for b in batches:
        for row in b["inputs"]:
            chars = set(row[row < 256].astype(np.uint8).tobytes().decode())
            assert len(chars) == 1, chars
            letters.append(chars.pop())
    return letters


def test_mixture_proportions_over_10k_sequences(corpora):
    """Must show: over 10k sampled sequences, each source's share is within 2% of its weight."""
    cfg = DataConfig(source="; ".join(corpora[k] for k in "abcd"), weights="0.6, 0.2, 0.1, 0.1",
                     eval_fraction=0.2)
    it = make_train_iterator(cfg, seq_len=32, global_batch=100)
    counts = collections.Counter(source_of_rows(take(it, 100)))
    it.close()
    shares = {k: counts[k] / 10_000 for k in "abcd"}
    print(f"mixture shares over 10,000 sequences: {shares}")
    for k, w in zip("abcd", (0.6, 0.2, 0.1, 0.1)):
        assert abs(shares[k] - w) <= 0.02, (k, shares[k], w)
    evals = make_eval_batches(cfg, seq_len=32, global_batch=20, num_batches=5)
    eval_counts = collections.Counter(source_of_rows(evals))
    assert set(eval_counts) == set("abcd") and eval_counts["a"] > eval_counts["b"]


@pytest.mark.slow
def test_exact_resume_with_worker_processes_and_refusals(corpora):
    """Must show: after restoring the state, batches equal those of the uninterrupted iterator, with
    worker processes on; a changed seed or worker count is refused with one clear line."""
    cfg = DataConfig(source="; ".join(corpora[k] for k in "acd"), weights="0.5, 0.3, 0.2", worker_count=2,
                     eval_fraction=0.2)
    it = make_train_iterator(cfg, seq_len=32, global_batch=8)
    take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint's JsonSave stores it
    expected = take(it, 12)
    it.close()
    resumed = make_train_iterator(cfg, seq_len=32, global_batch=8)
    resumed.set_state(state)
    got = take(resumed, 12)
    resumed.close()
    assert same(got, expected)
    assert state["identity"]["DataConfig.worker_count"] == 2 and len(state["fingerprint"]) == 16

    for change, message in [
        (dict(seed=1), "data state was saved with DataConfig.seed=0; this run has DataConfig.seed=1"),
        (dict(worker_count=0), "DataConfig.worker_count=2; this run has DataConfig.worker_count=0"),
        (dict(weights="0.4, 0.4, 0.2"), "DataConfig.weights='0.5, 0.3, 0.2'; this run has "
                                        "DataConfig.weights='0.4, 0.4, 0.2'"),
    ]:
        other = make_train_iterator(DataConfig(**{**cfg.__dict__, **change, "worker_count": change.get(
            "worker_count", 0)}), seq_len=32, global_batch=8)
        if "worker_count" not in change:  # compare against a state saved without workers
            other_state = dict(state, identity={**state["identity"], "DataConfig.worker_count": 0})
            from maxlm.data.pipeline import fingerprint
            other_state["fingerprint"] = fingerprint(other_state["identity"])
        else:
            other_state = state
        with pytest.raises(DataStateMismatch) as err:
            other.set_state(other_state)
        other.close()
        assert "\n" not in str(err.value) and message in str(err.value), str(err.value)
        assert isinstance(err.value, ValueError)


def test_state_identity_covers_shapes_processes_and_files(corpora, tmp_path):
    base = dict(source=corpora["a"])
    it = make_train_iterator(DataConfig(**base, prefetch=0), seq_len=32, global_batch=4)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 4)
    again = make_train_iterator(DataConfig(**base, prefetch=2), seq_len=32, global_batch=4)
    again.set_state(state)  # prefetch depth does not change the stream: accepted
    assert same(take(again, 4), expected)
    cases = [
        (dict(seq_len=16, global_batch=4), "TrainConfig.seq_len=32; this run has TrainConfig.seq_len=16"),
        (dict(seq_len=32, global_batch=8), "TrainConfig.global_batch=4; this run has TrainConfig.global_batch=8"),
        (dict(seq_len=32, global_batch=4, process_count=2, process_index=1),
         "process_count=1, process_index=0; this run has process_count=2, process_index=1"),
    ]
    for kwargs, message in cases:
        other = make_train_iterator(DataConfig(**base), **kwargs)
        with pytest.raises(DataStateMismatch) as err:
            other.set_state(state)
        was, now = message.split("; this run has ")
        assert was in str(err.value).split(";")[0] and now in str(err.value).split(";")[1], str(err.value)
    # Files added to a raw source change what the stream holds: refused, naming the source.
    folder = tmp_path / "raw"
    rng = np.random.default_rng(0)
    spec = write_docs(folder, "e", 10, rng)
    raw_state = make_train_iterator(DataConfig(source=spec), seq_len=32, global_batch=4).get_state()
    write_docs(folder, "f", 1, rng)
    with pytest.raises(DataStateMismatch) as err:
        make_train_iterator(DataConfig(source=spec), seq_len=32, global_batch=4).set_state(raw_state)
    was, now = str(err.value).split("; this run has ")
    assert "DataConfig.source=" in was and "num_files=10" in was and "num_files=11" in now
    assert str(tmp_path) not in str(err.value)  # reprs hold no absolute paths: corpora may move
    # ... while the same files under another directory are the same source.
    moved = tmp_path / "moved"
    folder.rename(moved)
    (moved / "f000.txt").unlink()
    make_train_iterator(DataConfig(source=f"files:{moved}/*.txt"), seq_len=32,
                        global_batch=4).set_state(raw_state)
    damaged = dict(state, fingerprint="0" * 16)
    with pytest.raises(DataStateMismatch, match="damaged"):
        make_train_iterator(DataConfig(**base), seq_len=32, global_batch=4).set_state(damaged)
