"""Transformer building blocks (Flax Linen), every parameter tagged with logical axis names.

Parameter names follow Hugging Face's (``q_proj``, ``gate_proj``, ...) so that import and export in
``maxlm.hf`` are a table, not a translation. Weights are stored in ``param_dtype`` (fp32) and cast
to the compute ``dtype`` at use; norms, softmax and the loss run in fp32. Every weight matmul goes
through ``maxlm.model.linear.Linear``; attention through ``maxlm.model.attention.attention``.
"""

from __future__ import annotations

import math

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.config import ModelConfig
from maxlm.model.attention import Tokens, attention
from maxlm.model.linear import Linear, param
from maxlm.parallel.sharding import constrain


@flax.struct.dataclass
class LayerContext:
    """What every layer sees besides its input: the tokens' coordinates and, with a cache, where
    the new keys and values go (``maxlm.model.cache``). Broadcast to all layers of the stack."""

    queries: Tokens
    keys: Tokens | None = None  # None: the queries attend to themselves (no cache)
    where: Any = None  # the cache's write index for the new tokens
    attend_cache: Callable | None = flax.struct.field(pytree_node=False, default=None)


class Norm(nn.Module):
    """RMSNorm (Llama) or LayerNorm (GPT), computed in fp32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        x32 = x.astype(jnp.float32)
        scale = param(self, "scale", (cfg.d_model,), ("act_embed",), nn.initializers.ones)
        if cfg.norm == "rms":
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
            return (y * scale).astype(x.dtype)
        bias = param(self, "bias", (cfg.d_model,), ("act_embed",), nn.initializers.zeros)
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
    def __call__(self, x: jax.Array, ctx: LayerContext, layer_cache: Any = None) -> tuple[jax.Array, Any]:
        cfg = self.cfg
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
        positions = ctx.queries.positions

        def proj(name, heads, head_names):
            p = Linear(cfg, (d,), (heads, h), ("embed",), (head_names, "head_dim"), name=name)
            return constrain(checkpoint_name(p(x), name), ("batch", "length", head_names, "head_dim"))

        q, key, value = proj("q_proj", n, "heads"), proj("k_proj", k, "kv_heads"), proj("v_proj", k, "kv_heads")
        if cfg.position == "rope":
            inv_freq = rope_inv_freq(cfg)
            q, key = apply_rope(q, positions, inv_freq), apply_rope(key, positions, inv_freq)
        def attend(key, value):
            return attention(q, key, value, ctx.queries, ctx.keys, impl=cfg.attention_impl,
                             sliding_window=cfg.sliding_window)

        if layer_cache is None:
            out = attend(key, value)
        else:  # (the whole stacked cache, this layer's index)
            stacked, layer = layer_cache
            stacked, out = ctx.attend_cache(stacked, layer, q, key, value, ctx.where,
                                            sliding_window=cfg.sliding_window, attend=attend)
            layer_cache = (stacked, layer)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        # GPT-2 scales the residual projections by 1/sqrt(2L) at init.
        out = Linear(cfg, (n, h), (d,), ("heads", "head_dim"), ("embed",), bias_names=("act_embed",),
                   std=cfg.init_std / math.sqrt(2 * cfg.n_layers), name="o_proj")(out)
        return checkpoint_name(out, "o_proj"), layer_cache


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
            y = Linear(cfg, (d,), (f,), ("embed",), ("mlp",), name=name)(x)
            return constrain(y, ("batch", "length", "mlp"))

        # The activation is recomputed in the backward pass from its inputs (jax.checkpoint):
        # autodiff would otherwise keep sigmoid/tanh, the activation and the product of every layer,
        # [batch, length, d_ff] each, and storing them costs more than recomputing them on CPU.
        if cfg.activation == "swiglu":
            hidden = jax.checkpoint(_swiglu)(up("gate_proj"), up("up_proj"))
        else:
            hidden = jax.checkpoint(_gelu)(up("up_proj"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return Linear(cfg, (f,), (d,), ("mlp",), ("embed",), bias_names=("act_embed",),
                    std=cfg.init_std / math.sqrt(2 * cfg.n_layers), name="down_proj")(hidden)


class Block(nn.Module):
    """Pre-norm residual block. Fits ``nn.scan``: x is the carry, the context is broadcast.
    ``layer_cache`` is None without a cache, else (the whole stacked cache, this layer's index):
    the transformer carries the stack through the scan and returns it updated."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, ctx: LayerContext, layer_cache: Any = None) -> tuple[jax.Array, Any]:
        attn, layer_cache = Attention(self.cfg, name="attn")(Norm(self.cfg, name="attn_norm")(x), ctx,
                                                             layer_cache)
        x = x + attn
        x = x + Mlp(self.cfg, name="mlp")(Norm(self.cfg, name="mlp_norm")(x))
        x = constrain(x, ("batch", "length", "act_embed"))
        # The layer's output, kept only when a caller asks for "intermediates" (``forward_hidden``).
        self.sow("intermediates", "hidden", x)
        return x, layer_cache
