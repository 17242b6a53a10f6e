"""The attention seam: every layer calls ``attention(q, k, v, segment_ids, impl=...)``.

``xla`` and ``cudnn`` both go through ``jax.nn.dot_product_attention`` (one code path; the
implementation argument picks XLA's fused softmax or cuDNN's flash kernel). ``pallas`` is the
hand-written kernel from ``maxlm.kernels``; config validation refuses it until that kernel lands.
Grouped-query attention is native: k and v carry fewer heads than q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
    """[B, 1, T, S] boolean: causal, and never across documents packed into one row."""
    t, s = q_segments.shape[-1], kv_segments.shape[-1]
    causal = jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]
    same_doc = q_segments[:, :, None] == kv_segments[:, None, :]
    return (causal[None] & same_doc)[:, None]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
              *, impl: str = "xla", kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B, T, N, H], k and v [B, S, K, H] with N % K == 0 -> [B, T, N, H]."""
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"attention impl {impl!r} is not available; use 'xla' or 'cudnn'")
    kv_segments = segment_ids if kv_segment_ids is None else kv_segment_ids
    mask = attention_mask(segment_ids, kv_segments)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
