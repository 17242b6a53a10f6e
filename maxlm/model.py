"""The decoder-only transformer: a pure function ``apply(params, batch) -> logits``.

Layers are one ``Block`` scanned ``n_layers`` times (parameters stacked on a leading ``layers``
axis), so compile time does not grow with depth; ``remat`` picks what the backward pass recomputes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm import pipeline
from maxlm.config import ModelConfig
from maxlm.layers import DTYPES, Block, Norm, Proj, _param
from maxlm.sharding import constrain

# What "save_named" keeps for the backward pass: the projections, so only cheap elementwise work
# and attention scores are recomputed.
SAVED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_hidden")

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer but its input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_named": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
}


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """inputs [B, T] int -> logits [B, T, padded_vocab] in the compute dtype."""
        cfg = self.cfg
        if segment_ids is None:
            segment_ids = jnp.ones_like(inputs)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[-1]), inputs.shape)
        table = _param(self, "embed", (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"),
                       nn.initializers.normal(cfg.init_std))
        # Gather the whole table for the lookup (as FSDP does for every weight): a gather from a
        # vocab-sharded table would force XLA to replicate its output and re-split it by batch.
        x = jnp.take(constrain(table, (None, None)), inputs, axis=0).astype(DTYPES[cfg.dtype])
        if cfg.position == "learned":
            pos_table = _param(self, "pos_embed", (cfg.max_seq_len, cfg.d_model), ("length", "embed"),
                               nn.initializers.normal(cfg.init_std / 2))
            x = x + jnp.take(pos_table, positions, axis=0).astype(x.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))

        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat])
        if pipeline.degree() > 1 and not self.is_initializing():
            # The same stacked params, executed as a pipeline over the mesh's `pipeline` axis.
            x = pipeline.run(block, cfg, self.variables["params"]["layers"], x, segment_ids, positions)
        else:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast), length=cfg.n_layers,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(cfg, name="layers")(x, segment_ids, positions)
        x = Norm(cfg, name="final_norm")(x)

        if cfg.tie_embeddings:
            # A 2-D matmul, as in Proj, so the table's gradient needs no transposed copy of the
            # logits' gradient.
            logits = jnp.dot(x.reshape(-1, cfg.d_model), table.astype(x.dtype).T)
            logits = logits.reshape(*x.shape[:-1], cfg.padded_vocab)
        else:
            logits = Proj(cfg, (cfg.d_model,), (cfg.padded_vocab,),
                          ("embed",), ("vocab",), name="lm_head")(x)
        return constrain(logits, ("batch", "length", "vocab"))


def param_count(cfg: ModelConfig) -> int:
    """Closed-form parameter count (padded vocabulary included); equals the real tree's size."""
    d, f, n, k, h, v = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, cfg.padded_vocab
    norm = d * (2 if cfg.norm == "layer" else 1)
    attn = d * n * h + 2 * d * k * h + n * h * d
    mlp = (3 if cfg.activation == "swiglu" else 2) * d * f
    if cfg.use_bias:
        attn += n * h + 2 * k * h + d
        mlp += (2 if cfg.activation == "swiglu" else 1) * f + d
    layer = attn + mlp + 2 * norm
    total = v * d + cfg.n_layers * layer + norm
    if cfg.position == "learned":
        total += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        total += d * v + (v if cfg.use_bias else 0)
    return total


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array, vocab_size: int,
                  z_loss: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Summed token cross-entropy (+ PaLM z-loss) and the summed weight, in fp32.

    Columns past ``vocab_size`` (vocabulary padding) are excluded from the softmax.
    """
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] > vocab_size:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -1e9)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    per_token = log_z - target_logit
    if z_loss:
        per_token = per_token + z_loss * jnp.square(log_z)
    return jnp.sum(per_token * weights), jnp.sum(weights)
