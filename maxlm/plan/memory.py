"""Per-device memory of one training step, from the config alone: the planner's memory model.

Parameters, gradients and optimizer state are derived, not modelled: the real TrainState is built
abstractly (``maxlm.model.abstract_params``, ``jax.eval_shape``) and sharded by
``maxlm.train.step.state_shardings`` over an ``AbstractMesh`` of the config's degrees, so the bytes
per device follow ``maxlm.rules.RULES`` and the real optimizer (AdamW keeps two moments, Lion one,
Adafactor factored ones, which the rules leave replicated). Gradients are fp32 like the
parameters, twice over with microbatches (the accumulator and the current microbatch's).

Activations are modelled per token: what autodiff keeps per layer under ``ModelConfig.remat``
(``SAVED``), plus the larger of two transient peaks: the loss (logits in the compute dtype, and
two fp32 arrays of their size: the upcast logits and their gradient) or one layer's backward
(its recomputed forward, and XLA attention's [heads, T, T] softmax and score gradient in fp32;
cuDNN's flash attention keeps only per-head statistics). Gradient accumulation
(``OptimConfig.microbatches``) divides the tokens and runs one microbatch at a time. A pipeline
(``maxlm.parallel.pipeline_parallel``) splits each of those into ``MeshConfig.pipeline_microbatches``
and runs one scan of ``Schedule.iterations`` = repeats * slots + stages - 1 iterations, each
applying a stage's n_layers / (stages * repeats) layers to one pipeline microbatch, bubbles
included: autodiff keeps all of them, plus the stage's microbatch buffer and its gradient; the
head and the loss then run on the whole microbatch. ``workspace`` is held throughout: the
embedding table gathered whole for the lookup (``maxlm.model`` gathers it) and its full-size fp32
gradient, the output projection gathered over fsdp, and one layer's fsdp-gathered weights and
unreduced gradient.

The per-token constants were fitted to XLA's buffer assignment of the real compiled step
(``maxlm.plan --aot``, fake CPU devices): XLA's temporaries are 0.93-1.06x the estimate across
remat policies, microbatches, optimizers, tensor and fsdp degrees for llama3_1b, llama3_8b,
gpt2_124m and gpt175b (toy models, where fixed overheads dominate, read higher). Pipelined, a
512-wide 8-layer model on 8 devices reads 0.95-1.09 with 2-4 pipeline microbatches (circular
too), 1.10-1.18 with one. They follow
``maxlm.model.attention``'s XLA path: when that changes, rerun --aot and refit ``layer_tensors``.

Host offload (``OptimConfig.offload_state`` / ``offload_params``) is read off the same shardings:
a leaf whose memory kind is ``pinned_host`` counts in ``host`` (bytes of host memory per device),
not on the device. Offloaded optimizer state leaves the device total; the update brings it back
for a moment, after the backward pass has freed the activations, so it adds only where it
exceeds activations + workspace (``detail.offload_transient``). Offloaded parameters count on
both: the step copies them all to the device for the forward and backward passes, so they free
device memory between steps, not at the step's peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from maxlm import model, rules
from maxlm.model import attention, lora
from maxlm.config import Config
from maxlm.parallel import pipeline_parallel, sharding
from maxlm.train import optim, step

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def abstract_mesh(degrees: dict[str, int]) -> AbstractMesh:
    """A device-free mesh of the given degrees: enough for NamedSharding.shard_shape."""
    return AbstractMesh(tuple(degrees[a] for a in rules.MESH_AXES), rules.MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(rules.MESH_AXES))


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def _is_layer(path: tuple[Any, ...]) -> bool:
    return any(getattr(p, "key", None) == "layers" for p in path)


def state_bytes(cfg: Config, degrees: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state, from the real shardings.

    Also the per-layer share of each (``layer_*``: the part that scales with n_layers), one
    layer's weights as the forward sees them (gathered over fsdp, still split over tensor), and
    the bytes of each kept in host memory between steps (``*_host``: offloaded)."""
    # Only the shapes matter: normalise what cannot change them, so planning variants is cheap.
    shapes_only = dataclasses.replace(cfg.model, remat="none", attention_impl="xla")
    key = dataclasses.replace(cfg, model=shapes_only, train=dataclasses.replace(cfg.train, steps=1))
    return dict(_state_bytes(key, tuple(sorted(degrees.items()))))


@functools.lru_cache(maxsize=64)
def _state_bytes(cfg: Config, degree_items: tuple[tuple[str, int], ...]) -> tuple:
    degrees = dict(degree_items)
    mesh = abstract_mesh(degrees)
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    # With LoRA only the adapters train: the frozen base has no gradients and no optimizer state.
    trainable = lora.trainable if cfg.model.lora_rank else None
    shardings = step.state_shardings(cfg, mesh, optimizer, trainable)
    params = model.abstract_params(cfg.model)
    train_params, _ = step.split(params, step.trainable_mask(params, trainable))
    opt_state = jax.eval_shape(optimizer.init, train_params)

    def per_device(tree, shardings_tree):
        total = layers = host = 0
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, leaf), sh in zip(leaves, jax.tree.leaves(shardings_tree)):
            b = _nbytes(sh.shard_shape(leaf.shape), leaf.dtype)
            total += b
            layers += b if _is_layer(path) else 0
            host += b if sharding.on_host(sh) else 0
        return total, layers, host

    p_total, p_layers, p_host = per_device(params, shardings.params)
    train_shardings, _ = step.split(shardings.params, step.trainable_mask(params, trainable))
    g_total, _, _ = per_device(train_params, train_shardings)
    o_total, o_layers, o_host = per_device(opt_state, shardings.opt_state)
    # One layer as the matmuls see it: gathered over fsdp (ZeRO-3), still split over tensor.
    gathered = dict(degrees, fsdp=1, pipeline=1)
    gmesh = abstract_mesh(gathered)
    one_layer = 0
    for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                jax.tree.leaves(shardings.params)):
        if _is_layer(path):
            shape = NamedSharding(gmesh, sh.spec).shard_shape(leaf.shape)
            one_layer += _nbytes(shape[1:], leaf.dtype)
    return (("params", p_total), ("grads", g_total), ("optimizer", o_total),
            ("layer_params", p_layers), ("layer_optimizer", o_layers), ("one_layer_gathered", one_layer),
            ("params_host", p_host), ("optimizer_host", o_host))


def layer_tensors(cfg: Config, tensor: int) -> dict[str, float]:
    """Bytes per token of each tensor one layer's forward produces, as sharded over ``tensor``.

    D-sized tensors (the residual stream) are replicated over ``tensor``; heads and mlp are split."""
    m = cfg.model
    c = DTYPE_BYTES[m.dtype]
    d, h, t = m.d_model, m.dim_per_head, cfg.train.seq_len
    heads, kv, ff = m.n_heads / tensor, m.kv_heads / tensor, m.d_ff / tensor
    flash = m.attention_impl in ("cudnn", "pallas")  # fused kernels keep no [T, T] scores
    # xla attention computes only its schedule's blocks: keys per query on average, and it keeps
    # the probabilities for the backward pass only when rows are short (else recomputes them).
    schedule = attention.self_attention_schedule(t, m.sliding_window)
    keys = sum((hi - lo) * (hi - first) for lo, hi, first in schedule) / t
    stored = attention.stores_scores(schedule)
    return {
        "x_in": c * d,  # the layer input (the scan carry); every policy keeps it
        "norm1": c * d,
        "qkv": c * (heads + 2 * kv) * h,
        "rope": c * (heads + kv) * h if m.position == "rope" else 0.0,
        # xla attention materialises fp32 scores and compute-dtype probabilities [N, T, keys] and
        # a boolean mask; cuDNN's flash kernel keeps only the log-sum-exp per head.
        "scores": 4 * heads if flash else (4 + c + 1) * heads * keys if stored else 0.0,
        # ...and its backward holds two fp32 [N, T, keys] arrays at once (the softmax and the
        # scores' gradient) besides the probabilities in the compute dtype.
        "scores_backward": 8 * heads if flash else (8 + c) * heads * keys,
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
    "save_named": ("x_in", "qkv", "ctx", "o_out", "mlp_hidden"),  # maxlm.model.transformer.SAVED_NAMES
    "full": ("x_in",),
}


def effective_remat(cfg: Config, degrees: dict[str, int]) -> str:
    """The remat policy as it acts: in a pipeline the stages run under ``vmap``, which gives every
    matmul a batch dimension, so "save_dots" (``dots_with_no_batch_dims_saveable``) saves none of
    them and recomputes like "full" (XLA's --aot memory agrees)."""
    remat = cfg.model.remat
    return "full" if remat == "save_dots" and degrees["pipeline"] > 1 else remat


def pipeline_schedule(cfg: Config, degrees: dict[str, int]) -> pipeline_parallel.Schedule:
    """The schedule the layer stack runs per optimizer microbatch: the pipeline's (stages, repeats,
    MeshConfig.pipeline_microbatches, layers per stage and repeat), or one plain scan of n_layers."""
    pipe, n_layers = degrees["pipeline"], cfg.model.n_layers
    if pipe == 1:
        return pipeline_parallel.Schedule(1, 1, 1, n_layers)
    repeats = cfg.mesh.pipeline_repeats
    return pipeline_parallel.Schedule(pipe, repeats, cfg.mesh.pipeline_microbatches,
                                      pipeline_parallel.check(n_layers, pipe, repeats))


def memory(cfg: Config, degrees: dict[str, int]) -> dict[str, Any]:
    """Per-device peak bytes of device memory: params, grads, optimizer (the part kept on the
    device), activations, workspace, total; host (bytes of host memory per device that offloaded
    state keeps); and detail (see the module docstring for what each part holds)."""
    m, tc = cfg.model, cfg.train
    state = state_bytes(cfg, degrees)
    micro = cfg.optim.microbatches  # gradient accumulation: one optimizer microbatch live at a time
    c, p = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.param_dtype]
    tokens = tc.global_batch // (degrees["data"] * degrees["fsdp"] * micro) * tc.seq_len
    tensors = layer_tensors(cfg, degrees["tensor"])
    remat = effective_remat(cfg, degrees)
    per_layer = sum(tensors[k] for k in SAVED[remat])
    # Each layer application of the stack's scan is saved for the backward: a pipeline's are
    # (iterations x layers per stage) on one pipeline microbatch each, bubble iterations included.
    sched = pipeline_schedule(cfg, degrees)
    layer_tokens = tokens // sched.microbatches
    layer_calls = sched.iterations * sched.layers_per_stage
    saved = layer_tokens * per_layer * layer_calls
    # The pipeline's buffer of microbatch slots (its stage's copy) and that buffer's gradient.
    buffer = 2 * sched.slots * layer_tokens * c * m.d_model if degrees["pipeline"] > 1 else 0
    if remat == "none":  # the forward is already saved: only the backward's extra arrays
        layer_bwd = tensors["scores_backward"] - tensors["scores"] + 2 * tensors["x_in"]
    else:
        layer_bwd = tensors["scores_backward"] + sum(
            v for k, v in tensors.items() if k in SAVED["none"] and k != "scores")
    if degrees["pipeline"] > 1:  # XLA keeps one more fp32 [heads, T, S] array live in a pipelined
        layer_bwd += tensors["scores_backward"] / 2  # layer's backward (fitted with --aot)
    vocab = m.padded_vocab / degrees["tensor"]
    loss = 4 * c * m.d_model + (c + 8) * vocab  # logits (compute dtype) and two fp32 arrays
    # The head and the loss see the whole optimizer microbatch; a layer's backward one pipeline one.
    peak = "loss" if tokens * loss > layer_tokens * layer_bwd else "layer_backward"
    acts = saved + buffer + max(tokens * loss, layer_tokens * layer_bwd)
    table = m.padded_vocab * m.d_model * p
    work = 2 * table + table / degrees["tensor"] + 2 * state["one_layer_gathered"]
    grads = state["grads"] * (2 if micro > 1 else 1)  # microbatches: accumulator + this one's
    opt_host = state["optimizer_host"]
    # Offloaded optimizer state is on the device only for the update, once the backward is done.
    transient = max(0, opt_host - int(acts) - int(work))
    out = {"params": state["params"], "grads": grads, "optimizer": state["optimizer"] - opt_host,
           "activations": int(acts), "workspace": int(work)}
    out["total"] = sum(out.values()) + transient
    out["host"] = state["params_host"] + opt_host
    out["detail"] = {
        "peak_at": peak, "tokens_per_microbatch": tokens, "tokens_per_layer_call": layer_tokens,
        "layer_calls_saved": layer_calls, "pipeline_buffer": int(buffer),
        "saved_bytes_per_token_per_layer": per_layer, "saved_activations": int(saved),
        "layer_backward_bytes_per_token": layer_bwd, "loss_bytes_per_token": loss,
        "layer_params": state["layer_params"], "layer_optimizer": state["layer_optimizer"],
        "one_layer_gathered": state["one_layer_gathered"],
        "offloaded_optimizer": opt_host, "offloaded_params": state["params_host"],
        "offload_transient": transient,
    }
    return out
