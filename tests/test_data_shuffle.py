"""Packed rows of raw sources are shuffled in windows (DataConfig.shuffle_rows), and resume exactly."""

import dataclasses

import numpy as np

from maxlm import config, data

SEQ, BATCH = 64, 8


def _cfg(shuffle_rows):
    return dataclasses.replace(config.build(num_devices=1).data, shuffle_rows=shuffle_rows)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _rows(shuffle_rows, n):
    it = data.make_train_iterator(_cfg(shuffle_rows), seq_len=SEQ, global_batch=BATCH)
    rows = [r.tobytes() for b in _take(it, n // BATCH) for r in b["inputs"]]
    it.close()
    return rows


def test_windows_permute_rows_and_spread_a_batch_over_the_window():
    window = 256
    plain, shuffled = _rows(0, window), _rows(window, window)
    index = {row: i for i, row in enumerate(plain)}
    assert sorted(index[r] for r in shuffled) == list(range(window))  # the same rows, reordered
    for b in range(0, window, BATCH):  # consecutive rows of one document no longer share a batch
        positions = sorted(index[r] for r in shuffled[b:b + BATCH])
        assert positions[-1] - positions[0] > window // 4, positions


def test_shuffled_stream_resumes_exactly_mid_window():
    cfg = _cfg(32)
    it = data.make_train_iterator(cfg, seq_len=SEQ, global_batch=BATCH)
    _take(it, 3)  # 24 rows: inside the first window of 32
    state = it.get_state()
    expected = _take(it, 6)  # crosses into the next windows
    it.close()
    again = data.make_train_iterator(cfg, seq_len=SEQ, global_batch=BATCH)
    again.set_state(state)
    for want, got in zip(expected, _take(again, 6)):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])
    again.close()


def test_eval_batches_are_fixed_and_span_documents():
    cfg = _cfg(256)
    first = data.make_eval_batches(cfg, seq_len=SEQ, global_batch=BATCH, num_batches=3)
    second = data.make_eval_batches(cfg, seq_len=SEQ, global_batch=BATCH, num_batches=3)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    plain = data.make_eval_batches(_cfg(0), seq_len=SEQ, global_batch=BATCH, num_batches=3)
    assert not np.array_equal(first[0]["inputs"], plain[0]["inputs"])  # drawn from a window, not the first file
