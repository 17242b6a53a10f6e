"""Per-device memory of one training step, from the config alone: the planner's memory model.

Parameters, gradients and optimizer state are derived, not modelled: the real TrainState is built
abstractly (``jax.eval_shape``) and sharded by ``maxlm.step.state_shardings`` over an
``AbstractMesh`` of the config's degrees, so the bytes per device follow ``maxlm.sharding.RULES``
and the real optimizer (AdamW keeps two moments, Lion one, Adafactor factored ones, which the
rules leave replicated). Gradients are fp32 like the parameters, twice over with microbatches
(the accumulator and the current microbatch's).

Activations are modelled per token: what autodiff keeps per layer under ``ModelConfig.remat``
(``SAVED``), plus the larger of two transient peaks: the loss (logits in the compute dtype, and
two fp32 arrays of their size: the upcast logits and their gradient) or one layer's backward
(its recomputed forward, and XLA attention's [heads, T, T] softmax and score gradient in fp32;
cuDNN's flash attention keeps only per-head statistics). Microbatches divide the tokens; a
pipeline (planned, not built yet) keeps (microbatches + stages - 1) microbatches of its 1/stages
of the layers in flight, as GPipe written as one scan does. ``workspace`` is held throughout: the
embedding table gathered whole for the lookup (``maxlm.model`` gathers it) and its full-size fp32
gradient, the output projection gathered over fsdp, and one layer's fsdp-gathered weights and
unreduced gradient.

The per-token constants were fitted to XLA's buffer assignment of the real compiled step
(``maxlm.plan --aot``, fake CPU devices): XLA's temporaries are 0.93-1.06x the estimate across
remat policies, microbatches, optimizers, tensor and fsdp degrees for llama3_1b, llama3_8b,
gpt2_124m and gpt175b (toy models, where fixed overheads dominate, read higher). They follow
``maxlm.attention``'s XLA path: when that changes, rerun --aot and refit ``layer_tensors``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from maxlm import optim, sharding, step
from maxlm.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def abstract_mesh(degrees: dict[str, int]) -> AbstractMesh:
    """A device-free mesh of the given degrees: enough for NamedSharding.shard_shape."""
    return AbstractMesh(tuple(degrees[a] for a in sharding.MESH_AXES), sharding.MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(sharding.MESH_AXES))


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def _is_layer(path: tuple[Any, ...]) -> bool:
    return any(getattr(p, "key", None) == "layers" for p in path)


def state_bytes(cfg: Config, degrees: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state, from the real shardings.

    Also the per-layer share of each (``layer_*``: the part that scales with n_layers) and one
    layer's weights as the forward sees them (gathered over fsdp, still split over tensor)."""
    # Only the shapes matter: normalise what cannot change them, so planning variants is cheap.
    model = dataclasses.replace(cfg.model, remat="none", attention_impl="xla")
    key = dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, steps=1))
    return dict(_state_bytes(key, tuple(sorted(degrees.items()))))


@functools.lru_cache(maxsize=64)
def _state_bytes(cfg: Config, degree_items: tuple[tuple[str, int], ...]) -> tuple:
    degrees = dict(degree_items)
    mesh = abstract_mesh(degrees)
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    params = jax.eval_shape(lambda: nn.unbox(step._init_params(cfg, jax.random.PRNGKey(0))))
    opt_state = jax.eval_shape(optimizer.init, params)

    def per_device(tree, shardings_tree):
        total = layers = 0
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, leaf), sh in zip(leaves, jax.tree.leaves(shardings_tree)):
            b = _nbytes(sh.shard_shape(leaf.shape), leaf.dtype)
            total += b
            layers += b if _is_layer(path) else 0
        return total, layers

    p_total, p_layers = per_device(params, shardings.params)
    o_total, o_layers = per_device(opt_state, shardings.opt_state)
    # One layer as the matmuls see it: gathered over fsdp (ZeRO-3), still split over tensor.
    gathered = dict(degrees, fsdp=1, pipeline=1)
    gmesh = abstract_mesh(gathered)
    one_layer = 0
    for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                jax.tree.leaves(shardings.params)):
        if _is_layer(path):
            shape = NamedSharding(gmesh, sh.spec).shard_shape(leaf.shape)
            one_layer += _nbytes(shape[1:], leaf.dtype)
    return (("params", p_total), ("grads", p_total), ("optimizer", o_total),
            ("layer_params", p_layers), ("layer_optimizer", o_layers), ("one_layer_gathered", one_layer))


def layer_tensors(cfg: Config, tensor: int) -> dict[str, float]:
    """Bytes per token of each tensor one layer's forward produces, as sharded over ``tensor``.

    D-sized tensors (the residual stream) are replicated over ``tensor``; heads and mlp are split."""
    m = cfg.model
    c = DTYPE_BYTES[m.dtype]
    d, h, t = m.d_model, m.dim_per_head, cfg.train.seq_len
    heads, kv, ff = m.n_heads / tensor, m.kv_heads / tensor, m.d_ff / tensor
    flash = m.attention_impl == "cudnn"
    return {
        "x_in": c * d,  # the layer input (the scan carry); every policy keeps it
        "norm1": c * d,
        "qkv": c * (heads + 2 * kv) * h,
        "rope": c * (heads + kv) * h if m.position == "rope" else 0.0,
        # xla attention materialises fp32 scores and compute-dtype probabilities [N, T, S] and a
        # boolean mask; cuDNN's flash kernel keeps only the log-sum-exp per head.
        "scores": 4 * heads if flash else (4 + c + 1) * heads * t,
        # ...and its backward holds two fp32 [N, T, S] arrays at once (the softmax and the
        # scores' gradient) besides the probabilities in the compute dtype.
        "scores_backward": 8 * heads if flash else (8 + c) * heads * t,
        "ctx": c * heads * h,
        "o_out": c * d,
        "x_mid": c * d,
        "norm2": c * d,
        "mlp_in": c * ff * (2 if m.activation == "swiglu" else 1),
        "mlp_hidden": c * ff,
    }


# What autodiff keeps per layer for the backward pass, by ModelConfig.remat (maxlm.model).
SAVED = {
    "none": ("x_in", "norm1", "qkv", "rope", "scores", "ctx", "x_mid", "norm2", "mlp_in", "mlp_hidden"),
    "save_dots": ("x_in", "qkv", "o_out", "mlp_in"),  # no-batch-dim matmul outputs that are needed
    "save_named": ("x_in", "qkv", "o_out", "mlp_hidden"),  # maxlm.model.SAVED_NAMES
    "full": ("x_in",),
}


def memory(cfg: Config, degrees: dict[str, int]) -> dict[str, Any]:
    """Per-device peak bytes: params, grads, optimizer, activations, workspace, total, and detail
    (see the module docstring for what each part holds)."""
    m, tc = cfg.model, cfg.train
    state = state_bytes(cfg, degrees)
    micro, pipe = cfg.optim.microbatches, degrees["pipeline"]
    c, p = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.param_dtype]
    tokens = tc.global_batch // (degrees["data"] * degrees["fsdp"] * micro) * tc.seq_len
    tensors = layer_tensors(cfg, degrees["tensor"])
    per_layer = sum(tensors[k] for k in SAVED[m.remat])
    # GPipe as one scan over microbatches and stages keeps (micro + pipe - 1) iterations' worth.
    in_flight = micro + pipe - 1 if pipe > 1 else 1
    saved = tokens * per_layer * (m.n_layers // pipe) * in_flight
    if m.remat == "none":  # the forward is already saved: only the backward's extra arrays
        layer_bwd = tensors["scores_backward"] - tensors["scores"] + 2 * tensors["x_in"]
    else:
        layer_bwd = tensors["scores_backward"] + sum(
            v for k, v in tensors.items() if k in SAVED["none"] and k != "scores")
    vocab = m.padded_vocab / degrees["tensor"]
    loss = 4 * c * m.d_model + (c + 8) * vocab  # logits (compute dtype) and two fp32 arrays
    peak = "loss" if loss > layer_bwd else "layer_backward"
    acts = saved + tokens * max(loss, layer_bwd)
    table = m.padded_vocab * m.d_model * p
    work = 2 * table + table / degrees["tensor"] + 2 * state["one_layer_gathered"]
    grads = state["grads"] * (2 if micro > 1 else 1)  # microbatches: accumulator + this one's
    out = {"params": state["params"], "grads": grads, "optimizer": state["optimizer"],
           "activations": int(acts), "workspace": int(work)}
    out["total"] = sum(out.values())
    out["detail"] = {
        "peak_at": peak, "tokens_per_microbatch": tokens, "microbatches_in_flight": in_flight,
        "saved_bytes_per_token_per_layer": per_layer, "saved_activations": int(saved),
        "layer_backward_bytes_per_token": layer_bwd, "loss_bytes_per_token": loss,
        "layer_params": state["layer_params"], "layer_optimizer": state["layer_optimizer"],
        "one_layer_gathered": state["one_layer_gathered"],
    }
    return out
