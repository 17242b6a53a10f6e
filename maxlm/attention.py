"""The attention seam: every layer calls ``attention(q, k, v, segment_ids, impl=...)``.

``xla`` is written out here with jnp (the math of ``jax.nn.dot_product_attention``'s XLA path:
scaled scores, masked with a large negative number, fp32 softmax, weighted values), laid out so
that XLA compiles it to plain batched matmuls; ``cudnn`` goes through
``jax.nn.dot_product_attention`` for cuDNN's flash kernel. ``pallas`` is the hand-written kernel
from ``maxlm.kernels``; config validation refuses it until that kernel lands. Grouped-query
attention is native: k and v carry fewer heads than q.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def attention_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
    """[B, 1, T, S] boolean: causal, and never across documents packed into one row."""
    t, s = q_segments.shape[-1], kv_segments.shape[-1]
    causal = jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]
    same_doc = q_segments[:, :, None] == kv_segments[:, None, :]
    return (causal[None] & same_doc)[:, None]


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
    # As jax.nn.dot_product_attention: a finite large negative, so no row is ever all -inf.
    logits = jnp.where(rows, logits, -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    ctx = jax.lax.dot_general(probs, vg, (((3,), (2,)), batch))  # [B, K, T*G, H]
    return ctx.reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
              *, impl: str = "xla", kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B, T, N, H], k and v [B, S, K, H] with N % K == 0 -> [B, T, N, H]."""
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"attention impl {impl!r} is not available; use 'xla' or 'cudnn'")
    kv_segments = segment_ids if kv_segment_ids is None else kv_segment_ids
    mask = attention_mask(segment_ids, kv_segments)
    if impl == "xla":
        # Scores and probabilities ([B, N, T, S] per layer) are recomputed in the backward pass
        # from q, k, v instead of being stored: one extra q·k matmul is cheaper than writing and
        # re-reading them, as flash attention does.
        return jax.checkpoint(_xla_attention)(q, k, v, mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
