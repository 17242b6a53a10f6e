"""Dense attention in plain jnp: the reference the kernels are tested against.

The whole [T, S] score matrix in fp32, the mask built from its definition, one softmax. A query
that sees no key at all outputs zeros (as the kernel does; maxlm's self-attention never has one,
every token sees itself).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def reference_mask(t: int, s: int, q_segment_ids=None, kv_segment_ids=None, *, causal: bool = False,
                   sliding_window: int = 0) -> jax.Array:
    """[B or 1, T, S] bool: same segment, key index <= query index (causal), query - key < window."""
    qi, ki = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    mask = jnp.ones((t, s), bool)
    if causal:
        mask &= ki <= qi
    if sliding_window:
        mask &= qi - ki < sliding_window
    mask = mask[None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return mask


def attention_reference(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal: bool = False,
                        sliding_window: int = 0, scale: float | None = None) -> jax.Array:
    """q [B, T, N, H], k and v [B, S, K, H] (N % K == 0) -> [B, T, N, H] in q's dtype."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)  # query head n uses kv head n // G
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    mask = reference_mask(t, s, q_segment_ids, kv_segment_ids, causal=causal,
                          sliding_window=sliding_window)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    seen = jnp.any(mask, axis=-1, keepdims=True)
    probs = jnp.where(seen, jax.nn.softmax(jnp.where(seen, logits, 0.0), axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, n, h).astype(q.dtype)
