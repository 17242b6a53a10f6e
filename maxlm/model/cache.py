"""The KV cache interface the transformer calls, and its dense (contiguous) implementation.

The transformer touches a cache in exactly three places, so another layout (the serving issue's
paged cache: blocks of K/V plus a block table per sequence) implements the same methods and the
model does not change:

- ``layers()``: the per-layer arrays, stacked on a leading ``layers`` axis. The layer scan carries
  the whole stack from layer to layer (not one slice per layer as scanned input and output), so
  XLA updates it in place: a decode step writes only the new tokens' entries instead of copying
  the cache.
- ``write(tokens)``: before the layers run, decide where the new tokens go (here: slot =
  position, per row, so every row of a ragged batch writes at its own length; padding, segment
  0, goes nowhere) and return the cache with that bookkeeping, the ``Tokens`` that describe every
  slot (the attention keys; None for a cache that attends by itself), and the write index.
- ``attend_layer(stacked, layer, q, k, v, where, sliding_window=, attend=)``: inside layer
  ``layer`` (a traced index), store the new tokens' k and v into the stack and return it with the
  queries' attention output over everything the cache holds. Here that is ``attend(k, v)``, the
  model's own attention over the layer's full k and v; the paged cache runs its own over blocks.

``with_layers(stacked)`` puts the scan's final carry back. A slot whose segment id is 0 is empty:
no query (segment >= 1) attends to it, so a padded prompt never leaks its padding.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from maxlm.config import ModelConfig
from maxlm.model.attention import Tokens
from maxlm.parallel.sharding import constrain

LOGICAL_KV = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
LOGICAL_SLOTS = ("batch", "cache_length")


@flax.struct.dataclass
class KVCache:
    """K and V for every layer and slot, [L, B, S, K, H]; the slots' segment ids, [B, S]."""

    k: jax.Array
    v: jax.Array
    segments: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, length: int, dtype: Any = None) -> "KVCache":
        """An empty cache of ``length`` slots per row (at most ``max_seq_len``)."""
        if not 0 < length <= cfg.max_seq_len:
            raise ValueError(f"cache length {length} must lie in [1, ModelConfig.max_seq_len = {cfg.max_seq_len}]")
        from maxlm.model.linear import DTYPES

        shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.dim_per_head)
        dtype = dtype or DTYPES[cfg.dtype]
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   segments=jnp.zeros((batch, length), jnp.int32))

    @staticmethod
    def logical_names() -> "KVCache":
        """Logical axis names of each field (for shardings): the cache shards like activations."""
        return KVCache(k=LOGICAL_KV, v=LOGICAL_KV, segments=LOGICAL_SLOTS)

    @property
    def length(self) -> int:
        return self.segments.shape[1]

    def lengths(self) -> jax.Array:
        """[B]: one past the last filled slot of each row."""
        slots = jnp.arange(self.length)
        return jnp.max(jnp.where(self.segments > 0, slots + 1, 0), axis=1)

    def layers(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def with_layers(self, stacked: tuple[jax.Array, jax.Array]) -> "KVCache":
        k, v = stacked
        return self.replace(k=k, v=v)

    def write(self, tokens: Tokens) -> tuple["KVCache", Tokens, jax.Array]:
        """(cache, keys, where): the new tokens take the slots of their positions; padding
        (segment 0) and positions past the end take none (``where`` is out of range for them)."""
        where = jnp.where(tokens.segments > 0, tokens.positions, self.length)
        segments = _scatter_rows(self.segments, where, tokens.segments)
        slots = jnp.broadcast_to(jnp.arange(self.length, dtype=jnp.int32), segments.shape)
        return self.replace(segments=segments), Tokens(positions=slots, segments=segments), where

    @staticmethod
    def attend_layer(stacked: tuple[jax.Array, jax.Array], layer: jax.Array, q: jax.Array, k: jax.Array,
                     v: jax.Array, where: jax.Array, *, sliding_window: int, attend: Callable
                     ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """Store k, v [B, T, K, H] of layer ``layer`` at slots ``where`` [B, T] of the stacked
        [L, B, S, K, H] arrays; returns (stacked, ``attend`` over the layer's k and v [B, S, K, H],
        which applies the window itself)."""
        cache_k, cache_v = stacked
        cache_k = _scatter_layer(cache_k, layer, where, k.astype(cache_k.dtype))
        cache_v = _scatter_layer(cache_v, layer, where, v.astype(cache_v.dtype))
        read = lambda a: constrain(jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False), LOGICAL_KV[1:])
        return (cache_k, cache_v), attend(read(cache_k), read(cache_v))


def _scatter_rows(target: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """target[b, index[b, t]] = values[b, t] for every row b; out-of-range indices are dropped."""
    return jax.vmap(lambda row, i, val: row.at[i].set(val, mode="drop"))(target, index, values)


def _scatter_layer(target: jax.Array, layer: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """target[layer, b, index[b, t]] = values[b, t]; out-of-range indices are dropped. One scatter
    of just the new entries into the whole stack, which XLA does in place on the scan's carry."""
    rows = jnp.broadcast_to(jnp.arange(index.shape[0], dtype=index.dtype)[:, None], index.shape)
    return target.at[layer, rows, index].set(values, mode="drop")
