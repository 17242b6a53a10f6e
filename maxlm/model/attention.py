"""The attention seam: ``attention(q, k, v, queries, keys, impl=..., sliding_window=...)``.

Layers pass token coordinates, not masks: ``queries`` and ``keys`` are ``Tokens`` (position and
segment id of each query and each key), and every implementation builds the mask it needs from
them. A query sees a key of the same segment (document) no later than itself and, with a sliding
window W, fewer than W tokens back. Over its own tokens (training, prefill without a cache) "no
later" is by index; over a preallocated cache, whose slots are filled up to each row's own length
(decode), it is by position. Segment id 0 marks an empty slot or padding.

``xla`` is written out with jnp (the math of ``jax.nn.dot_product_attention``'s XLA path) and
laid out so that XLA compiles it to plain batched matmuls. ``cudnn`` goes through
``jax.nn.dot_product_attention``: training and prefill hand it its native causal mask (and
sliding window) plus the document mask; decode hands it the positional mask. ``pallas`` arrives
with the kernels issue. Grouped-query attention is native: k and v carry fewer heads than q.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

# As jax.nn.dot_product_attention: a finite large negative, so no row is ever all -inf.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@flax.struct.dataclass
class Tokens:
    """Coordinates of a row of tokens: positions and segment ids, both [B, T] int32."""

    positions: jax.Array
    segments: jax.Array


def attention_mask(queries: Tokens, keys: Tokens, sliding_window: int = 0,
                   self_attention: bool = False) -> jax.Array:
    """[B, 1, T, S] boolean: same segment, causal, within the window.

    Self-attention (training, a prefill without a cache) is causal by index, as cuDNN's native
    mask is; attention over a cache is causal by position (a slot holds the token of its position)."""
    if self_attention:
        q_pos = jnp.arange(queries.segments.shape[1])[None, :, None]
        k_pos = jnp.arange(keys.segments.shape[1])[None, None, :]
    else:
        q_pos, k_pos = queries.positions[:, :, None], keys.positions[:, None, :]
    mask = (queries.segments[:, :, None] == keys.segments[:, None, :]) & (k_pos <= q_pos)
    if sliding_window:
        mask &= q_pos - k_pos < sliding_window
    return mask[:, None]


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention as two batched matmuls over (batch, kv head).

    The G query heads that share a kv head are folded into the query rows, so scores are
    [B, K, T*G, S] and each matmul has its batch dims leading and its contraction innermost. This
    is the form XLA:CPU's matmul kernels take directly, forward and backward; the einsum layout of
    ``jax.nn.dot_product_attention`` ([G, B, K, T, S] under a vmap over G) makes XLA transpose the
    score-sized tensors around every matmul, which made attention ~1.5x slower on CPU.
    """
    b, t, n, h = q.shape
    s, k_heads = k.shape[1], k.shape[2]
    g = n // k_heads
    # [B, T, K, G, H] -> [B, K, T*G, H]: moves whole G*H rows; k and v become [B, K, S, H].
    qg = q.reshape(b, t, k_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, k_heads, t * g, h)
    kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    batch = ((0, 1), (0, 1))
    logits = jax.lax.dot_general(qg, kg, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / math.sqrt(h))
    rows = jnp.broadcast_to(mask[:, :, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
    logits = jnp.where(rows, logits, MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    ctx = jax.lax.dot_general(probs, vg, (((3,), (2,)), batch))  # [B, K, T*G, H]
    return ctx.reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _xla(q, k, v, queries, keys, sliding_window, self_attention):
    # Scores and probabilities ([B, N, T, S] per layer) are recomputed in the backward pass from
    # q, k, v instead of being stored: one extra q·k matmul is cheaper than writing and re-reading
    # them, as flash attention does.
    mask = attention_mask(queries, keys, sliding_window, self_attention)
    return jax.checkpoint(_xla_attention)(q, k, v, mask)


def _cudnn(q, k, v, queries, keys, sliding_window, self_attention):
    if self_attention:  # cuDNN's own causal mask and window; only documents need a mask
        same_doc = (queries.segments[:, :, None] == keys.segments[:, None, :])[:, None]
        window = (sliding_window - 1, 0) if sliding_window else None
        return jax.nn.dot_product_attention(q, k, v, mask=same_doc, is_causal=True,
                                            local_window_size=window, implementation="cudnn")
    mask = attention_mask(queries, keys, sliding_window, self_attention)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


IMPLS = {"xla": _xla, "cudnn": _cudnn}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, queries: Tokens, keys: Tokens | None = None,
              *, impl: str = "xla", sliding_window: int = 0) -> jax.Array:
    """q [B, T, N, H], k and v [B, S, K, H] with N % K == 0 -> [B, T, N, H].

    ``keys`` defaults to ``queries`` (self-attention over the same tokens, in order)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not available; use one of {sorted(IMPLS)}")
    self_attention = keys is None
    return IMPLS[impl](q, k, v, queries, queries if keys is None else keys, sliding_window, self_attention)
