"""``maxlm.serve.paged_cache.paged_attention`` (the chunked online softmax over the flattened
blocks the rows hold) against a float64 NumPy reference that gathers each row's table into one
dense context and masks it: causal by position, within the window, over ragged lengths that are and
are not block multiples, several query tokens per row (a prefill chunk), and rows of padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.serve.paged_cache import flat_blocks, chunk_entries, paged_attention


def reference(q, pool_k, pool_v, layer, tables, positions, window):
    """Dense attention per row over its table's slots (pool [L, N, K, bs, H], q [B, T, N, H])."""
    rows, t, n, h = q.shape
    k_heads = pool_k.shape[2]
    g = n // k_heads
    out = np.zeros(q.shape)
    for b in range(rows):
        k = pool_k[layer, tables[b]].transpose(1, 0, 2, 3).reshape(k_heads, -1, h)  # [K, S, H]
        v = pool_v[layer, tables[b]].transpose(1, 0, 2, 3).reshape(k_heads, -1, h)
        k_pos = np.arange(k.shape[1])
        for i in range(t):
            visible = k_pos <= positions[b, i]
            if window:
                visible &= positions[b, i] - k_pos < window
            for head in range(n):
                logits = k[head // g] @ q[b, i, head] / np.sqrt(h)
                logits = np.where(visible, logits, -np.inf)
                p = np.exp(logits - logits.max())
                out[b, i, head] = (p / p.sum()) @ v[head // g]
    return out


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("queries", [1, 3])
def test_paged_attention_equals_dense_reference(window, queries):
    rng = np.random.default_rng(window + queries)
    layers, num_blocks, k_heads, bs, h, n = 2, 40, 2, 2, 8, 6
    width = 12  # table width: contexts up to 24 slots
    pool_k = rng.standard_normal((layers, num_blocks, k_heads, bs, h))
    pool_v = rng.standard_normal((layers, num_blocks, k_heads, bs, h))
    lengths = np.array([1, 4, 5, 24, 13, 9, 0])  # the last row is batch padding: no blocks
    rows = len(lengths)
    tables = np.zeros((rows, width), np.int32)
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    for b, length in enumerate(lengths):
        for m in range(-(-length // bs)):
            tables[b, m] = next(ids)
    # Each row's queries are its last `queries` tokens (fewer if the row is shorter).
    positions = np.stack([np.maximum(np.arange(length - queries, length), 0) for length in lengths]).astype(np.int32)
    q = rng.standard_normal((rows, queries, n, h))
    flat = flat_blocks(jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), bs)
    assert int(flat[3]) == sum(-(-length // bs) for length in lengths) > chunk_entries(rows)  # two chunks
    got = jax.jit(paged_attention, static_argnums=9)(
        jnp.asarray(q, jnp.float32), jnp.asarray(pool_k, jnp.float32), jnp.asarray(pool_v, jnp.float32),
        jnp.int32(1), jnp.asarray(positions), *flat, window)
    want = reference(q, pool_k, pool_v, 1, tables, positions, window)
    real = lengths > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(got)).all()  # the padding row too


def test_chunks_follow_the_batch():
    assert [chunk_entries(r) for r in (1, 2, 4, 8, 16, 32)] == [8, 8, 16, 32, 64, 64]
