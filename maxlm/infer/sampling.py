"""Choosing the next token from logits: repetition penalty, temperature, top-k, top-p, in the order
Hugging Face's ``generate`` applies them (the penalty is a logits processor, the rest are warpers).

What is traced depends only on ``SamplingParams.mode()`` (greedy or not, top-k's k, whether top-p
and the penalty are on), so greedy decoding carries no sort, no random draw and no seen-token mask;
the values (temperature, top-p, penalty) are run-time inputs (``knobs``), so changing them does not
recompile.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Mode(NamedTuple):
    """The static part of the sampling settings: what the compiled code contains."""

    greedy: bool
    top_k: int
    top_p: bool
    penalised: bool


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 are off; repetition_penalty 1 is off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def problem(self) -> str | None:
        """The first out-of-range setting as one line, else None."""
        if not self.temperature >= 0:  # also catches NaN
            return f"temperature = {self.temperature} must be >= 0 (0 is greedy)"
        if self.top_k < 0:
            return f"top_k = {self.top_k} must be >= 0 (0 keeps every token)"
        if not 0 < self.top_p <= 1:
            return f"top_p = {self.top_p} must lie in (0, 1] (1 keeps every token)"
        if not self.repetition_penalty > 0:
            return f"repetition_penalty = {self.repetition_penalty} must be > 0 (1 is off)"
        return None

    def mode(self) -> Mode:
        greedy = self.temperature == 0
        return Mode(greedy, 0 if greedy else self.top_k, not greedy and self.top_p < 1.0,
                    self.repetition_penalty != 1.0)

    def knobs(self) -> np.ndarray:
        """The run-time values: [temperature, top_p, repetition_penalty], float32."""
        return np.array([self.temperature or 1.0, self.top_p, self.repetition_penalty], np.float32)


def mask_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V_padded] float32 logits with the padding rows of the vocabulary at -inf. Masking keeps
    the padded width, which the tensor axis divides (slicing to vocab_size would gather it)."""
    logits = logits.astype(jnp.float32)
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


def penalise(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """Hugging Face's RepetitionPenaltyLogitsProcessor: a token already in the prompt or the output
    has its logit divided by ``penalty`` when positive, multiplied when negative."""
    hit = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, hit, logits)


def _top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Hugging Face's TopPLogitsWarper, by rank: sort ascending (stable, so of tied tokens the
    lower ids come first), remove every token whose cumulative probability (itself included) is
    at most ``1 - top_p``, keep the most likely one always, and scatter the mask back. Tokens tied
    at the cutoff are split by rank, not all kept."""
    order = jnp.argsort(logits, axis=-1, stable=True)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1)
    drop = (cumulative <= 1 - top_p).at[:, -1].set(False)  # min_tokens_to_keep = 1
    rows = jnp.arange(logits.shape[0])[:, None]
    drop = jnp.zeros_like(drop).at[rows, order].set(drop)
    return jnp.where(drop, -jnp.inf, logits)


def pick(logits: jax.Array, key: jax.Array, mode: Mode, knobs: jax.Array, seen: jax.Array | None = None) -> jax.Array:
    """The next token of each row, [B] int32, from [B, V] float32 logits (padding already masked);
    ``knobs`` as ``SamplingParams.knobs``."""
    temperature, top_p, penalty = knobs[0], knobs[1], knobs[2]
    if mode.penalised:
        logits = penalise(logits, seen, penalty)
    if mode.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if mode.top_k:
        kth = jax.lax.top_k(logits, min(mode.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if mode.top_p:
        logits = _top_p(logits, top_p)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def pick_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
              seeds: jax.Array, counts: jax.Array) -> jax.Array:
    """The next token of each row when every row has its own settings (the serving engine's
    batches mix requests): [B] temperature (0 is greedy), top_k (0 is off), top_p (1 is off), and
    a seed; row b draws with ``fold_in(PRNGKey(seed), count)`` (count: tokens it generated so far),
    so its tokens do not depend on which rows share its batch. The warpers run only when some row
    samples (``lax.cond``), so an all-greedy batch costs one argmax."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(logits):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        ranked = -jnp.sort(-scaled, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, logits.shape[-1]), logits.shape[-1])
        kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        scaled = jnp.where((top_p < 1.0)[:, None], _top_p(scaled, top_p[:, None]), scaled)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counts)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, logits)
