"""Sampling text from a trained model (a first cut: each new token reruns the fixed-size buffer).

The whole loop is one jitted ``fori_loop`` over a fixed-length token buffer, so it compiles once.
Causal attention makes the unfilled tail of the buffer invisible to the positions being read. A KV
cache arrives with the serving issue; this is for short samples after training and in notebooks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.config import ModelConfig
from maxlm.model import Transformer


def sample(cfg: ModelConfig, params: Any, prompt: np.ndarray, new_tokens: int, *,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> np.ndarray:
    """Continue ``prompt`` (1-D token ids) by ``new_tokens`` tokens; returns only the new ones.

    ``temperature`` 0 is greedy. The prompt keeps its last ``max_seq_len - new_tokens`` tokens."""
    if not 0 < new_tokens < cfg.max_seq_len:
        raise ValueError(f"new_tokens = {new_tokens} must lie in [1, max_seq_len = {cfg.max_seq_len})")
    prompt = np.asarray(prompt, np.int32)[-(cfg.max_seq_len - new_tokens):]
    start, length = len(prompt), len(prompt) + new_tokens
    buffer = np.zeros((1, length), np.int32)
    buffer[0, :start] = prompt
    model = Transformer(cfg)

    @jax.jit
    def run(params, tokens, rng):
        def step(pos, carry):
            tokens, rng = carry
            logits = model.apply({"params": params}, tokens)[0, pos - 1, :cfg.vocab_size]
            logits = logits.astype(jnp.float32)
            rng, key = jax.random.split(rng)
            if temperature > 0:
                logits = logits / temperature
                if top_k:
                    kth = jax.lax.top_k(logits, min(top_k, cfg.vocab_size))[0][-1]
                    logits = jnp.where(logits < kth, -jnp.inf, logits)
                token = jax.random.categorical(key, logits)
            else:
                token = jnp.argmax(logits)
            return tokens.at[0, pos].set(token.astype(jnp.int32)), rng
        return jax.lax.fori_loop(start, length, step, (tokens, rng))[0]

    return np.asarray(run(params, jnp.asarray(buffer), jax.random.PRNGKey(seed)))[0, start:]
