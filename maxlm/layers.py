"""Transformer building blocks (Flax Linen), every parameter tagged with logical axis names.

Parameter names follow Hugging Face's (``q_proj``, ``gate_proj``, ...) so that import and export in
``maxlm.hf`` are a table, not a translation. Weights are stored in ``param_dtype`` (fp32) and cast
to the compute ``dtype`` at use; norms, softmax and the loss run in fp32.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.attention import attention
from maxlm.config import ModelConfig
from maxlm.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...],
           init: nn.initializers.Initializer) -> jax.Array:
    cfg: ModelConfig = module.cfg
    return module.param(name, nn.with_logical_partitioning(init, names), shape,
                        DTYPES[cfg.param_dtype])


class Proj(nn.Module):
    """A linear map ``x[..., in] · W[in, out] (+ b[out])`` with multi-axis in and out shapes."""

    cfg: ModelConfig
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    bias_names: tuple[str, ...] | None = None  # defaults to out_names
    std: float | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        init = nn.initializers.normal(self.std if self.std is not None else cfg.init_std)
        kernel = _param(self, "kernel", self.in_shape + self.out_shape,
                        self.in_names + self.out_names, init)
        # One 2-D matmul [tokens, in] · [in, out]: flattening the leading (batch, length) and the
        # multi-axis in/out dims is free (row-major bitcasts) and keeps autodiff's weight gradient
        # a plain [in, tokens] · [tokens, out] dot. With the dims left unflattened, XLA:CPU
        # canonicalises that gradient by materialising a transposed copy of the output gradient,
        # which cost more than the matmuls themselves (scripts/README.md).
        n_in = len(self.in_shape)
        lead = x.shape[:x.ndim - n_in]
        y = jnp.dot(x.reshape(-1, math.prod(self.in_shape)).astype(dtype),
                    kernel.reshape(math.prod(self.in_shape), -1).astype(dtype))
        y = y.reshape(*lead, *self.out_shape)
        if cfg.use_bias:
            bias = _param(self, "bias", self.out_shape, self.bias_names or self.out_names,
                          nn.initializers.zeros)
            y = y + bias.astype(dtype)
        return y


class Norm(nn.Module):
    """RMSNorm (Llama) or LayerNorm (GPT), computed in fp32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        x32 = x.astype(jnp.float32)
        scale = _param(self, "scale", (cfg.d_model,), ("act_embed",), nn.initializers.ones)
        if cfg.norm == "rms":
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
            return (y * scale).astype(x.dtype)
        bias = _param(self, "bias", (cfg.d_model,), ("act_embed",), nn.initializers.zeros)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.norm_eps)
        return (y * scale + bias).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """RoPE inverse frequencies, with Llama-3's long-context scaling when configured."""
    dim = cfg.dim_per_head
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling_factor:
        # Llama 3.1: keep high frequencies, divide low ones by the factor, blend in between.
        low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * inv_freq / cfg.rope_scaling_factor + smooth * inv_freq
        inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / cfg.rope_scaling_factor,
                             jnp.where(wavelen < high_wavelen, inv_freq, blended))
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, H] by positions [B, T] in Hugging Face's rotate-half layout."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head

        def proj(name, heads, head_names):
            p = Proj(cfg, (d,), (heads, h), ("embed",), (head_names, "head_dim"), name=name)
            return constrain(checkpoint_name(p(x), name), ("batch", "length", head_names, "head_dim"))

        q, key, value = proj("q_proj", n, "heads"), proj("k_proj", k, "kv_heads"), proj("v_proj", k, "kv_heads")
        if cfg.position == "rope":
            inv_freq = rope_inv_freq(cfg)
            q, key = apply_rope(q, positions, inv_freq), apply_rope(key, positions, inv_freq)
        ctx = attention(q, key, value, segment_ids, impl=cfg.attention_impl)
        ctx = constrain(ctx, ("batch", "length", "heads", "head_dim"))
        # GPT-2 scales the residual projections by 1/sqrt(2L) at init.
        out = Proj(cfg, (n, h), (d,), ("heads", "head_dim"), ("embed",), bias_names=("act_embed",),
                   std=cfg.init_std / math.sqrt(2 * cfg.n_layers), name="o_proj")(ctx)
        return checkpoint_name(out, "o_proj")


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return nn.silu(gate) * up


def _gelu(x: jax.Array) -> jax.Array:
    return nn.gelu(x, approximate=True)


class Mlp(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, f = cfg.d_model, cfg.d_ff

        def up(name):
            y = Proj(cfg, (d,), (f,), ("embed",), ("mlp",), name=name)(x)
            return constrain(y, ("batch", "length", "mlp"))

        # The activation is recomputed in the backward pass from its inputs (jax.checkpoint):
        # autodiff would otherwise keep sigmoid/tanh, the activation and the product of every layer,
        # [batch, length, d_ff] each, and storing them costs more than recomputing them on CPU.
        if cfg.activation == "swiglu":
            hidden = jax.checkpoint(_swiglu)(up("gate_proj"), up("up_proj"))
        else:
            hidden = jax.checkpoint(_gelu)(up("up_proj"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return Proj(cfg, (f,), (d,), ("mlp",), ("embed",), bias_names=("act_embed",),
                    std=cfg.init_std / math.sqrt(2 * cfg.n_layers), name="down_proj")(hidden)


class Block(nn.Module):
    """Pre-norm residual block; the signature fits ``nn.scan`` (carry in, carry out)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array):
        x = x + Attention(self.cfg, name="attn")(Norm(self.cfg, name="attn_norm")(x), segment_ids, positions)
        x = x + Mlp(self.cfg, name="mlp")(Norm(self.cfg, name="mlp_norm")(x))
        return constrain(x, ("batch", "length", "act_embed")), None
