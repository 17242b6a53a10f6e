"""The paged KV cache: ``maxlm.model.cache``'s interface over a pool of fixed-size blocks.

K and V live in one pool per layer, ``[L, num_blocks, K, block_size, H]`` (a block's slots of one kv
head are contiguous: attention reads them without a transpose). Each batch row brings its
block table (``[B, M]`` block ids, padded with block 0, which is never written) and its context
length after this call's tokens. The transformer does not change (``maxlm.model.cache`` describes
the interface):

- ``write`` maps each new token's position p to its block ``table[p // bs]`` and offset ``p % bs``
  (padding tokens, segment 0, to an out-of-range block: dropped), and lists the blocks the rows
  attend to: row by row, each row's first ``ceil(length / bs)`` table entries, flattened
  (``flat_blocks``);
- ``attend_layer`` scatters the new k and v into the pool and runs ``paged_attention`` over the
  flattened list: the work follows the tokens the rows hold, not the longest row times the batch.

The scheduler (``maxlm.serve.engine``) owns the tables; the pool is donated into every step, so
XLA updates it in place.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxlm.config import ModelConfig
from maxlm.model.attention import MASKED, Tokens, fold_heads, unfold_heads

FAR = 1 << 30  # the key position of a padding entry of the flattened list: after every query


@flax.struct.dataclass
class PagedKVCache:
    k: jax.Array  # [L, num_blocks, K, block_size, H]
    v: jax.Array
    tables: jax.Array  # [B, M] int32 block ids
    lengths: jax.Array  # [B] int32: each row's context length once this call's tokens are in
    block_size: int = flax.struct.field(pytree_node=False, default=16)

    @staticmethod
    def pool_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (cfg.n_layers, num_blocks, cfg.kv_heads, block_size, cfg.dim_per_head)

    @staticmethod
    def pool_spec(heads: str | None) -> PartitionSpec:
        """The pool's partition: kv heads over the mesh axis ``heads`` (None: replicated)."""
        return PartitionSpec(None, None, heads, None, None)

    def layers(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def with_layers(self, stacked: tuple[jax.Array, jax.Array]) -> PagedKVCache:
        k, v = stacked
        return self.replace(k=k, v=v)

    def write(self, tokens: Tokens) -> tuple["PagedKVCache", None, Any]:
        bs, width = self.block_size, self.tables.shape[1]
        block = jnp.take_along_axis(self.tables, jnp.clip(tokens.positions // bs, 0, width - 1), axis=1)
        block = jnp.where(tokens.segments > 0, block, self.k.shape[1])  # padding: out of range, dropped
        flat = flat_blocks(self.tables, self.lengths, bs)  # once per call, shared by every layer
        return self, None, (block, tokens.positions % bs, tokens.positions, *flat)

    @staticmethod
    def attend_layer(stacked: tuple[jax.Array, jax.Array], layer: jax.Array, q: jax.Array, k: jax.Array,
                     v: jax.Array, where: Any, *, sliding_window: int, attend: Any = None
                     ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """Scatter k, v [B, T, K, H] of layer ``layer`` into the pool (every row's, before any row
        reads: a prompt's later chunk sees its earlier chunk of the same call); q [B, T, N, H]
        attends over its row's blocks. ``attend`` (the model's dense attention) is not used."""
        block, offset, positions, blocks, owner, key_start, count = where
        pool_k, pool_v = stacked
        pool_k = pool_k.at[layer, block, :, offset].set(k.astype(pool_k.dtype), mode="drop")
        pool_v = pool_v.at[layer, block, :, offset].set(v.astype(pool_v.dtype), mode="drop")
        out = paged_attention(q, pool_k, pool_v, layer, positions, blocks, owner, key_start, count, sliding_window)
        return (pool_k, pool_v), out


def flat_blocks(tables: jax.Array, lengths: jax.Array, block_size: int) -> tuple[jax.Array, ...]:
    """The blocks the rows attend to, flattened row by row: (block id, owning row, position of its
    first slot) per entry, and ``count``, the number of real entries. The entries fill whole chunks
    of ``paged_attention`` (the capacity is B * M rounded up to a chunk); those past ``count`` are
    padding: block 0, the last row (so the owners stay sorted), a position after every query."""
    rows, width = tables.shape
    chunk = chunk_entries(rows)
    held = jnp.clip(-(-lengths // block_size), 0, width)
    ends = jnp.cumsum(held)
    entry = jnp.arange(-(-rows * width // chunk) * chunk, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, entry, side="right"), rows - 1).astype(jnp.int32)
    index = entry - (ends - held)[owner]  # the entry's place in its row's table
    real = entry < ends[-1]
    blocks = jnp.where(real, tables[owner, jnp.clip(index, 0, width - 1)], 0)
    key_start = jnp.where(real, index * block_size, FAR)
    return blocks, owner, key_start, ends[-1]


def chunk_entries(rows: int) -> int:
    """Blocks one iteration of ``paged_attention`` reads: about four per row (a batch of one reads
    8 at a time, not a long row's worth of padding), at most 64 (enough work per iteration)."""
    return max(8, min(64, 4 * rows))


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, layer: jax.Array, positions: jax.Array,
                    blocks: jax.Array, owner: jax.Array, key_start: jax.Array, count: jax.Array,
                    sliding_window: int = 0) -> jax.Array:
    """q [B, T, N, H] at ``positions`` [B, T] over the flattened blocks of layer ``layer`` of the
    pools [L, num_blocks, K, bs, H] -> [B, T, N, H] (the layer is indexed with the blocks, so no
    copy of a layer's pool is made).

    A loop over chunks of the flattened list, as many as ``count`` needs (a dynamic trip count: one
    compiled step serves every context length): each chunk gathers its blocks, scores them against
    their rows' queries, and folds them into each row's running max, normaliser and output (the
    online softmax of flash decoding, combined per row by sorted segment reductions). A key is
    visible to a query at or after its position and within the window; slots past a row's length
    lie after all its queries, so they are masked like the padding entries."""
    rows, k_heads, bs = q.shape[0], pool_k.shape[2], pool_k.shape[3]
    qg = fold_heads(q, k_heads)  # [B, K, T*G, H]
    g = q.shape[2] // k_heads
    q_pos = jnp.repeat(positions, g, axis=1)  # [B, T*G], the folded rows' positions
    chunk = chunk_entries(rows)  # the flattened list holds whole chunks (``flat_blocks``)
    scale = jnp.float32(1.0 / math.sqrt(q.shape[-1]))
    segment = dict(num_segments=rows, indices_are_sorted=True)
    batch = ((0, 1), (0, 1))

    def body(i, carry):
        top, total, acc = carry
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)
        ids, own, start = take(blocks), take(owner), take(key_start)
        kb, vb = pool_k[layer, ids], pool_v[layer, ids]  # [C, K, bs, H]
        logits = jax.lax.dot_general(qg[own], kb, (((3,), (3,)), batch), preferred_element_type=jnp.float32) * scale
        k_pos = start[:, None] + jnp.arange(bs, dtype=start.dtype)  # [C, bs]
        qp = q_pos[own][:, :, None]  # [C, T*G, 1]
        visible = k_pos[:, None, :] <= qp
        if sliding_window:
            visible &= qp - k_pos[:, None, :] < sliding_window
        logits = jnp.where(visible[:, None], logits, MASKED)  # [C, K, T*G, bs]
        new_top = jnp.maximum(top, jax.ops.segment_max(logits.max(-1), own, **segment))
        probs = jnp.exp(logits - new_top[own][..., None])
        rescale = jnp.exp(top - new_top)
        total = total * rescale + jax.ops.segment_sum(probs.sum(-1), own, **segment)
        part = jax.lax.dot_general(probs.astype(vb.dtype), vb, (((3,), (2,)), batch),
                                   preferred_element_type=jnp.float32)
        acc = acc * rescale[..., None] + jax.ops.segment_sum(part, own, **segment)
        return new_top, total, acc

    stats = qg.shape[:3]
    init = (jnp.full(stats, MASKED, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros(qg.shape, jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, -(-count // chunk), body, init)
    total = jnp.where(total > 0, total, 1.0)  # a padding row of the batch holds no block
    return unfold_heads((acc / total[..., None]).astype(q.dtype), q.shape[2])


def copy_blocks(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """pool [L, N, bs, ...] with block dst[i] overwritten by block src[i] (copy-on-write)."""
    return pool.at[:, dst].set(pool[:, src])
