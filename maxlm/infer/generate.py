"""Sampling from a trained model over the KV cache: one prefill, then one token per step.

``generate`` takes a batch of prompts of different lengths. The prompts are right-padded into one
[B, P] prefill (padding has segment id 0, so the cache never stores it); then every decode step
writes one token per row at that row's own next position. Prefill and the whole decode loop (a
``fori_loop``) are each compiled once for a given batch, prompt length and token count.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.config import ModelConfig
from maxlm.model import KVCache, forward


def _pick(logits: jax.Array, key: jax.Array, vocab_size: int, temperature: float, top_k: int) -> jax.Array:
    """Next token per row from [B, V] logits: greedy at temperature 0, else top-k sampling."""
    logits = logits[:, :vocab_size].astype(jnp.float32)
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, vocab_size))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(cfg: ModelConfig, params: Any, prompts: Sequence[np.ndarray], new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> np.ndarray:
    """Continue each prompt (1-D token ids, lengths may differ) by ``new_tokens`` tokens.

    Returns [B, new_tokens]. Each prompt keeps its last ``max_seq_len - new_tokens`` tokens."""
    if not 0 < new_tokens < cfg.max_seq_len:
        raise ValueError(f"new_tokens = {new_tokens} must lie in [1, max_seq_len = {cfg.max_seq_len})")
    keep = cfg.max_seq_len - new_tokens
    prompts = [np.asarray(p, np.int32)[-keep:] for p in prompts]
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = p
    segments = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    out = _run(cfg, params, jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions),
               jnp.asarray(lengths), jax.random.PRNGKey(seed), new_tokens=new_tokens,
               temperature=temperature, top_k=top_k, cache_len=width + new_tokens)
    return np.asarray(out)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("new_tokens", "temperature", "top_k", "cache_len"))
def _run(cfg, params, tokens, segments, positions, lengths, rng, *, new_tokens, temperature, top_k, cache_len):
    batch = tokens.shape[0]
    cache = KVCache.create(cfg, batch, cache_len)
    logits, cache = forward(cfg, params, tokens, segments, positions, cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    rng, key = jax.random.split(rng)
    first = _pick(last, key, cfg.vocab_size, temperature, top_k)
    out = jnp.zeros((batch, new_tokens), jnp.int32).at[:, 0].set(first)

    def step(i, carry):
        out, cache, rng = carry
        token = jax.lax.dynamic_index_in_dim(out, i - 1, axis=1)  # [B, 1]
        pos = (lengths + i - 1)[:, None]
        logits, cache = forward(cfg, params, token, jnp.ones_like(token), pos, cache)
        rng, key = jax.random.split(rng)
        nxt = _pick(logits[:, 0], key, cfg.vocab_size, temperature, top_k)
        return jax.lax.dynamic_update_index_in_dim(out, nxt[:, None], i, axis=1), cache, rng

    return jax.lax.fori_loop(1, new_tokens, step, (out, cache, rng))[0]


def sample(cfg: ModelConfig, params: Any, prompt: np.ndarray, new_tokens: int, *,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> np.ndarray:
    """Continue one prompt (1-D token ids) by ``new_tokens`` tokens; returns only the new ones."""
    return generate(cfg, params, [prompt], new_tokens, temperature=temperature, top_k=top_k, seed=seed)[0]
