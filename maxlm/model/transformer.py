"""The decoder-only transformer: one forward for training, prefill and decode.

``Transformer(cfg).apply({"params": p}, tokens, segment_ids, positions, cache)`` returns
``(logits, cache)``. Without a cache it is the training forward over whole sequences; with a
``maxlm.model.cache`` cache the tokens are written at their positions and attend over everything
the cache holds (prefill is a long write, decode a write of one token per row). Layers are one
``Block`` with parameters stacked on a leading ``layers`` axis; how that stack is executed is
injected: ``stack=None`` scans it (compile time independent of depth), and the step builder passes
``maxlm.parallel.pipeline_parallel``'s runner when the mesh has a pipeline axis.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.config import ModelConfig
from maxlm.model.attention import Tokens
from maxlm.model.layers import Block, LayerContext, Norm
from maxlm.model.linear import DTYPES, Linear, dequantize, param, quant_params
from maxlm.parallel.sharding import constrain

# What "save_named" keeps for the backward pass: the projections and attention's output, so only
# cheap elementwise work and attention's scores are recomputed.
SAVED_NAMES = ("q_proj", "k_proj", "v_proj", "attention_out", "o_proj", "mlp_hidden")

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer but its input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_named": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
}

# A layer-stack runner: (block class, cfg, stacked params, x, context, stacked cache) -> (x, cache).
LayerStack = Callable[[type, ModelConfig, Any, jax.Array, LayerContext, Any], tuple[jax.Array, Any]]


def block_class(cfg: ModelConfig) -> type[nn.Module]:
    """``Block``, wrapped in ``nn.remat`` with the configured policy."""
    if cfg.remat == "none":
        return Block
    return nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat])


class Transformer(nn.Module):
    cfg: ModelConfig
    stack: LayerStack | None = None  # None: nn.scan over the layers

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, cache: Any = None) -> tuple[jax.Array, Any]:
        """tokens [B, T] int -> (logits [B, T, padded_vocab] in the compute dtype, cache)."""
        cfg = self.cfg
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        x, head = self.embed(tokens)
        if cfg.position == "learned":
            pos_table = param(self, "pos_embed", (cfg.max_seq_len, cfg.d_model), ("length", "embed"),
                              nn.initializers.normal(cfg.init_std / 2))
            x = x + jnp.take(pos_table, positions, axis=0).astype(x.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))

        queries = Tokens(positions=positions, segments=segment_ids)
        if cache is None:
            ctx, layer_cache = LayerContext(queries), None
        else:
            cache, keys, where = cache.write(queries)
            ctx = LayerContext(queries, keys, where, type(cache).attend_layer)
            layer_cache = cache.layers()
        x, layer_cache = self.layers(x, ctx, layer_cache)
        if cache is not None:
            cache = cache.with_layers(layer_cache)
        x = Norm(cfg, name="final_norm")(x)
        # What the LM head reads, kept only when a caller asks for "intermediates" (``forward_hidden``).
        self.sow("intermediates", "final_hidden", x)
        logits = Linear(cfg, (cfg.d_model,), (cfg.padded_vocab,), ("embed",), ("vocab",),
                        name="lm_head")(x, tied=head if cfg.tie_embeddings else None)
        return constrain(logits, ("batch", "length", "vocab")), cache

    def embed(self, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """(token embeddings [B, T, d_model] in the compute dtype, the table as a tied LM head uses it).

        ``ModelConfig.embedding`` dense: ``embed`` [V, D]. int8/int4: ``embed_qweight`` and
        ``embed_scales``, the transposed table [D, V] in the Linear format (quantized along D,
        ``maxlm.model.linear``): a lookup gathers a token's column and dequantizes it, and a tied
        LM head is that quantized Linear as stored."""
        cfg = self.cfg
        if cfg.embedding == "dense":
            table = param(self, "embed", (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"),
                          nn.initializers.normal(cfg.init_std))
            # Gather the whole table for the lookup (as FSDP does for every weight): a gather from a
            # vocab-sharded table would force XLA to replicate its output and re-split it by batch.
            x = jnp.take(constrain(table, (None, None)), tokens, axis=0)
            return x.astype(DTYPES[cfg.dtype]), table.T
        qweight, scales = quant_params(self, cfg.embedding, cfg.d_model, (cfg.padded_vocab,), "embed",
                                       ("vocab",), prefix="embed_")
        flat = tokens.reshape(-1)
        columns = jnp.take(constrain(qweight, (None, None)), flat, axis=1)  # [D or D // 8, B*T]
        col_scales = jnp.take(constrain(scales, (None, None)), flat, axis=1)
        x = dequantize(cfg.embedding, columns, col_scales, DTYPES[cfg.dtype]).T
        return x.reshape(*tokens.shape, cfg.d_model), (qweight, scales)

    def layers(self, x: jax.Array, ctx: LayerContext, layer_cache: Any) -> tuple[jax.Array, Any]:
        """The stacked layers, scanned here or run by the injected ``stack``."""
        cfg, block = self.cfg, block_class(self.cfg)
        if self.stack is not None and not self.is_initializing():
            return self.stack(block, cfg, self.variables["params"]["layers"], x, ctx, layer_cache)
        if layer_cache is None:
            scan = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                           split_rngs={"params": True, "dropout": True},
                           in_axes=nn.broadcast, length=cfg.n_layers,
                           metadata_params={nn.PARTITION_NAME: "layers"})
            return scan(cfg, name="layers")(x, ctx)

        # With a cache the whole stacked cache is part of the carry (the layer index is the
        # scanned input), so each layer scatters its new entries into it in place rather than
        # taking a slice of it in and stacking a new one out (copies of the whole cache).
        def body(layer_block, carry, ctx, layer):
            x, stacked = carry
            x, (stacked, _) = layer_block(x, ctx, (stacked, layer))
            return (x, stacked), None
        scan = nn.scan(body, variable_axes={"params": 0, "intermediates": 0},
                       split_rngs={"params": True, "dropout": True},
                       in_axes=(nn.broadcast, 0), length=cfg.n_layers,
                       metadata_params={nn.PARTITION_NAME: "layers"})
        (x, layer_cache), _ = scan(block(cfg, name="layers"), (x, layer_cache), ctx,
                                   jnp.arange(cfg.n_layers, dtype=jnp.int32))
        return x, layer_cache


def forward(cfg: ModelConfig, params: Any, tokens: jax.Array, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None, cache: Any = None,
            stack: LayerStack | None = None, dropout_rng: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """The model as a pure function of its parameters: ``(logits, cache)``. ``dropout_rng`` (training
    only) turns on the model's dropout, which is LoRA's (``ModelConfig.lora_dropout``) alone."""
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    return Transformer(cfg, stack).apply({"params": params}, tokens, segment_ids, positions, cache, rngs=rngs)


def forward_hidden(cfg: ModelConfig, params: Any, tokens: jax.Array, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None, dropout_rng: jax.Array | None = None,
                   final: bool = False) -> tuple[jax.Array, jax.Array]:
    """The training forward that also returns hidden states: ``(logits, hidden)``.

    By default hidden is every layer's output, [n_layers, B, T, d_model] in the compute dtype,
    ``hidden[i]`` the residual stream after layer i + 1 (Hugging Face's ``hidden_states[i + 1]``; the
    last is before the final norm). With ``final`` it is what the LM head reads, [B, T, d_model]:
    the last layer's output after the final norm (Hugging Face's ``last_hidden_state``; a reward
    model's scalar head reads it). Each ``Block`` sows its output and the scan stacks them; the
    pipeline runner does not collect them, so this runs the layers as a scan (``maxlm.posttrain``)."""
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    (logits, _), state = Transformer(cfg).apply({"params": params}, tokens, segment_ids, positions,
                                                rngs=rngs, mutable=["intermediates"])
    if final:
        (hidden,) = state["intermediates"]["final_hidden"]
    else:
        (hidden,) = state["intermediates"]["layers"]["hidden"]
    return logits, hidden


def abstract_params(cfg: ModelConfig, boxed: bool = False) -> Any:
    """The parameter tree as ShapeDtypeStructs (nothing allocated); ``boxed`` keeps the logical
    axis names (``nn.LogicallyPartitioned``) for shardings."""
    def init():
        tree = Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
        return tree if boxed else nn.unbox(tree)
    return jax.eval_shape(init)


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Randomly initialised parameters (plain arrays; jit it with out_shardings to place them)."""
    return nn.unbox(Transformer(cfg).init(rng, jnp.zeros((1, 1), jnp.int32))["params"])
