"""The three Pallas kernels of flash attention (FlashAttention-2): forward, dq, and dk/dv.

Shapes inside (the wrapper in ``api.py`` pads before and slices after): q, do [B, T, N, H],
k, v [B, S, K, H] with T and S multiples of the blocks and H a power of two >= 16 (Triton's
tensors are powers of two, its dots at least 16 a side); lse, delta [B, N, T] fp32; segment ids
[B, T] and [B, S] int32; the schedule tables [B, n, 4] int32 (``schedule.py``).

Grouped-query attention reads K/V in place: query head n's program indexes kv head n // G in its
BlockSpec, so repeated K/V never exist. The dk/dv program of kv head h loops over its G query
heads itself and accumulates their contributions in fp32, so dk/dv are written once per kv head.

The block schedule: a program owns one block and loops over the blocks the table gives it, in
three phases: [lo, mid_lo) and [mid_hi, hi) masked, [mid_lo, mid_hi) without the positional
mask. Every block outside [lo, hi) is never loaded: that is the causal / window / document skip.

Online softmax (forward), in base 2 (exp2 is the GPU's native exponential; s = q.k * scale *
log2 e), per query row over the key blocks j it visits:

    m_j = max(m_{j-1}, max_k s_jk)               running maximum
    l_j = 2^(m_{j-1} - m_j) l_{j-1} + sum_k 2^(s_jk - m_j)
    acc_j = 2^(m_{j-1} - m_j) acc_{j-1} + 2^(s_j - m_j) V_j
    out = acc / l,  lse = m + log2 l             (lse is kept for the backward pass)

Masked scores count as zero probability (not merely a very negative score), so a row that sees
no key in a block, or none at all, never mixes in masked values: its out is 0 and its lse is
+EMPTY, which makes every backward probability 2^(s - lse) of it zero.

Backward (with delta = rowsum(out * do), computed by XLA before the kernels):

    p = 2^(s - lse),  dp = do V^T,  ds = p (dp - delta)
    dq = scale ds K   (dq pass: a program per query block, looping over key blocks)
    dk = scale ds^T Q,  dv = p^T do   (dk/dv pass: a program per key block, looping over the
                                       query blocks of every query head that shares it)

Accumulation is fp32 throughout; fp32 inputs use IEEE-exact dots (Triton would take TF32).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
NEG = -1e30  # score of a masked pair before the max: finite, so m - m_new is never inf - inf
EMPTY = 1e30  # lse of a row that saw no key


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels are specialised on (hashable: part of the jit and custom_vjp key)."""

    causal: bool
    window: int  # 0: none
    scale: float
    kv_len: int  # real keys; keys at or past it are padding
    segments: bool
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_warps_bwd: int
    num_stages: int
    interpret: bool


def _dot(a, b, contract=(1, 1)):
    """a · b contracting a's axis contract[0] with b's contract[1], fp32 result; IEEE for fp32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _mask(c: Static, q_first, k_first, bq: int, bk: int, q_seg, k_seg, positional: bool):
    """[bq, bk] bool of the pairs that may attend, or None when nothing is masked."""
    mask = None if q_seg is None else q_seg[:, None] == k_seg[None, :]
    if positional:
        qi = q_first + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        ki = k_first + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        pos = ki < c.kv_len
        if c.causal:
            pos &= ki <= qi
        if c.window:
            pos &= qi - ki < c.window
        mask = pos if mask is None else mask & pos
    return mask


def _phases(table_ref, body, carry):
    """Run body over the table's three intervals: masked, full (no positional mask), masked."""
    lo, mid_lo, mid_hi, hi = table_ref[0], table_ref[1], table_ref[2], table_ref[3]
    carry = lax.fori_loop(lo, mid_lo, functools.partial(body, positional=True), carry)
    carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(body, positional=False), carry)
    return lax.fori_loop(mid_hi, hi, functools.partial(body, positional=True), carry)


def _block_index(c: Static, n_blocks: int, reverse: bool):
    """The block this program owns along grid axis 0. Causal forward and dq programs run from the
    last query block (the most key blocks) down, so the longest programs start first."""
    i = pl.program_id(0)
    return n_blocks - 1 - i if reverse and c.causal else i


# ---------------------------------------------------------------- forward


def _fwd_kernel(table_ref, q_ref, k_ref, v_ref, *rest, c: Static, n_q: int):
    qseg_ref, kseg_ref, o_ref, lse_ref = rest if c.segments else (None, None, *rest)
    bq, bk = c.block_q, c.block_k
    q_first = _block_index(c, n_q, True) * bq
    q = q_ref[...]
    q_seg = qseg_ref[...] if c.segments else None
    scale = c.scale * LOG2E

    def body(j, carry, positional):
        acc, m, l = carry
        k_first = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_first, bk), :]
        v = v_ref[pl.ds(k_first, bk), :]
        s = _dot(q, k) * scale  # [bq, bk], base-2 logits
        mask = _mask(c, q_first, k_first, bq, bk, q_seg,
                     kseg_ref[pl.ds(k_first, bk)] if c.segments else None, positional)
        if mask is not None:
            s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old maximum
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, (1, 0))
        return acc, m_new, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = _phases(table_ref, body, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), EMPTY)


def forward(c: Static, table, q, k, v, q_seg, k_seg):
    """(out [B, T, N, H], lse [B, N, T] fp32, base 2)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g, bq, n_q = n // kh, c.block_q, t // c.block_q

    def qi(i):
        return n_q - 1 - i if c.causal else i

    in_specs = [
        pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, qi(i), 0)),
        pl.BlockSpec((None, bq, None, h), lambda i, bi, hi: (bi, qi(i), hi, 0)),
        pl.BlockSpec((None, s, None, h), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, s, None, h), lambda i, bi, hi: (bi, 0, hi // g, 0)),
    ]
    args = [table, q, k, v]
    if c.segments:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, qi(i))),
                     pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, k_seg]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, c=c, n_q=n_q),
        grid=(n_q, b, n),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, hi: (bi, qi(i), hi, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qi(i)))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
        interpret=c.interpret,
        name="flash_attention_fwd",
    )(*args)


# ---------------------------------------------------------------- backward: dq


def _dq_kernel(table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, c: Static, n_q: int):
    qseg_ref, kseg_ref, dq_ref = rest if c.segments else (None, None, *rest)
    bq, bk = c.block_q_bwd, c.block_k_bwd
    q_first = _block_index(c, n_q, True) * bq
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_seg = qseg_ref[...] if c.segments else None
    scale = c.scale * LOG2E

    def body(j, dq, positional):
        k_first = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_first, bk), :]
        v = v_ref[pl.ds(k_first, bk), :]
        p = jnp.exp2(_dot(q, k) * scale - lse)
        mask = _mask(c, q_first, k_first, bq, bk, q_seg,
                     kseg_ref[pl.ds(k_first, bk)] if c.segments else None, positional)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        ds = p * (_dot(do, v) - delta)
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = _phases(table_ref, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * c.scale).astype(dq_ref.dtype)


def backward_dq(c: Static, table, q, k, v, do, lse, delta, q_seg, k_seg):
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g, bq, n_q = n // kh, c.block_q_bwd, t // c.block_q_bwd

    def qi(i):
        return n_q - 1 - i if c.causal else i

    row = pl.BlockSpec((None, bq, None, h), lambda i, bi, hi: (bi, qi(i), hi, 0))
    vec = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qi(i)))
    kv = pl.BlockSpec((None, s, None, h), lambda i, bi, hi: (bi, 0, hi // g, 0))
    in_specs = [pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, qi(i), 0)), row, kv, kv, row, vec, vec]
    args = [table, q, k, v, do, lse, delta]
    if c.segments:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, qi(i))),
                     pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, k_seg]
    return pl.pallas_call(
        functools.partial(_dq_kernel, c=c, n_q=n_q),
        grid=(n_q, b, n),
        in_specs=in_specs,
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps_bwd, num_stages=c.num_stages),
        interpret=c.interpret,
        name="flash_attention_dq",
    )(*args)


# ---------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, c: Static, g: int):
    qseg_ref, kseg_ref, dk_ref, dv_ref = rest if c.segments else (None, None, *rest)
    bq, bk = c.block_q_bwd, c.block_k_bwd
    k_first = pl.program_id(0) * bk
    k, v = k_ref[...], v_ref[...]
    k_seg = kseg_ref[...] if c.segments else None
    scale = c.scale * LOG2E

    def head(gi, carry):  # the query heads gi = 0 .. G-1 that share this kv head, in turn
        def body(i, carry, positional):
            dk, dv = carry
            q_first = pl.multiple_of(i * bq, bq)
            rows = pl.ds(q_first, bq)
            q, do = q_ref[rows, gi, :], do_ref[rows, gi, :]
            p = jnp.exp2(_dot(q, k) * scale - lse_ref[gi, rows][:, None])
            mask = _mask(c, q_first, k_first, bq, bk, qseg_ref[rows] if c.segments else None, k_seg, positional)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, (0, 0))  # p^T do
            ds = p * (_dot(do, v) - delta_ref[gi, rows][:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))  # ds^T q
            return dk, dv

        return _phases(table_ref, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, g, head, (zeros, zeros))
    dk_ref[...] = (dk * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_dkv(c: Static, table, q, k, v, do, lse, delta, q_seg, k_seg):
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g, bk, n_k = n // kh, c.block_k_bwd, s // c.block_k_bwd
    group = pl.BlockSpec((None, t, g, h), lambda j, bi, hi: (bi, 0, hi, 0))  # the G query heads of kv head hi
    group_vec = pl.BlockSpec((None, g, t), lambda j, bi, hi: (bi, hi, 0))
    col = pl.BlockSpec((None, bk, None, h), lambda j, bi, hi: (bi, j, hi, 0))
    in_specs = [pl.BlockSpec((None, None, 4), lambda j, bi, hi: (bi, j, 0)), group, col, col, group,
                group_vec, group_vec]
    args = [table, q, k, v, do, lse, delta]
    if c.segments:
        in_specs += [pl.BlockSpec((None, t), lambda j, bi, hi: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda j, bi, hi: (bi, j))]
        args += [q_seg, k_seg]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, c=c, g=g),
        grid=(n_k, b, kh),
        in_specs=in_specs,
        out_specs=[col, col],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps_bwd, num_stages=c.num_stages),
        interpret=c.interpret,
        name="flash_attention_dkv",
    )(*args)
