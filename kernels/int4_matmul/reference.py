"""The INT4 weight format and its pure-jnp reference: symmetric, per-group scales, 8 values per
int32 along the input dimension.

A weight W [K, N] (K inputs, N outputs, maxlm's layout) is stored as
  qweight [K // 8, N] int32: word w of column n holds rows 8w .. 8w+7, row 8w+j in bits 4j..4j+3,
                             as the unsigned nibble q + 8 (q in [-8, 7]);
  scales  [K // group, N]:   W[k, n] ~= q[k, n] * scales[k // group, n].
This is compressed-tensors' ``pack-quantized`` order (``pack_to_int32`` packs consecutive inputs,
element i of a 32-bit word at bit 4i, offset by 8), transposed: its ``weight_packed`` is
``qweight.T`` [N, K // 8] and its ``weight_scale`` is ``scales.T``, so export is a transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PACK = 8  # 4-bit values per int32
QMAX = 7  # symmetric: q in [-8, 7], scale = max|w| / 7 (as compressed-tensors and GPTQ sym)


def check_shapes(k: int, group: int) -> str | None:
    """Why a [k, n] weight cannot take this format with ``group``, or None."""
    if group <= 0 or group % PACK:
        return f"group {group} must be a positive multiple of {PACK}"
    if k % group:
        return f"group {group} does not divide the input dimension {k}"
    return None


def pack_int4(q: jax.Array) -> jax.Array:
    """q [K, N] integers in [-8, 7] -> [K // 8, N] int32."""
    k, n = q.shape
    nibbles = (q.astype(jnp.int32) + 8).reshape(k // PACK, PACK, n)
    shifts = (jnp.arange(PACK, dtype=jnp.int32) * 4)[None, :, None]
    # The nibbles occupy disjoint bits, so the sum is the bitwise or; int32 wraps at bit 31.
    return jnp.sum(jnp.left_shift(nibbles, shifts), axis=1, dtype=jnp.int32)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[K // 8, N] int32 -> q [K, N] int8 in [-8, 7]; the inverse of ``pack_int4``."""
    words, n = packed.shape
    shifts = (jnp.arange(PACK, dtype=jnp.int32) * 4)[None, :, None]
    nibbles = jnp.bitwise_and(jnp.right_shift(packed[:, None, :], shifts), 0xF)  # arithmetic shift, masked
    return (nibbles - 8).astype(jnp.int8).reshape(words * PACK, n)


def quantize_int4(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Round-to-nearest: w [K, N] float -> (qweight [K // 8, N] int32, scales [K // group, N] fp32)."""
    k, n = w.shape
    grouped = w.astype(jnp.float32).reshape(k // group, group, n)
    scales = jnp.max(jnp.abs(grouped), axis=1) / QMAX
    scales = jnp.where(scales == 0, 1.0, scales)
    q = jnp.clip(jnp.round(grouped / scales[:, None, :]), -8, QMAX).reshape(k, n)
    return pack_int4(q), scales


def dequantize_int4(qweight: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """(qweight [K // 8, N], scales [K // group, N]) -> W [K, N] in ``dtype``."""
    q = unpack_int4(qweight).astype(jnp.float32)
    k, n = q.shape
    group = k // scales.shape[0]
    w = q.reshape(k // group, group, n) * scales.astype(jnp.float32)[:, None, :]
    return w.reshape(k, n).astype(dtype)


def int4_matmul_reference(x: jax.Array, qweight: jax.Array, scales: jax.Array) -> jax.Array:
    """x [M, K] · dequantize(qweight, scales) [K, N] -> [M, N] in x's dtype, fp32 accumulation:
    the XLA dequantize-then-matmul path the kernel must match."""
    w = dequantize_int4(qweight, scales, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
