"""The block schedule: which (query block, key block) pairs the kernels visit, and which need a mask.

A pair is *visited* when positions allow some query of the block to see some key of the block
(causality, the sliding window, the real length) and, with segment ids, when the blocks' segment
ranges overlap (per-block min/max segment ids, computed here outside the kernel: documents that
cannot meet are never loaded). A visited pair is *full* when positions alone hide nothing: every
key is real and every query sees every key by causality and the window; full pairs skip the
positional mask (the segment mask, when there are segments, still applies).

The kernels loop over an interval of blocks, so the schedule is one interval per block row (the
forward and dq passes: key blocks per query block) and per block column (the dk/dv pass: query
blocks per key block), each as four int32 bounds ``lo <= mid_lo <= mid_hi <= hi``: blocks
[lo, mid_lo) and [mid_hi, hi) are masked, [mid_lo, mid_hi) are full. Positional visibility is
an interval in both directions; segment overlap is one too when segment ids do not decrease along
the row (packed documents, padding at the end), so for packed rows the interval is exactly the
visited set. Otherwise blocks inside the interval that cannot overlap are still computed, masked.

Causal is by index (key index <= query index), as ``jax.nn.dot_product_attention(is_causal=True)``
and maxlm's self-attention define it; the window W keeps keys with query - key < W.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# Segment id of padding rows and columns the wrapper adds: never equal to a real segment id.
PAD_SEGMENT = int(np.iinfo(np.int32).min)


def _extents(n_real: int, block: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last real index of each block (last < first for a block of padding only)."""
    first = np.arange(n_blocks) * block
    return first, np.minimum(first + block, n_real) - 1


def position_blocks(t: int, s: int, block_q: int, block_k: int, n_q: int, n_k: int, causal: bool,
                    window: int) -> tuple[np.ndarray, np.ndarray]:
    """(any, full), each [n_q, n_k] bool (static): some query of block i may see some key of block
    j by position, and every query of block i sees every key of block j by position."""
    qa, qb = (x[:, None] for x in _extents(t, block_q, n_q))  # first and last real query
    ka, kb = (x[None, :] for x in _extents(s, block_k, n_k))  # first and last real key
    real = (qb >= qa) & (kb >= ka)
    any_ = real.copy()
    full = real & ((np.arange(n_k) + 1) * block_k <= s)[None, :]  # no padded key in the block
    if causal:
        any_ &= ka <= qb  # the first key is not after the last query
        full &= kb <= qa  # the last key is not after the first query
    if window:
        any_ &= qa - kb < window  # the first query is within the window of the last key
        full &= qb - ka < window  # the last query is within the window of the first key
    return any_, full


def _segment_range(segments: jnp.ndarray, n_real: int, block: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-block min and max segment id over real rows: [B, n_blocks] each."""
    b, padded = segments.shape
    real = (jnp.arange(padded) < n_real)[None, :]
    lo = jnp.where(real, segments, jnp.iinfo(jnp.int32).max).reshape(b, -1, block).min(-1)
    hi = jnp.where(real, segments, jnp.iinfo(jnp.int32).min).reshape(b, -1, block).max(-1)
    return lo, hi


def _intervals(visited: jnp.ndarray, full: np.ndarray) -> jnp.ndarray:
    """[..., n, m] visited and static full -> [..., n, 4] int32 (lo, mid_lo, mid_hi, hi) over m."""
    m = visited.shape[-1]
    idx = jnp.arange(m)
    lo = jnp.min(jnp.where(visited, idx, m), axis=-1)
    hi = jnp.max(jnp.where(visited, idx + 1, 0), axis=-1)
    lo = jnp.minimum(lo, hi)  # an empty row is (0, 0)
    f_lo = jnp.asarray(np.where(full.any(-1), full.argmax(-1), 0))
    f_hi = jnp.asarray(np.where(full.any(-1), m - full[..., ::-1].argmax(-1), 0))
    mid_lo = jnp.clip(f_lo, lo, hi)
    mid_hi = jnp.clip(f_hi, mid_lo, hi)
    return jnp.stack([lo, mid_lo, mid_hi, hi], axis=-1).astype(jnp.int32)


def block_tables(batch: int, t: int, s: int, block_q: int, block_k: int, n_q: int, n_k: int, *,
                 causal: bool, window: int, q_segments: jnp.ndarray | None = None,
                 kv_segments: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(rows [B, n_q, 4], cols [B, n_k, 4]): the intervals of key blocks each query block visits
    and of query blocks each key block visits (see the module docstring). t and s are the real
    lengths; segment ids, when given, are padded to n_q * block_q and n_k * block_k."""
    any_, full = position_blocks(t, s, block_q, block_k, n_q, n_k, causal, window)
    visited = jnp.broadcast_to(jnp.asarray(any_), (batch, n_q, n_k))
    if q_segments is not None:
        q_lo, q_hi = _segment_range(q_segments, t, block_q)
        k_lo, k_hi = _segment_range(kv_segments, s, block_k)
        visited = visited & (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    rows = _intervals(visited, full)
    cols = _intervals(jnp.swapaxes(visited, 1, 2), full.T)
    return rows, cols


def visited_pairs(table: jnp.ndarray) -> jnp.ndarray:
    """Number of block pairs a table makes its kernel visit (per batch row)."""
    return jnp.sum(table[..., 3] - table[..., 0], axis=-1)
