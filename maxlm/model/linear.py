"""The linear seam: every matmul with a weight (q/k/v/o, the MLP, the LM head, tied or not).

``Linear`` owns the logical names and the bias; the matmul itself is one function per
implementation in ``IMPLS``, chosen by ``ModelConfig.linear``. ``dense`` is a plain weight. A LoRA
implementation (frozen kernel plus adapters A and B) or a quantized one (packed INT4/INT8 weights
and scales, dequantised or handed to a kernel) registers itself here under a new name and creates
its own parameters through the module it is given; no layer changes.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.config import LINEAR_IMPLS, ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...],
          init: nn.initializers.Initializer) -> jax.Array:
    """A parameter stored in ``param_dtype`` and tagged with logical axis names."""
    cfg: ModelConfig = module.cfg
    return module.param(name, nn.with_logical_partitioning(init, names), shape, DTYPES[cfg.param_dtype])


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


IMPLS: dict[str, Callable[["Linear", jax.Array, jax.Array | None], jax.Array]] = {"dense": _dense}
assert tuple(IMPLS) == LINEAR_IMPLS, "config.LINEAR_IMPLS lists the implementations registered here"


class Linear(nn.Module):
    """``x[..., in] · W[in, out] (+ b[out])`` with multi-axis in and out shapes.

    ``tied`` (a [in, out] array from elsewhere, e.g. the transposed embedding) replaces the
    module's own weight; tied maps never get a bias."""

    cfg: ModelConfig
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    bias_names: tuple[str, ...] | None = None  # defaults to out_names
    std: float | None = None

    @nn.compact
    def __call__(self, x: jax.Array, tied: jax.Array | None = None) -> jax.Array:
        lead = x.shape[:x.ndim - len(self.in_shape)]
        flat = x.reshape(-1, math.prod(self.in_shape))
        y = IMPLS[self.cfg.linear](self, flat, tied).reshape(*lead, *self.out_shape)
        if self.cfg.use_bias and tied is None:
            bias = param(self, "bias", self.out_shape, self.bias_names or self.out_names,
                         nn.initializers.zeros)
            y = y + bias.astype(y.dtype)
        return y
