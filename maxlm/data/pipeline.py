"""Grain pipelines: sources -> packed rows -> weighted mixture -> per-process batches.

For each source of ``DataConfig.source`` (see maxlm.data.spec):

    raw documents:  docs[process_index::process_count] -> shuffle(seed) -> repeat (new order each
                    epoch) -> read + tokenise lazily (threads) -> concat-then-split packing
                    -> rows shuffled in windows of shuffle_rows
    packed rows:    rows[process_index::process_count] -> shuffle(seed) -> repeat -> memory-mapped read

then ``IterDataset.mix`` interleaves the sources' rows deterministically in proportion to
``DataConfig.weights``, rows are batched, and worker processes (``worker_count``) or a prefetch
thread assemble batches ahead of the training step.

A batch is a dict of numpy arrays of shape [global_batch // process_count, seq_len]:
    inputs, targets (int32)  token ids; targets[i] = inputs[i + 1] inside a segment, else pad_id
    segment_ids (int32)      1, 2, 3 ... per document piece in the row; 0 for padding
    positions (int32)        position inside the piece, from 0
    weights (float32)        1 where the target is the next token of the same piece, else 0
The endless training stream never pads; padding appears only at the end of a finite stream.

``iterator.get_state()`` is a small JSON-able dict: Grain's exact position plus the identity of
the pipeline (sources, tokenizer, seed, worker and process counts, shapes) and its fingerprint.
``set_state`` refuses a state saved under another identity with ``DataStateMismatch``, a
ValueError whose message is one line naming what changed, instead of silently diverging.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import logging

import grain
import numpy as np
from absl import flags

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.prepare import PackedRows
from maxlm.data.spec import SourceSpec, check_config, parse_mixture
from maxlm.data.tokenizer import Tokenizer, get_tokenizer

log = logging.getLogger("maxlm.data")

# Documents read ahead by the reading threads. Grain's default (500) would re-read a small eval split
# many times over just to fill the buffer; 64 docs (~1 MB of stdlib text) keeps any packer busy.
_PREFETCH_DOCS = 64
STATE_VERSION = 1


class DataStateMismatch(ValueError):
    """A saved data-iterator state does not belong to this pipeline; str(err) is one line."""


def _grain_seed(seed: int, index: int = 0) -> int:
    # Grain reshuffles epoch e with seed + e, so seeds 0 and 1 would share all but one epoch's
    # order; hashing the user's seed first makes neighbouring seeds unrelated. Each source of a
    # mixture gets its own stream.
    tag = f"maxlm.data/{seed}" + (f"/{index}" if index else "")
    return int.from_bytes(hashlib.sha1(tag.encode()).digest()[:4], "big")


def _rows_per_process(global_batch: int, process_index: int, process_count: int) -> int:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index = {process_index} is outside [0, {process_count})")
    if global_batch % process_count:
        raise ValueError(f"global_batch = {global_batch} is not divisible by "
                         f"process_count = {process_count}")
    return global_batch // process_count


def _shard(items, spec: str, process_index: int, process_count: int) -> grain.MapDataset:
    ds = grain.MapDataset.source(items)[process_index::process_count]
    if len(ds) == 0:
        raise ValueError(f"DataConfig.source entry {spec!r}: {len(items)} item(s) cannot give each of "
                         f"{process_count} processes one")
    return ds


def features(tokens: np.ndarray, segments: np.ndarray, positions: np.ndarray, pad_id: int) -> dict:
    """Model features of one packed row; a target is learnt only inside its own segment."""
    segment_ids = segments.astype(np.int32)
    inputs = np.where(segment_ids == 0, pad_id, tokens).astype(np.int32)
    same = np.zeros(inputs.shape, dtype=bool)
    same[:-1] = (segment_ids[1:] == segment_ids[:-1]) & (segment_ids[:-1] != 0)
    targets = np.full_like(inputs, pad_id)
    targets[:-1] = inputs[1:]
    return {
        "inputs": inputs,
        "targets": np.where(same, targets, pad_id).astype(np.int32),
        "segment_ids": segment_ids,
        "positions": positions.astype(np.int32),
        "weights": same.astype(np.float32),
    }


def _row(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    return features(packed["inputs"], packed["inputs_segment_ids"], packed["inputs_positions"], pad_id)


def _packed_row(item: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    return features(item["tokens"], item["segments"], item["positions"], pad_id)


def _encode(text: str, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    return {"inputs": tokenizer.encode(text, add_bos=True, add_eos=True)}


def _nonempty(text: str) -> bool:
    return bool(text)  # sources return "" for a bad document, after logging it


class SubRows:
    """Packed rows of length k * seq_len seen as k rows of seq_len each (pieces renumbered from 1,
    positions restarting at 0 per piece, exactly as if packed at seq_len)."""

    def __init__(self, rows: PackedRows, k: int):
        self.rows, self.k = rows, k
        self.seq_len = rows.seq_len // k

    def __len__(self) -> int:
        return len(self.rows) * self.k

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = self.rows[index // self.k]
        lo = (index % self.k) * self.seq_len
        tok, seg = row["tokens"][lo:lo + self.seq_len], row["segments"][lo:lo + self.seq_len]
        starts = np.r_[True, seg[1:] != seg[:-1]]
        renum = np.where(seg == 0, 0, np.cumsum(starts)).astype(np.int32)
        idx = np.arange(self.seq_len)
        pos = idx - np.maximum.accumulate(np.where(starts, idx, 0))
        return {"tokens": tok, "segments": renum, "positions": np.where(seg == 0, 0, pos)}

    def __repr__(self) -> str:
        return f"SubRows({self.rows!r}, k={self.k})"


class _JsonSafeIterator(grain.DatasetIterator):
    """Concat-then-split packing whose state survives a JSON round trip.

    Grain's Orbax handler stores iterator state as JSON, which turns the packer's empty-remainder
    slice (-1, -1) into [-1, -1]; grain 0.2.18 compares it with a tuple, misreads it as a remainder
    and drops the next document on restore. Restoring tuples here keeps resumption exact.
    """

    def __next__(self):
        return next(self._parent)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        slices = {k: tuple(v) for k, v in state["remainder_slices"].items()}
        self._parent.set_state({**state, "remainder_slices": slices})


class _Pack(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(grain.experimental.ConcatThenSplitIterDataset(
            parent, length_struct={"inputs": seq_len}))

    def __iter__(self) -> grain.DatasetIterator:
        return _JsonSafeIterator(iter(self._parent))


def _read_options(threads: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=_PREFETCH_DOCS)


def _packed_docs(docs: grain.MapDataset, tokenizer: Tokenizer, *, seq_len: int,
                 threads: int = 8) -> grain.IterDataset:
    """Documents -> rows of exactly seq_len (long documents span several rows)."""
    if seq_len < 2:
        raise ValueError(f"seq_len = {seq_len} must be at least 2 (an input and its target)")
    tokens = docs.filter(_nonempty).map(functools.partial(_encode, tokenizer=tokenizer))
    return _Pack(tokens.to_iter_dataset(_read_options(threads)), seq_len).map(
        functools.partial(_row, pad_id=tokenizer.pad_id))


def _open_packed(spec: SourceSpec, split: str, seq_len: int, tokenizer: Tokenizer):
    rows = PackedRows(spec.path, split)
    meta = rows.index["tokenizer"]
    if meta["fingerprint"] != tokenizer.fingerprint:
        raise ValueError(f"DataConfig.source entry {spec.text!r} was tokenized with {meta['name']!r} "
                         f"({meta['fingerprint']}) but DataConfig.tokenizer is {tokenizer.fingerprint}; "
                         "use the same tokenizer or re-run prepare")
    if rows.seq_len == seq_len:
        return rows
    if rows.seq_len % seq_len == 0:
        return SubRows(rows, rows.seq_len // seq_len)
    raise ValueError(f"DataConfig.source entry {spec.text!r} was prepared with seq_len {rows.seq_len}, "
                     f"which TrainConfig.seq_len = {seq_len} does not divide; re-run prepare with "
                     f"--seq-len {seq_len}")


def _source_rows(spec: SourceSpec, data_cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int,
                 process_index: int, process_count: int, train: bool, seed: int):
    """(IterDataset of row features from one source, the repr that identifies its data)."""
    if spec.kind == "packed":
        rows = _open_packed(spec, "train" if train else "eval", seq_len, tokenizer)
        if len(rows) == 0:
            raise ValueError(f"DataConfig.source entry {spec.text!r} has no "
                             f"{'train' if train else 'eval'} rows (re-run prepare with "
                             "--eval-fraction > 0 for evaluation data)")
        ds = _shard(rows, spec.text, process_index, process_count)
        ds = ds.shuffle(seed=seed).repeat() if train else ds.repeat(reseed_each_epoch=False)
        ds = ds.map(functools.partial(_packed_row, pad_id=tokenizer.pad_id))
        return ds.to_iter_dataset(_read_options(min(data_cfg.read_threads, 2))), repr(rows)
    docs = sources.open_source(spec, data_cfg.max_doc_bytes)
    train_docs, eval_docs = sources.split(docs, data_cfg.eval_fraction)
    chosen = train_docs if train else eval_docs
    _require_readable(chosen, spec.text, "train" if train else "eval", process_index, process_count)
    ds = _shard(chosen, spec.text, process_index, process_count)
    ds = ds.shuffle(seed=seed).repeat() if train else ds.repeat(reseed_each_epoch=False)
    rows = _packed_docs(ds, tokenizer, seq_len=seq_len, threads=data_cfg.read_threads)
    if data_cfg.shuffle_rows > 1:
        # Rows of one long document are consecutive; shuffling them in windows makes a batch draw
        # on many documents (tiny.gin's eval loss at step 150: 2.73 unshuffled, 2.44 with 1024-row
        # windows). Eval rows too, with a fixed seed: every evaluation sees the same rows, drawn
        # from many held-out documents instead of the first one or two.
        rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=data_cfg.shuffle_rows,
                                                           seed=seed if train else seed + 1)
    return rows, repr(chosen)


def _require_readable(docs: sources.Subset, spec: str, split: str, process_index: int,
                      process_count: int) -> None:
    """Fail fast when this process's share of a split holds no readable document: the endless
    stream would otherwise skip bad documents forever. Usually the first document settles it."""
    problems = collections.Counter()
    for j in range(process_index, len(docs), process_count):
        rec = docs.read(j)
        if not rec.problem:
            return
        problems[rec.problem] += 1
    raise ValueError(f"DataConfig.source entry {spec!r}: none of the {sum(problems.values())} {split} "
                     f"document(s) of process {process_index} is readable text ({dict(problems)})")


def _mixture(data_cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int, process_index: int,
             process_count: int, train: bool):
    check_config(data_cfg)
    mixture = parse_mixture(data_cfg.source, data_cfg.weights)
    streams, reprs = [], []
    for i, (spec, _) in enumerate(mixture):
        ds, r = _source_rows(spec, data_cfg, tokenizer, seq_len=seq_len, process_index=process_index,
                             process_count=process_count, train=train, seed=_grain_seed(data_cfg.seed, i))
        streams.append(ds)
        reprs.append(r)
    if len(streams) == 1:
        return streams[0], reprs, mixture
    return grain.IterDataset.mix(streams, [w for _, w in mixture]), reprs, mixture


def _identity(data_cfg: DataConfig, tokenizer: Tokenizer, reprs: list[str], mixture, *, seq_len: int,
              global_batch: int, process_index: int, process_count: int) -> dict:
    """Everything that decides the stream. Paths are not in it (a corpus may move between
    machines); what the sources hold is, through their reprs (relative paths and digests)."""
    return {
        "DataConfig.source": "; ".join(reprs),
        "DataConfig.weights": ", ".join(f"{w:.6g}" for _, w in mixture),
        "DataConfig.tokenizer": tokenizer.fingerprint,
        "DataConfig.seed": data_cfg.seed,
        "DataConfig.eval_fraction": data_cfg.eval_fraction,
        "DataConfig.max_doc_bytes": data_cfg.max_doc_bytes,
        "DataConfig.worker_count": data_cfg.worker_count,
        "DataConfig.shuffle_rows": data_cfg.shuffle_rows,
        "TrainConfig.seq_len": seq_len,
        "TrainConfig.global_batch": global_batch,
        "process_count": process_count,
        "process_index": process_index,
    }


def fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def describe_mismatch(saved: dict, current: dict) -> str | None:
    """One line naming the fields whose values differ, or None when the identities agree."""
    keys = [k for k in current if saved.get(k) != current[k]] + [k for k in saved if k not in current]
    if not keys:
        return None
    was = ", ".join(f"{k}={_show(saved.get(k, '(absent)'))}" for k in keys)
    now = ", ".join(f"{k}={_show(current.get(k, '(absent)'))}" for k in keys)
    return (f"data state was saved with {was}; this run has {now}. Resume with the saved data config "
            "(or start a new run directory) so the stream does not silently diverge")


class DataIterator:
    """The training iterator: next(), get_state(), set_state(state), close()."""

    def __init__(self, it, identity: dict):
        self._it = it
        self.identity = identity
        self.fingerprint = fingerprint(identity)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "identity": self.identity,
                "grain": self._it.get_state()}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or not state:
            log.warning("maxlm.data: the checkpoint holds no data-iterator state; the data stream "
                        "starts from the beginning")
            return
        if "grain" not in state:  # written by maxlm before the fingerprint existed
            log.warning("maxlm.data: data state without a fingerprint (an older maxlm); restoring it "
                        "unchecked")
            self._it.set_state(state)
            return
        saved = state.get("identity", {})
        problem = describe_mismatch(saved, self.identity)
        if problem is None and state.get("fingerprint") != fingerprint(saved):
            problem = "data state is damaged: its fingerprint does not match its identity"
        if problem:
            raise DataStateMismatch(problem)
        self._it.set_state(state["grain"])

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close:
            close()


class ShardGroup:
    """Several logical data shards read by one process, their rows side by side in each batch."""

    def __init__(self, iterators: list[DataIterator]):
        self.iterators = iterators

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batches = [next(it) for it in self.iterators]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def get_state(self) -> dict:
        return {"shards": [it.get_state() for it in self.iterators]}

    def set_state(self, state: dict) -> None:
        saved = state.get("shards") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.iterators):
            count = len(saved) if isinstance(saved, list) else 1
            raise DataStateMismatch(f"data state holds {count} shard(s) for this process; this run reads "
                                    f"{len(self.iterators)} (DataConfig.shards or the process count changed)")
        for it, shard_state in zip(self.iterators, saved):
            it.set_state(shard_state)

    def close(self) -> None:
        for it in self.iterators:
            it.close()


def _owned_shards(data_cfg: DataConfig, process_index: int, process_count: int) -> tuple[range, int]:
    """The logical shards this process reads, and how many there are in all."""
    shards = data_cfg.shards or process_count
    if shards % process_count:
        raise ValueError(f"DataConfig.shards = {shards} is not divisible by the process count {process_count}")
    per = shards // process_count
    return range(process_index * per, (process_index + 1) * per), shards


def make_train_iterator(data_cfg: DataConfig, *, seq_len: int, global_batch: int,
                        process_index: int = 0, process_count: int = 1) -> DataIterator | ShardGroup:
    """An endless iterator of this process's training batches (its `global_batch // process_count`
    rows); supports next(), get_state() and set_state(state). Call close() when done.

    The data is split into DataConfig.shards logical shards (default: one per process), and each
    process reads its share of them, so with a fixed shard count the global batch is the same
    whatever the number of processes."""
    _rows_per_process(global_batch, process_index, process_count)
    owned, shards = _owned_shards(data_cfg, process_index, process_count)
    if len(owned) > 1:
        return ShardGroup([_shard_iterator(data_cfg, seq_len=seq_len, global_batch=global_batch,
                                           shard=i, shards=shards) for i in owned])
    return _shard_iterator(data_cfg, seq_len=seq_len, global_batch=global_batch, shard=owned[0], shards=shards)


def _shard_iterator(data_cfg: DataConfig, *, seq_len: int, global_batch: int, shard: int,
                    shards: int) -> DataIterator:
    process_index, process_count = shard, shards
    rows = _rows_per_process(global_batch, process_index, process_count)
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    ds, reprs, mixture = _mixture(data_cfg, tokenizer, seq_len=seq_len, process_index=process_index,
                                  process_count=process_count, train=True)
    ds = ds.batch(rows, drop_remainder=True)
    if data_cfg.worker_count > 0:
        # grain 0.2.18 reads an absl flag when it starts workers and raises if the program never
        # parsed absl flags (anything not launched by absl.app); their defaults are what we want.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        # Each worker packs its own slice of the document stream, so the batches (still
        # deterministic) depend on worker_count: the fingerprint holds it, and a resume with
        # another worker_count is refused.
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=data_cfg.worker_count, per_worker_buffer_size=max(data_cfg.prefetch, 1)))
    elif data_cfg.prefetch > 0:
        # A background thread assembles the next batches while the training step runs.
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_cfg.prefetch)
    identity = _identity(data_cfg, tokenizer, reprs, mixture, seq_len=seq_len, global_batch=global_batch,
                         process_index=process_index, process_count=process_count)
    return DataIterator(iter(ds), identity)


def make_eval_batches(data_cfg: DataConfig, *, seq_len: int, global_batch: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """The first num_batches batches of the held-out data (each source's eval split, mixed with
    the training weights), unshuffled, so every call (and every evaluation during training) sees
    the same tokens. A small held-out split is cycled."""
    _rows_per_process(global_batch, process_index, process_count)
    owned, shards = _owned_shards(data_cfg, process_index, process_count)
    rows = _rows_per_process(global_batch, 0, shards)
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    parts = []
    for shard in owned:
        ds, _, _ = _mixture(data_cfg, tokenizer, seq_len=seq_len, process_index=shard,
                            process_count=shards, train=False)
        parts.append(list(itertools.islice(ds.batch(rows, drop_remainder=True), num_batches)))
    return [{k: np.concatenate([p[i][k] for p in parts]) for k in parts[0][i]} for i in range(num_batches)]
