"""Grain pipelines: documents -> tokens -> fixed-length packed rows -> per-process batches.

    source[process_index::process_count] -> shuffle(seed, new order each epoch) -> repeat forever
    -> read + tokenise lazily (threads) -> concat-then-split packing -> row features -> batch

A batch is a dict of numpy arrays of shape [global_batch // process_count, seq_len]:
    inputs, targets (int32)  token ids; targets[i] = inputs[i + 1] inside a segment, else pad_id
    segment_ids (int32)      1, 2, 3 ... per document piece in the row; 0 for padding
    positions (int32)        position inside the piece, from 0
    weights (float32)        1 where the target is the next token of the same piece, else 0
The endless training stream never pads; padding appears only at the end of a finite stream.

Every stage is index- or state-based, so `iterator.get_state()` is a small JSON-able dict that
restores the exact stream (the checkpoint module saves it beside the train state).
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import grain
import numpy as np
from absl import flags

from maxlm.config import DataConfig
from maxlm.data import sources
from maxlm.data.tokenizer import ByteTokenizer, get_tokenizer

# Documents read ahead by the reading threads. Grain's default (500) would re-read a small eval split
# many times over just to fill the buffer; 64 docs (~1 MB of stdlib text) keeps any packer busy.
_READ_OPTIONS = grain.ReadOptions(num_threads=8, prefetch_buffer_size=64)


def _grain_seed(seed: int) -> int:
    # Grain reshuffles epoch e with seed + e, so seeds 0 and 1 would share all but one epoch's
    # order; hashing the user's seed first makes neighbouring seeds unrelated.
    return int.from_bytes(hashlib.sha1(f"maxlm.data/{seed}".encode()).digest()[:4], "big")


def _rows_per_process(global_batch: int, process_index: int, process_count: int) -> int:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index = {process_index} is outside [0, {process_count})")
    if global_batch % process_count:
        raise ValueError(f"global_batch = {global_batch} is not divisible by "
                         f"process_count = {process_count}")
    return global_batch // process_count


def _shard(files: sources.TextFiles, process_index: int, process_count: int) -> grain.MapDataset:
    docs = grain.MapDataset.source(files)[process_index::process_count]
    if len(docs) == 0:
        raise ValueError(f"DataConfig.source = {files.spec!r}: {len(files)} file(s) cannot give "
                         f"each of {process_count} processes a document")
    return docs


def _encode(text: str, tokenizer: ByteTokenizer) -> dict[str, np.ndarray]:
    return {"inputs": tokenizer.encode(text, add_bos=True, add_eos=True)}


def _row(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Model features from one packed row; a target is learnt only inside its own segment."""
    segment_ids = packed["inputs_segment_ids"].astype(np.int32)
    inputs = np.where(segment_ids == 0, pad_id, packed["inputs"]).astype(np.int32)
    same = np.zeros(inputs.shape, dtype=bool)
    same[:-1] = (segment_ids[1:] == segment_ids[:-1]) & (segment_ids[:-1] != 0)
    targets = np.full_like(inputs, pad_id)
    targets[:-1] = inputs[1:]
    return {
        "inputs": inputs,
        "targets": np.where(same, targets, pad_id).astype(np.int32),
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"].astype(np.int32),
        "weights": same.astype(np.float32),
    }


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


def _packed_batches(docs: grain.MapDataset, tokenizer: ByteTokenizer, *, seq_len: int,
                    rows: int) -> grain.IterDataset:
    """Tokenise lazily, pack into rows of exactly seq_len (long documents span several rows)."""
    if seq_len < 2:
        raise ValueError(f"seq_len = {seq_len} must be at least 2 (an input and its target)")
    tokens = docs.map(functools.partial(_encode, tokenizer=tokenizer)).to_iter_dataset(_READ_OPTIONS)
    rows_ds = _Pack(tokens, seq_len).map(functools.partial(_row, pad_id=tokenizer.pad_id))
    return rows_ds.batch(rows, drop_remainder=True)


def _splits(data_cfg: DataConfig) -> tuple[sources.TextFiles, sources.TextFiles]:
    return sources.split(sources.get_source(data_cfg.source), data_cfg.eval_fraction)


def make_train_iterator(data_cfg: DataConfig, *, seq_len: int, global_batch: int,
                        process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
    """An endless iterator of this process's training batches (its `global_batch // process_count`
    rows); supports next(), get_state() and set_state(state). Call close() when worker_count > 0."""
    rows = _rows_per_process(global_batch, process_index, process_count)
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    train, _ = _splits(data_cfg)
    docs = _shard(train, process_index, process_count).shuffle(seed=_grain_seed(data_cfg.seed))
    # repeat() re-seeds the shuffle every epoch, so each pass visits the documents in a new order.
    ds = _packed_batches(docs.repeat(), tokenizer, seq_len=seq_len, rows=rows)
    if data_cfg.worker_count > 0:
        # grain 0.2.18 reads an absl flag when it starts workers and raises if the program never
        # parsed absl flags (anything not launched by absl.app); their defaults are what we want.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        # Each worker packs its own slice of the document stream, so the batches (still
        # deterministic) depend on worker_count: resume with the worker_count that saved the state.
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=data_cfg.worker_count, per_worker_buffer_size=max(data_cfg.prefetch, 1)))
    elif data_cfg.prefetch > 0:
        # A background thread assembles the next batches while the training step runs.
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_cfg.prefetch)
    return iter(ds)


def make_eval_batches(data_cfg: DataConfig, *, seq_len: int, global_batch: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """The first num_batches batches of the held-out documents, unshuffled, so every call (and
    every evaluation during training) sees the same tokens. A small held-out split is cycled."""
    rows = _rows_per_process(global_batch, process_index, process_count)
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    _, held_out = _splits(data_cfg)
    docs = _shard(held_out, process_index, process_count).repeat(reseed_each_epoch=False)
    return list(itertools.islice(_packed_batches(docs, tokenizer, seq_len=seq_len, rows=rows),
                                 num_batches))
