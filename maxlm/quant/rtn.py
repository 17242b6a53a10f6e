"""Round-to-nearest quantization and the packed format every method writes.

A method turns a dense weight W [K, N] (inputs, outputs: maxlm's layout, the kernel flattened) into
integer values q [K, N] and per-group scales [K // group, N] with W ~= q * scales[k // group];
``pack`` lays them out as the Linear params of ``maxlm.model.linear`` (INT4: 8 values per int32
along K, ``maxlm.kernels.int4_matmul``'s packing; INT8: one int8 each). Symmetric, as
compressed-tensors' and GPTQ's ``sym``: scale = max|w| / qmax over the group, q in [qmin, qmax].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlm.kernels.int4_matmul import pack_int4, unpack_int4

QRANGE = {"int4": (-8, 7), "int8": (-128, 127)}  # (qmin, qmax)


def group_scales(w: jax.Array, impl: str, group: int, shrink: jax.Array | float = 1.0) -> jax.Array:
    """Per-group scales [K // group, N] of w [K, N]: max|w| / qmax (times ``shrink``, AWQ's clip
    ratio, broadcast against the scales); an all-zero group gets scale 1."""
    k, n = w.shape
    amax = jnp.max(jnp.abs(w.astype(jnp.float32).reshape(k // group, group, n)), axis=1)
    scales = amax * shrink / QRANGE[impl][1]
    return jnp.where(scales == 0, 1.0, scales)


def row_scales(scales: jax.Array, k: int) -> jax.Array:
    """[K // group, N] -> the scale of every row, [K, N]."""
    return jnp.repeat(scales, k // scales.shape[0], axis=0)


def quantize_values(w: jax.Array, scales_of_rows: jax.Array, impl: str) -> jax.Array:
    """Integer values (int8 array) of w given each element's scale: clip(round(w / s))."""
    qmin, qmax = QRANGE[impl]
    return jnp.clip(jnp.round(w.astype(jnp.float32) / scales_of_rows), qmin, qmax).astype(jnp.int8)


def rtn(w: jax.Array, impl: str, group: int) -> tuple[jax.Array, jax.Array]:
    """Round-to-nearest: w [K, N] -> (q [K, N] int8, scales [K // group, N] fp32)."""
    scales = group_scales(w, impl, group)
    return quantize_values(w, row_scales(scales, w.shape[0]), impl), scales


def fake_quant(w: jax.Array, impl: str, group: int, shrink: jax.Array | float = 1.0) -> jax.Array:
    """What RTN (with optional shrunk scales) makes of w [K, N], dequantized to fp32."""
    scales = group_scales(w, impl, group, shrink)
    rows = row_scales(scales, w.shape[0])
    return quantize_values(w, rows, impl).astype(jnp.float32) * rows


def pack(impl: str, q: jax.Array, scales: jax.Array, out_shape: tuple[int, ...]) -> dict[str, jax.Array]:
    """{"qweight", "scales"} params of a Linear with outputs ``out_shape`` from q [K, N], scales."""
    qweight = pack_int4(q) if impl == "int4" else q.astype(jnp.int8)
    return {"qweight": qweight.reshape(qweight.shape[0], *out_shape),
            "scales": scales.astype(jnp.float32).reshape(scales.shape[0], *out_shape)}


def unpack(impl: str, qweight: jax.Array) -> jax.Array:
    """The integer values [K, N] of a packed 2-D qweight."""
    return unpack_int4(qweight) if impl == "int4" else qweight.astype(jnp.int8)
