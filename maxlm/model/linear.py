"""The linear seam: every matmul with a weight (q/k/v/o, the MLP, the LM head, tied or not).

``Linear`` owns the logical names and the bias; the matmul itself is one function per
implementation in ``IMPLS``, chosen per Linear by ``ModelConfig.linear_impl(path)`` (the first of
``ModelConfig.linear_rules`` whose regex matches the Linear's path, else ``ModelConfig.linear``).
The path is the module path with the layer stack's ``layers/`` dropped (``attn/q_proj``,
``mlp/down_proj``, ``lm_head``), the same under nn.scan and under the pipeline runner.

LoRA adapters (``ModelConfig.lora_*``, ``lora``) are added to the output of whichever
implementation a targeted Linear has, so one adapter code path serves a dense base (LoRA) and an
int4 one (QLoRA): ``lora_a`` [*in, r] named like the kernel's input axes (sharded as the base
weight is), ``lora_b`` [r, *out] named like its output axes, the rank axis (``lora_rank``) replicated.

``dense`` is a plain weight ``kernel`` [*in, *out]. The weight-only quantized ones hold the dense
kernel flattened to [K = prod(in), N = prod(out)] and quantized symmetrically along K in groups
(``ModelConfig.quant_group_of``), each param keeping the out dims:

    int4: qweight int32 [K // 8, *out] (``maxlm.kernels.int4_matmul``'s packing), scales fp32 [K // group, *out]
    int8: qweight int8  [K, *out],                                               scales fp32 [K // group, *out]

so W[k, n] ~= q[k, n] * scales[k // group, n]. The packed K axis is split as the Linear's first
input axis (``config.quant_mesh_problem`` checks it divides); the scales' K axis is replicated.
INT4 goes to the int4 matmul kernel (Pallas on GPU, dequantize-then-matmul elsewhere and under a
multi-device mesh); INT8 is dequantized to the compute dtype and multiplied with fp32 accumulation.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm.config import LINEAR_IMPLS, ModelConfig
from maxlm.kernels import int4_matmul as int4

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str | None, ...],
          init: nn.initializers.Initializer, dtype: jnp.dtype | None = None) -> jax.Array:
    """A parameter stored in ``param_dtype`` (or ``dtype``) and tagged with logical axis names."""
    cfg: ModelConfig = module.cfg
    return module.param(name, nn.with_logical_partitioning(init, names), shape,
                        dtype or DTYPES[cfg.param_dtype])


def _dense(module: "Linear", x: jax.Array, tied: jax.Array | None) -> jax.Array:
    """x[tokens, in] · W[in, out] as one 2-D matmul in the compute dtype.

    Flattening (batch, length) and the multi-axis in/out dims is free (row-major bitcasts) and
    keeps autodiff's weight gradient a plain [in, tokens] · [tokens, out] dot. Left unflattened,
    XLA:CPU canonicalises that gradient by materialising a transposed copy of the output
    gradient, which cost more than the matmuls themselves (scripts/README.md)."""
    cfg, dtype = module.cfg, DTYPES[module.cfg.dtype]
    kernel = tied
    if kernel is None:
        init = nn.initializers.normal(module.std if module.std is not None else cfg.init_std)
        kernel = param(module, "kernel", module.in_shape + module.out_shape,
                       module.in_names + module.out_names, init)
    n_in = math.prod(module.in_shape)
    return jnp.dot(x.astype(dtype), kernel.reshape(n_in, -1).astype(dtype))


# ---- weight-only quantized: the format (see the module docstring) and its matmuls

QDTYPES = {"int4": jnp.int32, "int8": jnp.int8}
# A fresh quantized weight is zero (every int4 nibble 8 encodes q = 0) until real weights load.
_ZERO_WORD = {"int4": int(np.uint32(0x88888888).view(np.int32)), "int8": 0}


def packed_rows(impl: str, n_in: int) -> int:
    """Rows of ``qweight`` for ``n_in`` inputs."""
    return n_in // int4.reference.PACK if impl == "int4" else n_in


def quant_shapes(cfg: ModelConfig, impl: str, n_in: int, out_shape: tuple[int, ...]) -> dict[str, tuple]:
    """{"qweight": shape, "scales": shape} of a quantized weight with ``n_in`` inputs."""
    return {"qweight": (packed_rows(impl, n_in),) + tuple(out_shape),
            "scales": (n_in // cfg.quant_group_of(impl, n_in),) + tuple(out_shape)}


def quant_params(module: nn.Module, impl: str, n_in: int, out_shape: tuple[int, ...], in_name: str | None,
                 out_names: tuple[str | None, ...], prefix: str = "") -> tuple[jax.Array, jax.Array]:
    """The (qweight, scales) params of a quantized weight, created through ``module``."""
    shapes = quant_shapes(module.cfg, impl, n_in, out_shape)
    qweight = param(module, prefix + "qweight", shapes["qweight"], (in_name,) + tuple(out_names),
                    nn.initializers.constant(_ZERO_WORD[impl], QDTYPES[impl]), QDTYPES[impl])
    scales = param(module, prefix + "scales", shapes["scales"], (None,) + tuple(out_names),
                   nn.initializers.ones, jnp.float32)
    return qweight, scales


def dequantize(impl: str, qweight: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """(qweight [rows, N], scales [K // group, N]) -> W [K, N] in ``dtype``."""
    if impl == "int4":
        return int4.dequantize_int4(qweight, scales, dtype)
    k, n = qweight.shape
    group = k // scales.shape[0]
    w = qweight.astype(jnp.float32).reshape(k // group, group, n) * scales.astype(jnp.float32)[:, None, :]
    return w.reshape(k, n).astype(dtype)


def _int4_impl() -> str:
    """The int4 kernel's impl here: its own choice (Pallas on GPU) without a mesh or on one device.
    Under a multi-device mesh XLA's dequantize-then-matmul, which the SPMD partitioner splits like
    the dense matmul; a pallas_call has no partitioning rule, so XLA would gather its weight whole."""
    mesh = jax.sharding.get_abstract_mesh()
    return "auto" if mesh.empty or mesh.size == 1 else "xla"


def quantized_matmul(impl: str, x: jax.Array, qweight: jax.Array, scales: jax.Array) -> jax.Array:
    """x [M, K] (compute dtype) · the quantized [K, N] weight -> [M, N] in x's dtype, fp32 accumulation."""
    if impl == "int4":
        return int4.int4_matmul(x, qweight, scales, impl=_int4_impl())
    w = dequantize(impl, qweight, scales, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _quantized(impl: str) -> Callable:
    def run(module: "Linear", x: jax.Array, tied) -> jax.Array:
        n_in = math.prod(module.in_shape)
        if tied is None:
            qweight, scales = quant_params(module, impl, n_in, module.out_shape, module.in_names[0],
                                           module.out_names)
        else:  # a quantized embedding table, already in this layout
            qweight, scales = tied
        n_out = math.prod(module.out_shape)
        return quantized_matmul(impl, x.astype(DTYPES[module.cfg.dtype]), qweight.reshape(-1, n_out),
                                scales.reshape(-1, n_out))
    return run


IMPLS: dict[str, Callable[["Linear", jax.Array, jax.Array | None], jax.Array]] = {
    "dense": _dense, "int8": _quantized("int8"), "int4": _quantized("int4")}
assert tuple(IMPLS) == LINEAR_IMPLS, "config.LINEAR_IMPLS lists the implementations registered here"


def lora(module: "Linear", x: jax.Array) -> jax.Array:
    """(alpha / r) · dropout(x) A B for x [tokens, in]: the adapters' contribution, in the compute dtype.

    A starts uniform in ±1/sqrt(in) (PEFT's Kaiming-uniform default) and B at zero, so a fresh
    adapter leaves the base model's output unchanged. Dropout needs a "dropout" rng, which only
    training passes (``maxlm.model.forward(..., dropout_rng=)``)."""
    cfg, dtype = module.cfg, DTYPES[module.cfg.dtype]
    r, n_in = cfg.lora_rank, math.prod(module.in_shape)
    bound = 1.0 / math.sqrt(n_in)
    a = param(module, "lora_a", module.in_shape + (r,), module.in_names + ("lora_rank",),
              lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound))
    b = param(module, "lora_b", (r,) + module.out_shape, ("lora_rank",) + module.out_names, nn.initializers.zeros)
    if cfg.lora_dropout and module.has_rng("dropout"):
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - cfg.lora_dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - cfg.lora_dropout), 0).astype(x.dtype)
    low = jnp.dot(x.astype(dtype), a.reshape(n_in, r).astype(dtype))
    return jnp.dot(low * (cfg.lora_alpha / r), b.reshape(r, -1).astype(dtype))


def linear_path(module: nn.Module) -> str:
    """The path ``ModelConfig.linear_rules`` match: the module path without the layer stack's prefix."""
    parts = tuple(module.scope.path)
    return "/".join(parts[1:] if parts[:1] == ("layers",) else parts)


class Linear(nn.Module):
    """``x[..., in] · W[in, out] (+ b[out])`` with multi-axis in and out shapes.

    ``tied`` (a [in, out] array from elsewhere, e.g. the transposed embedding, or the (qweight,
    scales) of a quantized embedding) replaces the module's own weight and then the embedding's
    storage (``ModelConfig.embedding``) is the implementation; tied maps never get a bias."""

    cfg: ModelConfig
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    bias_names: tuple[str, ...] | None = None  # defaults to out_names
    std: float | None = None

    @nn.compact
    def __call__(self, x: jax.Array, tied: jax.Array | tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        lead = x.shape[:x.ndim - len(self.in_shape)]
        flat = x.reshape(-1, math.prod(self.in_shape))
        path = linear_path(self)
        impl = self.cfg.linear_impl(path) if tied is None else self.cfg.embedding
        y = IMPLS[impl](self, flat, tied)
        if tied is None and self.cfg.lora_rank and path in self.cfg.lora_paths():
            y = y + lora(self, flat).astype(y.dtype)
        y = y.reshape(*lead, *self.out_shape)
        if self.cfg.use_bias and tied is None:
            bias = param(self, "bias", self.out_shape, self.bias_names or self.out_names,
                         nn.initializers.zeros)
            y = y + bias.astype(y.dtype)
        return y
