"""The attention seam: ``attention(q, k, v, queries, keys, impl=..., sliding_window=...)``.

Layers pass token coordinates, not masks: ``queries`` and ``keys`` are ``Tokens`` (position and
segment id of each query and each key), and every implementation builds the mask it needs from
them. A query sees a key of the same segment (document) no later than itself and, with a sliding
window W, fewer than W tokens back. Over its own tokens (training, prefill without a cache) "no
later" is by index; over a preallocated cache, whose slots are filled up to each row's own length
(decode), it is by position. Segment id 0 marks an empty slot or padding.

``xla`` is written out with jnp (the math of ``jax.nn.dot_product_attention``'s XLA path) and
laid out so that XLA compiles it to plain batched matmuls. Self-attention longer than one block
runs a static block schedule (as splash attention does): each block of queries attends only to
the keys it can see under causality and the window, so the masked half of the [T, T] square is
never computed (about 2x faster fwd+bwd at T=1024, 4x with a 128-token window, on CPU).
``cudnn`` goes through ``jax.nn.dot_product_attention``: training and prefill hand it its native
causal mask (and sliding window) plus the document mask; decode hands it the positional mask.
``pallas`` is the flash attention kernel (``maxlm.kernels.flash_attention``: online softmax,
causal / window / document block skipping, GQA read in place) for self-attention: training and
prefill without a cache. Attention over a cache (decode, a prefill into a cache) falls back to
the ``xla`` path: one query row against a cache is a decode-shaped problem the training kernel
does not target. The kernel runs under ``shard_map`` at one call site (``_on_mesh``), batch over
the mesh axes the rules give "batch" and heads over those of "heads", so it works under any mesh;
compiled on GPU, interpret mode elsewhere. Grouped-query attention is native: k and v carry
fewer heads than q.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxlm.kernels.flash_attention import flash_attention
from maxlm.rules import mesh_axes

# As jax.nn.dot_product_attention: a finite large negative, so no row is ever all -inf.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# Queries per block of the blocked schedule. Measured fwd+bwd on CPU (scripts/bench_attention.py):
# 64 and 128 tie at T=256 and 1024; 256 loses at T=256 (a query block is most of the square).
# The larger of the two keeps matmuls big and the graph short (T / BLOCK blocks per layer).
BLOCK = 128
# Each query block is its own matmuls in the graph, and compile time grows with their number
# (fwd+bwd at T=8192 on CPU: 1 s dense, 14 s at 32 blocks, 34 s at 64), so long sequences take
# larger blocks: 32 of them still skip all but 1/32 of the masked half of the square.
MAX_BLOCKS = 32
# Scores are stored for the backward pass when a query sees at most this many keys, and
# recomputed from q, k, v (jax.checkpoint) otherwise. Storing measured 1-9% faster fwd+bwd on CPU
# (T=256: 113 vs 114 ms, T=1024: 1449 vs 1564, T=1024 window 128: 345 vs 379), but it keeps fp32
# probabilities per layer: at 256 keys that is 1 KiB per query and head, about what that head's
# q, k, v and output hold; a whole 8192-token prefix is 32 times more. Saving only the output
# (checkpoint_name, for a save_named policy) measured like recomputing: softmax's backward needs
# the probabilities, not the output.
STORE_KEYS = 256


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


def fold_heads(x: jax.Array, k_heads: int) -> jax.Array:
    """[B, T, N, H] -> [B, K, T*G, H]: the G query heads that share a kv head become rows."""
    b, t, n, h = x.shape
    return x.reshape(b, t, k_heads, n // k_heads, h).transpose(0, 2, 1, 3, 4).reshape(b, k_heads, -1, h)


def unfold_heads(x: jax.Array, n: int) -> jax.Array:
    """[B, K, T*G, H] -> [B, T, N, H], the inverse of ``fold_heads``."""
    b, k_heads, rows, h = x.shape
    g = n // k_heads
    return x.reshape(b, k_heads, rows // g, g, h).transpose(0, 2, 1, 3, 4).reshape(b, rows // g, n, h)


def _softmax_attention(qg: jax.Array, kg: jax.Array, vg: jax.Array, mask: jax.Array) -> jax.Array:
    """qg [B, K, T*G, H] (folded), kg and vg [B, K, S, H], mask [B, 1, T, S] -> [B, K, T*G, H].

    Two batched matmuls over (batch, kv head), batch dims leading and contraction innermost: the
    form XLA:CPU's matmul kernels take directly, forward and backward. The einsum layout of
    ``jax.nn.dot_product_attention`` ([G, B, K, T, S] under a vmap over G) makes XLA transpose the
    score-sized tensors around every matmul, which made attention ~1.5x slower on CPU."""
    b, _, rows, h = qg.shape
    t, s = mask.shape[2:]
    batch = ((0, 1), (0, 1))
    logits = jax.lax.dot_general(qg, kg, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / math.sqrt(h))
    mask = jnp.broadcast_to(mask[:, :, :, None, :], (b, 1, t, rows // t, s)).reshape(b, 1, rows, s)
    probs = jax.nn.softmax(jnp.where(mask, logits, MASKED), axis=-1).astype(vg.dtype)
    return jax.lax.dot_general(probs, vg, (((3,), (2,)), batch))


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense grouped-query attention over the whole [T, S] square, masked by ``mask``."""
    kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return unfold_heads(_softmax_attention(fold_heads(q, k.shape[2]), kg, vg, mask), q.shape[2])


def query_blocks(t: int, block: int, sliding_window: int = 0) -> list[tuple[int, int, int]]:
    """The static schedule: (first query, end query, first key) of each block of queries. A
    query block sees the keys [first key, end query): causality ends the range, the window (or
    the row start) begins it; keys outside it are masked for every query of the block."""
    return [(lo, min(lo + block, t), max(0, lo - sliding_window + 1) if sliding_window else 0)
            for lo in range(0, t, block)]


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array,
                      sliding_window: int = 0, *, block: int = BLOCK) -> jax.Array:
    """Causal self-attention that computes only the key range each query block can see: block i
    attends to keys [first key, end of block i), so the masked half of the square (and, with a
    window, everything behind it) is never computed. Each block is an exact softmax of its own
    rows, so no cross-block combine is needed; the last block may be short (no padding). Inside a
    block the mask is the dense one: same segment, causal by index, within the window. Every row
    sees at least itself, so no row is fully masked, padding (segment 0) rows included."""
    k_heads, n = k.shape[2], q.shape[2]
    g = n // k_heads
    qg, kg, vg = fold_heads(q, k_heads), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    outs = []
    for lo, hi, first in query_blocks(q.shape[1], block, sliding_window):
        iq, ik = jnp.arange(lo, hi)[:, None], jnp.arange(first, hi)[None, :]  # iota, not constants
        visible = (ik <= iq) & ((iq - ik < sliding_window) if sliding_window else True)
        mask = (segments[:, lo:hi, None] == segments[:, None, first:hi]) & visible
        outs.append(_softmax_attention(qg[:, :, lo * g:hi * g], kg[:, :, first:hi], vg[:, :, first:hi],
                                       mask[:, None]))
    return unfold_heads(jnp.concatenate(outs, axis=2), n)


def self_attention_schedule(t: int, sliding_window: int = 0, block: int = BLOCK) -> list[tuple[int, int, int]]:
    """The blocks ``xla`` self-attention over t tokens computes (``query_blocks``; one dense block
    when t fits in one), as the planner counts them too."""
    block = max(block, -(-t // MAX_BLOCKS))
    return [(0, t, 0)] if t <= block else query_blocks(t, block, sliding_window)


def stores_scores(schedule: list[tuple[int, int, int]]) -> bool:
    """Whether the probabilities are kept for the backward pass (else recomputed from q, k, v)."""
    return max(hi - first for _, hi, first in schedule) <= STORE_KEYS


def _xla(q, k, v, queries, keys, sliding_window, self_attention, *, block=BLOCK):
    # Attention over a cache (decode, a prefill into a cache) and sequences of at most one block
    # take the dense square; longer self-attention takes the blocked schedule.
    t = q.shape[1]
    schedule = self_attention_schedule(t, sliding_window, block)
    if not self_attention or len(schedule) == 1:
        mask = attention_mask(queries, keys, sliding_window, self_attention)
        core, store = (lambda q, k, v: _xla_attention(q, k, v, mask)), k.shape[1] <= STORE_KEYS
    else:
        core = functools.partial(blocked_attention, segments=queries.segments,
                                 sliding_window=sliding_window, block=schedule[0][1])
        store = stores_scores(schedule)
    return core(q, k, v) if store else jax.checkpoint(core)(q, k, v)


def _cudnn(q, k, v, queries, keys, sliding_window, self_attention):
    if self_attention:  # cuDNN's own causal mask and window; only documents need a mask
        same_doc = (queries.segments[:, :, None] == keys.segments[:, None, :])[:, None]
        window = (sliding_window - 1, 0) if sliding_window else None
        return jax.nn.dot_product_attention(q, k, v, mask=same_doc, is_causal=True,
                                            local_window_size=window, implementation="cudnn")
    mask = attention_mask(queries, keys, sliding_window, self_attention)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def _on_mesh(fn, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
    """fn(q, k, v, segments) per shard: the one shard_map around the Pallas kernel. Batch splits
    over the axes of "batch" and heads over those of "heads" (maxlm.rules), each only where the
    size divides (else that dimension is replicated); a kernel sees whole sequences and whole kv
    groups, so its shards need no communication. Without a mesh, or on one device, fn runs as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q, k, v, segments)
    manual = set(mesh.manual_axes)  # already split by an enclosing shard_map

    def axes(name: str, *sizes: int) -> tuple[str, ...] | None:
        names = tuple(a for a in mesh_axes(name) if a not in manual and mesh.shape[a] > 1)
        degree = math.prod(mesh.shape[a] for a in names)
        return names if names and all(size % degree == 0 for size in sizes) else None

    batch, heads = axes("batch", q.shape[0]), axes("heads", q.shape[2], k.shape[2])
    # Manual over every axis not already manual (a pipeline's vmap adds its stage axis to the
    # specs, which needs it manual). vma checks are off: pallas_call's outputs cannot declare
    # their variance across jax 0.10-0.12. Gradients stay exact without them: over an axis the
    # specs leave out, every shard computes the same values, and the transpose divides the
    # output cotangent by the axis size and sums the input cotangents back over it.
    qkv, seg = PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None)
    return jax.shard_map(fn, in_specs=(qkv, qkv, qkv, seg), out_specs=qkv, check_vma=False,
                         axis_names=set(mesh.axis_names) - manual)(q, k, v, segments)


def _pallas(q, k, v, queries, keys, sliding_window, self_attention):
    if not self_attention:  # over a cache: see the module docstring
        return _xla(q, k, v, queries, keys, sliding_window, self_attention)
    kernel = functools.partial(flash_attention, causal=True, sliding_window=sliding_window)
    return _on_mesh(kernel, q, k, v, queries.segments)


IMPLS = {"xla": _xla, "cudnn": _cudnn, "pallas": _pallas}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, queries: Tokens, keys: Tokens | None = None,
              *, impl: str = "xla", sliding_window: int = 0) -> jax.Array:
    """q [B, T, N, H], k and v [B, S, K, H] with N % K == 0 -> [B, T, N, H].

    ``keys`` defaults to ``queries`` (self-attention over the same tokens, in order)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not available; use one of {sorted(IMPLS)}")
    self_attention = keys is None
    out = IMPLS[impl](q, k, v, queries, queries if keys is None else keys, sliding_window, self_attention)
    return checkpoint_name(out, "attention_out")  # a save_named-style policy may keep it
