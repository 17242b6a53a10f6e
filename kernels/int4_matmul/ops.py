"""``int4_matmul``: the one entry point; picks the Pallas kernel or XLA's dequantize-then-matmul,
checks shapes, and makes the kernel differentiable (backward through XLA, as QLoRA needs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxlm.kernels.int4_matmul import kernel as K
from maxlm.kernels.int4_matmul.reference import PACK, check_shapes, int4_matmul_reference

IMPLS = ("auto", "pallas", "xla")
_BLOCK_KEYS = ("block_m", "block_n", "block_k", "k_splits", "num_warps", "num_stages")


def _problem(x, qweight, scales) -> str | None:
    """Why (x, qweight, scales) is not an INT4 matmul, or None."""
    if qweight.ndim != 2 or qweight.dtype != jnp.int32:
        return f"qweight must be a 2-D int32 array [K // 8, N], got {qweight.dtype}{list(qweight.shape)}"
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if x.ndim < 1 or x.shape[-1] != k:
        return f"x {list(x.shape)} must end in K = {k} (8 x qweight's {qweight.shape[0]} rows)"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return f"x must be floating point, got {x.dtype}"
    if scales.ndim != 2 or scales.shape[1] != n or scales.shape[0] == 0 or k % scales.shape[0]:
        return f"scales {list(scales.shape)} must be [K // group, N] = [a divisor of {k}, {n}]"
    return check_shapes(k, k // scales.shape[0])


def _kernel_suits(dtype, m: int) -> bool:
    """Where "auto" takes the kernel on GPU: 16-bit activations at any M; fp32 only for decode
    (M <= 64), since Triton's fp32 dot is exact IEEE on CUDA cores while XLA's uses TF32 tensor
    cores, which win once the matmul is compute-bound."""
    return dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or (dtype == jnp.float32 and m <= 64)


def _backend() -> str:
    return jax.default_backend()


def int4_matmul(x: jax.Array, qweight: jax.Array, scales: jax.Array, *, impl: str = "auto",
                interpret: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None, k_splits: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, variant: str = "dot") -> jax.Array:
    """x [..., K] · W [K, N] -> [..., N] in x's dtype, fp32 accumulation, where W is stored as
    ``qweight`` [K // 8, N] int32 and ``scales`` [K // group, N] (the format in ``reference``).

    impl: "pallas" (the fused kernel), "xla" (dequantize, then jnp.dot), "auto" (pallas on GPU
    for bf16/fp16 activations, and fp32 at M <= 64; xla elsewhere). interpret: run the kernel in Pallas interpret
    mode; None means on every backend but GPU. Block arguments left None take
    ``kernel.default_blocks`` for the shape and ``variant`` (one of ``kernel.VARIANTS``: "dot", the
    default, or the experimental "dot_perm", "dot_wide", "gemv", "gemv_strided"). Differentiable in x and scales (the backward is the
    XLA path); qweight is integer and gets no gradient.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} must be one of {', '.join(IMPLS)}")
    if problem := _problem(x, qweight, scales):
        raise ValueError(f"int4_matmul: {problem}")
    on_gpu = _backend() == "gpu"
    m = x.size // x.shape[-1]
    if impl == "auto":
        impl = "pallas" if on_gpu and _kernel_suits(jnp.dtype(x.dtype), m) else "xla"
    if impl == "xla":
        return int4_matmul_reference(x.reshape(-1, x.shape[-1]), qweight, scales).reshape(
            *x.shape[:-1], qweight.shape[1])
    if jnp.dtype(x.dtype) not in K.MAGIC:
        raise ValueError(f"int4_matmul: the pallas kernel takes bfloat16, float16 or float32 x, got {x.dtype}")
    if variant not in K.VARIANTS:
        raise ValueError(f"int4_matmul: variant {variant!r} must be one of {', '.join(K.VARIANTS)}")
    blocks = K.default_blocks(m, x.shape[-1], qweight.shape[1], variant)
    given = dict(zip(_BLOCK_KEYS, (block_m, block_n, block_k, k_splits, num_warps, num_stages)))
    blocks.update({key: v for key, v in given.items() if v is not None})
    if problem := K.check_blocks(blocks["block_m"], blocks["block_n"], blocks["block_k"], blocks["k_splits"],
                                  variant):
        raise ValueError(f"int4_matmul: {problem}")
    cfg = tuple(sorted(blocks.items())) + (("variant", variant), ("interpret", (not on_gpu) if interpret is None else bool(interpret)),)
    out = _pallas(x.reshape(m, x.shape[-1]), qweight, scales, cfg)
    return out.reshape(*x.shape[:-1], qweight.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas(x, qweight, scales, cfg):
    if x.shape[0] == 0:  # an empty grid is not a launch
        return jnp.zeros((0, qweight.shape[1]), x.dtype)
    return K.int4_matmul_pallas(x, qweight, scales, **dict(cfg))


def _pallas_fwd(x, qweight, scales, cfg):
    return _pallas(x, qweight, scales, cfg), (x, qweight, scales)


def _pallas_bwd(cfg, res, g):
    """The XLA path's gradients: dx = g · Wᵀ, dscales[G, n] = sum over the group's rows k of
    q[k, n] · (xᵀ g)[k, n]. Under jit an unused dscales (frozen base weights) is dead code."""
    del cfg
    x, qweight, scales = res
    _, vjp = jax.vjp(lambda x_, s_: int4_matmul_reference(x_, qweight, s_), x, scales)
    dx, ds = vjp(g)
    return dx, jnp.zeros(qweight.shape, jax.dtypes.float0), ds


_pallas.defvjp(_pallas_fwd, _pallas_bwd)
