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
# The kernel's variants (``variant=``; see the module docstring and the README):
#   "dot"       tensor cores, eight [block_m, 16] x [16, block_n] dots per 128 rows, x loaded strided;
#   "dot_perm"  the same dots, x permuted once per call by XLA so each dot's x operand is contiguous;
#   "dot_wide"  x permuted, the eight nibble tiles stacked into one [128, block_n] tile: one dot per 128 rows;
#   "gemv"      CUDA cores, no dot: for decode (M <= ~8), x permuted, fp32 FMAs, reduced over K at the end;
#   "gemv_strided"  the same with x's strided columns loaded directly (no permutation op).
VARIANTS = ("dot", "dot_perm", "dot_wide", "gemv", "gemv_strided")


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def default_blocks(m: int, k: int, n: int, variant: str = "dot") -> dict:
    """Block sizes and launch parameters for an [m, k] · [k, n] problem. Decode (m <= 64): one
    M block of at least 16 rows (Triton's smallest dot), narrow N blocks so that an 8192-wide
    layer still makes a few hundred programs to keep every SM streaming weight. Prefill: 64 or
    128-row M blocks so each weight tile is dequantised once per 64-128 rows."""
    if variant.startswith("gemv"):  # one M block of M rounded up (<= 16 rows), split K for programs in flight
        bm = min(16, 1 << (max(m, 1) - 1).bit_length())
        return dict(block_m=bm, block_n=64, block_k=256, k_splits=4, num_warps=4, num_stages=3)
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        return dict(block_m=bm, block_n=32 if m <= 16 else 64, block_k=256, k_splits=1, num_warps=4, num_stages=4)
    bm = 64 if m <= 512 else 128
    return dict(block_m=bm, block_n=128, block_k=256, k_splits=1, num_warps=8 if bm == 128 else 4, num_stages=3)


def check_blocks(block_m: int, block_n: int, block_k: int, k_splits: int, variant: str = "dot") -> str | None:
    """Why these block sizes cannot drive the kernel (``variant``), or None."""
    if variant not in VARIANTS:
        return f"variant {variant!r} must be one of {', '.join(VARIANTS)}"
    if variant.startswith("gemv"):  # no dot: any power-of-two rows (a Python loop), W = block_k / 8 words a power of two
        if not (_pow2(block_m) and block_m <= 16):
            return f"block_m {block_m} must be a power of two <= 16 for variant {variant}"
        if not (_pow2(block_n) and block_n >= 16):
            return f"block_n {block_n} must be a power of two >= 16"
        if not (_pow2(block_k) and block_k >= SUB):
            return f"block_k {block_k} must be a power of two >= {SUB} for variant {variant}"
        return None if k_splits >= 1 else f"k_splits {k_splits} must be >= 1"
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


def _nibbles_stacked(words, dtype):
    """All eight nibbles of a [WORDS, block_n] word tile as one [8 * WORDS, block_n] tile of ``dtype``
    (plus OFFSET), row ``j * WORDS + i`` = nibble j of word i: the order of a permuted x chunk."""
    itype, bits, _ = MAGIC[dtype]
    shifts = (4 * jnp.arange(PACK, dtype=jnp.int32))[:, None, None]
    v = jnp.bitwise_or(jnp.bitwise_and(jnp.right_shift(words[None, :, :], shifts), 0xF), bits)
    v = v.reshape(PACK * words.shape[0], words.shape[1])
    return jax.lax.bitcast_convert_type(v.astype(itype), dtype)


def _kernel(x_ref, qw_ref, s_ref, o_ref, *, m, k, n, group, block_m, block_n, unroll, steps,
            k_splits, x_dtype, x_perm=False, wide=False):
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

    def x_cols(r0, j):
        """x[:, r0+j::8] over the sub-block: strided in x, contiguous in the permuted x (which is
        zero-padded to whole steps, so it needs no K mask)."""
        if x_perm:
            return plgpu.load(x_ref.at[:, pl.ds(r0 + j * WORDS, WORDS)], mask=row_ok, other=0)
        x_ok = row_ok
        if k_tail:
            x_ok = x_ok & ((r0 + j + PACK * jnp.arange(WORDS)) < k)[None, :]
        return _gather(x_ref, jnp.arange(block_m)[:, None], (r0 + j + PACK * jnp.arange(WORDS))[None, :], x_ok)

    def sub_block(r0, acc):
        """acc + x[:, r0:r0+128] · W[r0:r0+128, :], one 128-row sub-block."""
        w0 = r0 // PACK
        word_ok = col_ok
        if k_tail:
            word_ok = word_ok & ((w0 + jnp.arange(WORDS)) < k // PACK)[:, None]
        words = plgpu.load(qw_ref.at[pl.ds(w0, WORDS), :], mask=word_ok, other=0)
        if wide:  # x permuted: x[:, r0:r0+128] in nibble-major order meets the stacked nibble tile, one dot
            xw = plgpu.load(x_ref.at[:, pl.ds(r0, SUB)], mask=row_ok, other=0)
            tile = _nibbles_stacked(words, x_dtype)
            if group % SUB:
                gidx = jnp.minimum((w0 + jnp.arange(WORDS)) * PACK // group, n_groups - 1)
                scale = _gather(s_ref, gidx[:, None], jnp.arange(block_n)[None, :], col_ok).astype(jnp.float32)
                scale = jnp.broadcast_to(scale[None], (PACK, WORDS, block_n)).reshape(SUB, block_n)
                q = tile.astype(jnp.float32) - (offset + 8)
                return acc + jnp.dot(xw, (q * scale).astype(x_dtype), preferred_element_type=jnp.float32,
                                     precision=precision)
            if not fold:
                tile = tile - jnp.asarray(offset + 8, x_dtype)
            part = jnp.dot(xw, tile, preferred_element_type=jnp.float32, precision=precision)
            if fold:
                part -= (offset + 8) * jnp.sum(xw.astype(jnp.float32), axis=1, keepdims=True)
            scale = plgpu.load(s_ref.at[pl.ds(jnp.minimum(r0 // group, n_groups - 1), 1), :], mask=col_ok, other=0)
            return acc + part * scale.astype(jnp.float32)
        xs = [x_cols(r0, j) for j in range(PACK)]
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


# fp32 bits of 2**23: OR-ed with a nibble they read as 2**23 + nibble (the CUDA-core variant works in fp32).
F32_MAGIC, F32_OFFSET = 0x4B000000, 2.0 ** 23


def _gemv_kernel(x_ref, qw_ref, s_ref, o_ref, *, m, k, n, group, block_m, block_n, block_k, steps,
                 k_splits, x_perm):
    """The CUDA-core variant for decode: no tensor cores, so no 16-row padding of x. A step loads a
    [W, block_n] word tile (W = block_k / 8), turns each nibble j into fp32 q (magic number, exact),
    and for every row r of x adds (sum_j x[r, 8w+j] * q_j[w, :]) * scale[w, :] into an fp32
    [W, block_n] accumulator per row, element-wise (FMAs, no cross-thread traffic); the W axis is
    summed once, at the end. With x permuted (``x_perm``), the W values x[r, c0+j::8] of a step are
    contiguous; otherwise they are strided loads."""
    pi, pj = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if k_splits > 1 else 0
    w_n = block_k // PACK
    col_ok = (pj * block_n + jnp.arange(block_n) < n)[None, :]
    k_tail = k % block_k != 0
    n_groups = k // group
    one_group = group % block_k == 0  # a step lies in one group: one scale row

    def step(t, accs):
        c0 = (split * steps + t) * block_k
        w0 = c0 // PACK
        word_ok = col_ok
        if k_tail:
            word_ok = word_ok & ((w0 + jnp.arange(w_n)) < k // PACK)[:, None]
        words = plgpu.load(qw_ref.at[pl.ds(w0, w_n), :], mask=word_ok, other=0)
        if one_group:
            scale = plgpu.load(s_ref.at[pl.ds(jnp.minimum(c0 // group, n_groups - 1), 1), :], mask=col_ok, other=0)
        else:
            gidx = jnp.minimum((w0 + jnp.arange(w_n)) * PACK // group, n_groups - 1)
            scale = _gather(s_ref, gidx[:, None], jnp.arange(block_n)[None, :], col_ok)
        scale = scale.astype(jnp.float32)
        qs = []
        for j in range(PACK):
            v = jnp.bitwise_or(jnp.bitwise_and(jnp.right_shift(words, 4 * j), 0xF), F32_MAGIC)
            qs.append(jax.lax.bitcast_convert_type(v, jnp.float32) - (F32_OFFSET + 8))
        new = []
        for r, acc in enumerate(accs):
            r_ok = pi * block_m + r < m
            part = None
            for j, q in enumerate(qs):
                if x_perm:  # zero-padded to whole steps: no K mask
                    cols, ok = c0 + j * w_n + jnp.arange(w_n), r_ok
                else:
                    cols = c0 + j + PACK * jnp.arange(w_n)
                    ok = (r_ok & (cols < k)) if k_tail else r_ok
                xj = _gather(x_ref, jnp.full((1, 1), r, jnp.int32), cols[:, None],
                             jnp.broadcast_to(ok, (w_n,))[:, None]).astype(jnp.float32)
                part = xj * q if part is None else part + xj * q
            new.append(acc + part * scale)
        return tuple(new)

    last = pl.cdiv(k, block_k)
    n_steps = jnp.clip(last - split * steps, 0, steps) if k_splits > 1 else steps
    zero = jnp.zeros((w_n, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, n_steps, step, tuple(zero for _ in range(block_m)))
    for r, acc in enumerate(accs):
        out = jnp.sum(acc, axis=0, keepdims=True)
        plgpu.store(o_ref.at[pl.ds(r, 1), :], out.astype(o_ref.dtype), mask=col_ok & (pi * block_m + r < m))


def permute_x(x: jax.Array, chunk: int) -> jax.Array:
    """x [M, K] -> [M, Kp] (Kp = K rounded up to ``chunk``, zero-padded) with each chunk of ``chunk``
    columns in nibble-major order: column ``c + j * (chunk // 8) + i`` holds x[:, c + 8 i + j], so a
    kernel's x operand for nibble j is contiguous. One small XLA op per call (x is [M, K], tiny)."""
    m, k = x.shape
    kp = pl.cdiv(k, chunk) * chunk
    if kp != k:
        x = jnp.pad(x, ((0, 0), (0, kp - k)))
    return x.reshape(m, kp // chunk, chunk // PACK, PACK).transpose(0, 1, 3, 2).reshape(m, kp)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "k_splits", "num_warps",
                                             "num_stages", "interpret", "variant"))
def int4_matmul_pallas(x: jax.Array, qweight: jax.Array, scales: jax.Array, *, block_m: int, block_n: int,
                       block_k: int, k_splits: int = 1, num_warps: int = 4, num_stages: int = 3,
                       interpret: bool = False, variant: str = "dot") -> jax.Array:
    """x [M, K] · W [K, N] (qweight [K // 8, N] int32, scales [K // group, N]) -> [M, N] in x's
    dtype, through the Pallas kernel ``variant`` (one of ``VARIANTS``). Shapes are trusted:
    ``ops.int4_matmul`` checks them."""
    m, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    steps_total = pl.cdiv(k, block_k)
    k_splits = min(k_splits, steps_total)
    steps = pl.cdiv(steps_total, k_splits)
    grid = (pl.cdiv(m, block_m), pl.cdiv(n, block_n)) + ((k_splits,) if k_splits > 1 else ())
    x_perm = variant in ("dot_perm", "dot_wide", "gemv")
    if x_perm:  # whole steps, so the kernel's x loads need no K mask
        x = permute_x(x, block_k if variant == "gemv" else SUB)
        if x.shape[1] < steps_total * block_k:
            x = jnp.pad(x, ((0, 0), (0, steps_total * block_k - x.shape[1])))
    kx = x.shape[1]
    if variant.startswith("gemv"):
        kernel = functools.partial(
            _gemv_kernel, m=m, k=k, n=n, group=group, block_m=block_m, block_n=block_n, block_k=block_k,
            steps=steps, k_splits=k_splits, x_perm=x_perm)
    else:
        kernel = functools.partial(
            _kernel, m=m, k=k, n=n, group=group, block_m=block_m, block_n=block_n, unroll=block_k // SUB,
            steps=steps, k_splits=k_splits, x_dtype=jnp.dtype(x.dtype), x_perm=x_perm, wide=variant == "dot_wide")
    # Blocks span all of K (the kernel walks it with dynamic slices); only M and N are tiled.
    in_specs = [pl.BlockSpec((block_m, kx), lambda i, j, *_: (i, 0)),
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
        interpret=interpret, name=f"int4_matmul_{variant}")(x, qweight, scales)
    return out.sum(0).astype(x.dtype) if k_splits > 1 else out
