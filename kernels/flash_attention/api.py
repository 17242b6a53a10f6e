"""``flash_attention``: the public entry, its custom_vjp, and the padding that makes any shape fit.

The kernels take powers of two: head dims are zero-padded to the next power of two >= 16 (64 and
128 run as they are; 80 and 96 run at 128, 48 at 64; zero columns change no dot product and their
outputs are sliced away), and lengths are padded to whole blocks (padded keys are masked, padded
queries are dropped). Padding and slicing sit outside the custom_vjp, so JAX differentiates them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from maxlm.kernels.flash_attention import kernel
from maxlm.kernels.flash_attention.schedule import PAD_SEGMENT, block_tables

MIN_DIM = 16  # Triton's smallest dot operand side


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16): the forward's query and key blocks, the backward's (both
    its passes share one schedule), and Triton's warps and pipeline stages. Lengths shorter than a
    block use a smaller one. The defaults are the usual FlashAttention-2 Triton tiles for
    H100-class GPUs; scripts/bench_attention.py --sweep times others."""

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None  # None: 4 for head dims <= 64, else 8
    num_warps_bwd: int | None = None
    num_stages: int = 2


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _fit(block: int, length: int) -> int:
    """The block for a length: at most the length rounded up to a power of two, at least 16."""
    if block < MIN_DIM or block & (block - 1):
        raise ValueError(f"flash attention block sizes must be powers of two >= {MIN_DIM}, got {block}")
    return max(MIN_DIM, min(block, _pow2(length)))


def _pad_to(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def default_interpret() -> bool:
    """Interpret mode (the kernels run as jnp ops) unless JAX's default backend is a GPU."""
    return jax.default_backend() != "gpu"


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, *, causal: bool = False, sliding_window: int = 0,
                    scale: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Flash attention, differentiable in q, k and v.

    q [B, T, N, H], k and v [B, S, K, H] with N % K == 0 (query head n reads kv head n // (N/K));
    segment ids [B, T] and [B, S] int32 (>= 0; a query sees keys of its own segment only; give one
    for both when T == S); ``causal``: key index <= query index; ``sliding_window`` W (with causal):
    query - key < W. ``scale`` defaults to 1/sqrt(H). Returns [B, T, N, H] in q's dtype. A query
    that sees no key returns zeros. ``interpret`` defaults to True off GPU."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if k.shape != (b, s, kh, h) or v.shape != k.shape:
        raise ValueError(f"flash attention: k {k.shape} and v {v.shape} must both be [B={b}, S, K, H={h}]")
    if n % kh:
        raise ValueError(f"flash attention: {n} query heads are not a multiple of {kh} kv heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if sliding_window and not causal:
        raise ValueError("flash attention: a sliding window needs causal=True")
    if kv_segment_ids is None and q_segment_ids is not None:
        if s != t:
            raise ValueError("flash attention: give kv_segment_ids when key and query lengths differ")
        kv_segment_ids = q_segment_ids
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash attention: give q_segment_ids with kv_segment_ids")
    bs = block_sizes or BlockSizes()
    hp = max(MIN_DIM, _pow2(h))
    bq, bk = _fit(bs.block_q, t), _fit(bs.block_k, s)
    bq_bwd, bk_bwd = _fit(bs.block_q_bwd, t), _fit(bs.block_k_bwd, s)
    tp, sp = -(-t // max(bq, bq_bwd)) * max(bq, bq_bwd), -(-s // max(bk, bk_bwd)) * max(bk, bk_bwd)
    warps = 4 if hp <= 64 else 8
    c = kernel.Static(causal=bool(causal), window=int(sliding_window), kv_len=s,
                      scale=float(1.0 / math.sqrt(h) if scale is None else scale),
                      segments=q_segment_ids is not None, block_q=bq, block_k=bk, block_q_bwd=bq_bwd,
                      block_k_bwd=bk_bwd, num_warps=bs.num_warps or warps, num_warps_bwd=bs.num_warps_bwd or warps,
                      num_stages=bs.num_stages, interpret=default_interpret() if interpret is None else bool(interpret))

    qp = _pad_to(_pad_to(q, 3, hp), 1, tp)
    kp, vp = (_pad_to(_pad_to(x, 3, hp), 1, sp) for x in (k, v))
    q_seg = k_seg = None
    if c.segments:
        q_seg = _pad_to(q_segment_ids.astype(jnp.int32), 1, tp, PAD_SEGMENT)
        k_seg = _pad_to(kv_segment_ids.astype(jnp.int32), 1, sp, PAD_SEGMENT)
    tables = dict(causal=c.causal, window=c.window, q_segments=q_seg, kv_segments=k_seg)
    fwd_rows, _ = block_tables(b, t, s, bq, bk, tp // bq, sp // bk, **tables)
    bwd_rows, bwd_cols = block_tables(b, t, s, bq_bwd, bk_bwd, tp // bq_bwd, sp // bk_bwd, **tables)
    out = _flash(c, qp, kp, vp, q_seg, k_seg, fwd_rows, bwd_rows, bwd_cols)
    return out[:, :t, :, :h]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(c, q, k, v, q_seg, k_seg, fwd_rows, bwd_rows, bwd_cols):
    return kernel.forward(c, fwd_rows, q, k, v, q_seg, k_seg)[0]


def _flash_fwd(c, q, k, v, q_seg, k_seg, fwd_rows, bwd_rows, bwd_cols):
    out, lse = kernel.forward(c, fwd_rows, q, k, v, q_seg, k_seg)
    return out, (q, k, v, q_seg, k_seg, bwd_rows, bwd_cols, out, lse)


def _flash_bwd(c, res, do):
    q, k, v, q_seg, k_seg, bwd_rows, bwd_cols, out, lse = res
    # delta_i = rowsum(out_i * do_i) = sum_j p_ij dp_ij: one fused XLA reduction, [B, N, T] fp32.
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    do = do.astype(q.dtype)
    dq = kernel.backward_dq(c, bwd_rows, q, k, v, do, lse, delta, q_seg, k_seg)
    dk, dv = kernel.backward_dkv(c, bwd_cols, q, k, v, do, lse, delta, q_seg, k_seg)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
