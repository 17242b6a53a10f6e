"""The fused INT4 weight-only matmul in Pallas: x [M, K] · dequantize(qweight, scales) -> [M, N].

Each program owns one [block_m, block_n] output tile (and, with ``k_splits`` > 1, one slice of K)
and walks K in sub-blocks of ``SUB`` = 128 rows, i.e. 16 packed words, so the weight streams from
memory once as int32 and is never written back dequantised. A sub-block's word w holds rows
8w .. 8w+7, so instead of interleaving the 8 nibbles back into a [128, block_n] tile (a reshape
Triton lowers poorly) the kernel splits the contraction by nibble position j:

    x[:, r0:r0+128] · W[r0:r0+128, :] = sum_j  x[:, r0+j :: 8] · nibble_j(words)

eight [block_m, 16] x [16, block_n] dots, with x's strided columns loaded straight from memory
(they share cache lines, so the eight loads cost one). A nibble becomes a float without an
int->float convert (``MAGIC``): OR-ed into the mantissa of a float whose ulp is 1 it reads as
OFFSET + nibble, exactly. Two dequantisation schemes:

  * ``group % 128 == 0`` (the default group 128): a sub-block lies inside one group, so the scale
    moves out of the tile: ``(sum_j x_j · w_j) * scale_row``. For bf16 the offset does too
    (``w_j`` = 128 + nibble, and 136 * rowsum(x) comes off the fp32 sum): per weight a shift and
    an and-or, nothing else. fp16 and fp32 subtract their offset in the tile (one more op).
  * otherwise (group 64, 32, ...): the scale varies inside the sub-block, so each word's scale row
    is gathered (``word * 8 // group``) and the tile is dequantised, ``(nib - 8) * scale``, in
    fp32 and rounded to x's dtype, exactly as the reference does, before the dot.

Accumulation is fp32 (the dots' ``preferred_element_type``). The M, N and K edges are masked
loads/stores (masked-off x reads are 0, so they add nothing), not padded copies: padding the
weight would cost a second pass over it, and every extra XLA op is a launch that a 10 us decode
matmul cannot afford. Triton wants power-of-two tensor shapes and dots of at least 16 per side,
hence block sizes that are powers of two with block_m >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from maxlm.kernels.int4_matmul.reference import PACK

SUB = 128  # rows per inner step: 16 words, the smallest K a Triton dot takes (16)
WORDS = SUB // PACK


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def default_blocks(m: int, k: int, n: int) -> dict:
    """Block sizes and launch parameters for an [m, k] · [k, n] problem. Decode (m <= 64): one
    M block of at least 16 rows (Triton's smallest dot), narrow N blocks so that an 8192-wide
    layer still makes a few hundred programs to keep every SM streaming weight. Prefill: 64 or
    128-row M blocks so each weight tile is dequantised once per 64-128 rows."""
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        return dict(block_m=bm, block_n=32 if m <= 16 else 64, block_k=256, k_splits=1, num_warps=4, num_stages=4)
    bm = 64 if m <= 512 else 128
    return dict(block_m=bm, block_n=128, block_k=256, k_splits=1, num_warps=8 if bm == 128 else 4, num_stages=3)


def check_blocks(block_m: int, block_n: int, block_k: int, k_splits: int) -> str | None:
    """Why these block sizes cannot drive the kernel, or None."""
    if not (_pow2(block_m) and block_m >= 16):
        return f"block_m {block_m} must be a power of two >= 16 (Triton's smallest dot)"
    if not (_pow2(block_n) and block_n >= 16):
        return f"block_n {block_n} must be a power of two >= 16"
    if block_k <= 0 or block_k % SUB:
        return f"block_k {block_k} must be a positive multiple of {SUB}"
    if k_splits < 1:
        return f"k_splits {k_splits} must be >= 1"
    return None


def _gather(ref, rows, cols, mask):
    """ref[rows, cols] for index arrays that broadcast together, masked-off entries 0. (A strided
    pl.ds would say the same, but interpret mode cannot discharge strided loads; on Triton both
    become the same pointer tensor.)"""
    shape = jnp.broadcast_shapes(rows.shape, cols.shape)
    rows, cols = jnp.broadcast_to(rows, shape), jnp.broadcast_to(cols, shape)
    return plgpu.load(ref.at[rows, cols], mask=jnp.broadcast_to(mask, shape), other=0)


# Nibble -> float without an int->float convert (the convert unit, 16 per SM per clock, would cap
# a decode matmul well below memory speed): OR the nibble into the mantissa of a float whose ulp
# is 1, giving OFFSET + nibble exactly. Per dtype: (int type of its width, bits of OFFSET, OFFSET).
MAGIC = {jnp.dtype(jnp.bfloat16): (jnp.int16, 0x4300, 128.0),
         jnp.dtype(jnp.float16): (jnp.int16, 0x6400, 1024.0),
         jnp.dtype(jnp.float32): (jnp.int32, 0x4B000000, 2.0 ** 23)}


def _nibble(words, j, dtype):
    """Nibble j of every word, as ``dtype``, plus the dtype's OFFSET (exact)."""
    itype, bits, _ = MAGIC[dtype]
    v = jnp.bitwise_or(jnp.bitwise_and(jnp.right_shift(words, 4 * j), 0xF), bits)
    return jax.lax.bitcast_convert_type(v.astype(itype), dtype)


def _kernel(x_ref, qw_ref, s_ref, o_ref, *, m, k, n, group, block_m, block_n, unroll, steps,
            k_splits, x_dtype):
    pi, pj = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if k_splits > 1 else 0
    row_ok = (pi * block_m + jnp.arange(block_m) < m)[:, None]
    col_ok = (pj * block_n + jnp.arange(block_n) < n)[None, :]
    k_tail = k % (unroll * SUB) != 0  # the last step runs past K: only then do K-side masks cost anything
    n_groups = k // group
    offset = MAGIC[x_dtype][2]
    # bf16: keep OFFSET + nibble in the tile and take (OFFSET + 8) * rowsum(x) off the fp32 result,
    # one op per weight saved; exact enough since OFFSET is 128 (bf16 has 8 mantissa bits). fp16's
    # OFFSET is 1024 and fp32's 2**23, too large to cancel, so they subtract in the tile (exact).
    fold = x_dtype == jnp.bfloat16
    # fp32 activations: exact fp32 products (Triton's default for an fp32 dot is TF32, ~3e-4 off).
    precision = jax.lax.Precision.HIGHEST if x_dtype == jnp.float32 else None

    def sub_block(r0, acc):
        """acc + x[:, r0:r0+128] · W[r0:r0+128, :], one 128-row sub-block."""
        w0 = r0 // PACK
        word_ok = col_ok
        if k_tail:
            word_ok = word_ok & ((w0 + jnp.arange(WORDS)) < k // PACK)[:, None]
        words = plgpu.load(qw_ref.at[pl.ds(w0, WORDS), :], mask=word_ok, other=0)
        xs = []
        for j in range(PACK):
            x_ok = row_ok
            if k_tail:
                x_ok = x_ok & ((r0 + j + PACK * jnp.arange(WORDS)) < k)[None, :]
            xs.append(_gather(x_ref, jnp.arange(block_m)[:, None], (r0 + j + PACK * jnp.arange(WORDS))[None, :], x_ok))
        if group % SUB:  # the scale changes inside the sub-block: dequantise the tile as the reference does
            gidx = jnp.minimum((w0 + jnp.arange(WORDS)) * PACK // group, n_groups - 1)
            scale = _gather(s_ref, gidx[:, None], jnp.arange(block_n)[None, :], col_ok).astype(jnp.float32)
            for j, xj in enumerate(xs):
                q = _nibble(words, j, x_dtype).astype(jnp.float32) - (offset + 8)
                acc += jnp.dot(xj, (q * scale).astype(x_dtype), preferred_element_type=jnp.float32, precision=precision)
            return acc
        # One group spans the sub-block: its scale multiplies the [block_m, block_n] partial sum.
        scale = plgpu.load(s_ref.at[pl.ds(jnp.minimum(r0 // group, n_groups - 1), 1), :], mask=col_ok, other=0)
        part = jnp.zeros((block_m, block_n), jnp.float32)
        for j, xj in enumerate(xs):
            w = _nibble(words, j, x_dtype)
            if not fold:
                w = w - jnp.asarray(offset + 8, x_dtype)
            part += jnp.dot(xj, w, preferred_element_type=jnp.float32, precision=precision)
        if fold:
            xsum = functools.reduce(jnp.add, [xj.astype(jnp.float32) for xj in xs])
            part -= (offset + 8) * jnp.sum(xsum, axis=1, keepdims=True)
        return acc + part * scale.astype(jnp.float32)

    def step(t, acc):
        for u in range(unroll):
            acc = sub_block((split * steps + t) * unroll * SUB + u * SUB, acc)
        return acc

    last = pl.cdiv(k, unroll * SUB)  # steps past the end of K (the last split's tail) are skipped
    n_steps = jnp.clip(last - split * steps, 0, steps) if k_splits > 1 else steps
    acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=row_ok & col_ok)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "k_splits", "num_warps",
                                             "num_stages", "interpret"))
def int4_matmul_pallas(x: jax.Array, qweight: jax.Array, scales: jax.Array, *, block_m: int, block_n: int,
                       block_k: int, k_splits: int = 1, num_warps: int = 4, num_stages: int = 3,
                       interpret: bool = False) -> jax.Array:
    """x [M, K] · W [K, N] (qweight [K // 8, N] int32, scales [K // group, N]) -> [M, N] in x's
    dtype, through the Pallas kernel. Shapes are trusted: ``ops.int4_matmul`` checks them."""
    m, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    steps_total = pl.cdiv(k, block_k)
    k_splits = min(k_splits, steps_total)
    steps = pl.cdiv(steps_total, k_splits)
    grid = (pl.cdiv(m, block_m), pl.cdiv(n, block_n)) + ((k_splits,) if k_splits > 1 else ())
    kernel = functools.partial(
        _kernel, m=m, k=k, n=n, group=group, block_m=block_m, block_n=block_n, unroll=block_k // SUB,
        steps=steps, k_splits=k_splits, x_dtype=jnp.dtype(x.dtype))
    # Blocks span all of K (the kernel walks it with dynamic slices); only M and N are tiled.
    in_specs = [pl.BlockSpec((block_m, k), lambda i, j, *_: (i, 0)),
                pl.BlockSpec((k // PACK, block_n), lambda i, j, *_: (0, j)),
                pl.BlockSpec((scales.shape[0], block_n), lambda i, j, *_: (0, j))]
    if k_splits > 1:  # fp32 partial sums per split, added (and cast) by XLA in one fused op
        out_shape = jax.ShapeDtypeStruct((k_splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((block_m, block_n), lambda i, j: (i, j))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_matmul")(x, qweight, scales)
    return out.sum(0).astype(x.dtype) if k_splits > 1 else out

