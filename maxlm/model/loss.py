"""Token losses over the (padded) vocabulary, in fp32: the one vocab-masked NLL in maxlm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_nll(logits: jax.Array, targets: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Per-token negative log-likelihood and log-partition, both [...] fp32.

    Columns past ``vocab_size`` (vocabulary padding) are excluded from the softmax."""
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] > vocab_size:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -1e9)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array, vocab_size: int,
                  z_loss: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Summed token cross-entropy (+ PaLM z-loss) and the summed weight, in fp32."""
    per_token, log_z = token_nll(logits, targets, vocab_size)
    if z_loss:
        per_token = per_token + z_loss * jnp.square(log_z)
    return jnp.sum(per_token * weights), jnp.sum(weights)
