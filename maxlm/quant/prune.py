"""Structured pruning: whole attention heads (kv groups) or whole layers, chosen on calibration data.

A unit is what can go without breaking the model's shape rules: under grouped-query attention a
kv group (one kv head and the G query heads that read it), so n_heads and n_kv_heads shrink
together and n_heads % n_kv_heads stays 0 (with MHA a group is one head); or a whole layer, whose
residual then passes straight through.

Removing a unit equals masking it in the original: a group's query heads reach the residual only
through their rows of ``o_proj``, and a layer only through ``o_proj`` and ``mlp/down_proj``, so
zeroing those (``mask_params``) gives the pruned model's function exactly. That masked original is
both how importance is measured and the reference the sliced model is tested against.

Scores (higher = more important; the lowest go):
  importance  the calibration loss increase when the unit alone is masked (exact; one forward
              pass over the calibration batches per unit)
  taylor      first order (Michel et al. 2019): |d loss / d gate| of the unit's mask at 1, per
              calibration batch, averaged. A gate scales the unit's o_proj rows (and down_proj for a
              layer), so this is |sum(grad * weight)| over those, the linear estimate of masking the
              unit; q/k/v products are left out because zeroing q/k does not remove a head (it
              flattens its attention). One backward pass per batch for all units
  random      a seeded uniform draw (the baseline importance must beat)

Heads: the same number of groups goes from every layer (so the config stays uniform), and each
layer loses its own lowest-scoring groups. Layers: the N lowest-scoring layers go. Slicing follows
each parameter's logical axis names (``heads``, ``kv_heads``, ``layers``), so every parameter of
the stacked layers (q/k/v columns, o rows, biases) is cut along the right axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import model
from maxlm.config import QUANT_IMPLS, ModelConfig
from maxlm.parallel import sharding

METHODS = ("importance", "taylor", "random")
_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


class PruneError(ValueError):
    """A pruning request that cannot be met; str(err) is the one line to print."""


def check_prunable(cfg: ModelConfig) -> None:
    """Pruning slices dense kernels: a quantized model is pruned before quantizing."""
    if cfg.linear in QUANT_IMPLS or cfg.linear_rules or cfg.embedding in QUANT_IMPLS:
        raise PruneError(f"the model is quantized (ModelConfig.linear = {cfg.linear!r}, linear_rules = "
                         f"{cfg.linear_rules!r}, embedding = {cfg.embedding!r}); prune the unquantized run "
                         "and quantize the result")


def groups_to_remove(cfg: ModelConfig, fraction: float) -> int:
    """kv groups removed per layer for ``fraction`` of the heads: fraction * n_kv_heads, to the
    nearest whole group (a tie rounds down: never more than asked). Refuses 0 and all."""
    k, g = cfg.kv_heads, cfg.n_heads // cfg.kv_heads
    if not 0 < fraction < 1:
        raise PruneError(f"--heads {fraction}: the fraction of heads must lie in (0, 1)")
    exact = fraction * k
    r = math.ceil(exact - 0.5 - 1e-9)
    unit = f"{k} kv groups of {g} query heads" if g > 1 else f"{k} heads"
    if r < 1:
        raise PruneError(f"--heads {fraction}: {fraction} of the {unit} per layer is {exact:g} groups, which "
                         f"rounds to 0; whole groups go, so the smallest fraction is {1 / k:g}")
    if r >= k:
        raise PruneError(f"--heads {fraction}: removes all {k} groups of each layer ({unit}); at most "
                         f"{(k - 1) / k:g} can go")
    return r


def check_layers(cfg: ModelConfig, n: int) -> None:
    if n < 1:
        raise PruneError(f"--layers {n}: must remove at least 1 layer")
    if n >= cfg.n_layers:
        raise PruneError(f"--layers {n}: the model has {cfg.n_layers} layers (ModelConfig.n_layers); "
                         f"at most {cfg.n_layers - 1} can go")


# ---- masking: the original model with units switched off (the reference for slicing)


def head_mask(cfg: ModelConfig, keep_groups: np.ndarray) -> np.ndarray:
    """[L, n_heads] 0/1 from a [L, n_kv_heads] 0/1 mask: query head n reads kv head n // G
    (``maxlm.model.attention.fold_heads``)."""
    return np.repeat(np.asarray(keep_groups, np.float32), cfg.n_heads // cfg.kv_heads, axis=1)


def mask_params(params: Any, heads: jax.Array | None = None, layers: jax.Array | None = None) -> Any:
    """``params`` with query heads (``heads`` [L, n_heads], 0 = off) and layers (``layers`` [L],
    0 = skipped) switched off by zeroing what carries them into the residual: a head's rows of
    o_proj; a layer's o_proj and down_proj (kernels and biases). Traceable (used under jit)."""
    stack = params["layers"]
    attn_o, down = dict(stack["attn"]["o_proj"]), dict(stack["mlp"]["down_proj"])

    def scale(x, s):
        return x * s.reshape(s.shape + (1,) * (x.ndim - s.ndim)).astype(x.dtype)

    if heads is not None:
        attn_o["kernel"] = scale(attn_o["kernel"], heads)  # [L, N, H, D]
    if layers is not None:
        attn_o = {k: scale(v, layers) for k, v in attn_o.items()}
        down = {k: scale(v, layers) for k, v in down.items()}
    stack = {**stack, "attn": {**stack["attn"], "o_proj": attn_o}, "mlp": {**stack["mlp"], "down_proj": down}}
    return {**params, "layers": stack}


# ---- scores


def _batches(batches: list[dict]) -> list[dict]:
    if not batches:
        raise PruneError("no calibration batches to score on")
    return [{k: b[k] for k in _KEYS} for b in batches]


def _masked_nll(cfg: ModelConfig) -> Callable:
    """(summed NLL, summed weight) of a batch with heads/layers masked (mask_params)."""
    def loss(params, heads, layers, batch):
        logits, _ = model.forward(cfg, mask_params(params, heads, layers), batch["inputs"],
                                  batch["segment_ids"], batch["positions"])
        return model.cross_entropy(logits, batch["targets"], batch["weights"], cfg.vocab_size)
    return loss


def _loss_fn(cfg: ModelConfig):
    return jax.jit(_masked_nll(cfg))


def masked_loss(cfg: ModelConfig, params: Any, batches: list[dict], heads: np.ndarray | None = None,
                layers: np.ndarray | None = None, fn: Callable | None = None) -> float:
    """Mean token NLL over ``batches`` of the model with those heads/layers masked."""
    fn = fn or _loss_fn(cfg)
    heads = np.ones((cfg.n_layers, cfg.n_heads), np.float32) if heads is None else heads
    layers = np.ones((cfg.n_layers,), np.float32) if layers is None else layers
    total = weight = 0.0
    for batch in _batches(batches):
        s, w = jax.device_get(fn(params, heads, layers, batch))
        total, weight = total + float(s), weight + float(w)
    if weight <= 0:
        raise PruneError("the calibration batches hold no weighted tokens")
    return total / weight


def _gate_grads(cfg: ModelConfig, params: Any, batches: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(|d loss / d gate| of every kv group [L, K], of every layer [L]), the gates at 1, taken per
    calibration batch (so opposite-signed batches do not cancel) and averaged by token weight."""
    nll = _masked_nll(cfg)

    def mean_loss(params, heads, layers, batch):
        total, weight = nll(params, heads, layers, batch)
        return total / jnp.maximum(weight, 1.0)

    fn = jax.jit(jax.grad(mean_loss, argnums=(1, 2)))
    n_layers, k = cfg.n_layers, cfg.kv_heads
    heads, layers = np.ones((n_layers, cfg.n_heads), np.float32), np.ones(n_layers, np.float32)
    group_sum, layer_sum, weight = np.zeros((n_layers, k)), np.zeros(n_layers), 0.0
    for batch in _batches(batches):
        g_heads, g_layers = jax.device_get(fn(params, heads, layers, batch))
        w = float(np.sum(batch["weights"]))
        # one gate per group: its query heads' gradients add up
        group_sum += w * np.abs(np.asarray(g_heads, np.float64).reshape(n_layers, k, -1).sum(-1))
        layer_sum += w * np.abs(np.asarray(g_layers, np.float64))
        weight += w
    if weight <= 0:
        raise PruneError("the calibration batches hold no weighted tokens")
    return group_sum / weight, layer_sum / weight


def head_scores(cfg: ModelConfig, params: Any, batches: list[dict], method: str = "importance",
                seed: int = 0, log: Callable[[str], None] | None = None) -> np.ndarray:
    """[n_layers, n_kv_heads] importance of every kv group (higher = keep)."""
    n_layers, k = cfg.n_layers, cfg.kv_heads
    if method == "random":
        return np.random.default_rng(seed).random((n_layers, k))
    if method == "taylor":
        return _gate_grads(cfg, params, batches)[0]
    if method != "importance":
        raise PruneError(f"method {method!r} is not one of {', '.join(METHODS)}")
    fn = _loss_fn(cfg)
    base = masked_loss(cfg, params, batches, fn=fn)
    scores = np.zeros((n_layers, k))
    for layer in range(n_layers):
        for group in range(k):
            keep = np.ones((n_layers, k), np.float32)
            keep[layer, group] = 0
            scores[layer, group] = masked_loss(cfg, params, batches, head_mask(cfg, keep), fn=fn) - base
        if log:
            rises = " ".join(f"{s:+.4f}" for s in scores[layer])
            log(f"  layer {layer} ({layer + 1}/{n_layers}): calibration loss {rises} nats when each kv group is masked")
    return scores


def layer_scores(cfg: ModelConfig, params: Any, batches: list[dict], method: str = "importance",
                 seed: int = 0, log: Callable[[str], None] | None = None) -> np.ndarray:
    """[n_layers] importance of every layer (higher = keep)."""
    n_layers = cfg.n_layers
    if method == "random":
        return np.random.default_rng(seed).random(n_layers)
    if method == "taylor":
        return _gate_grads(cfg, params, batches)[1]
    if method != "importance":
        raise PruneError(f"method {method!r} is not one of {', '.join(METHODS)}")
    fn = _loss_fn(cfg)
    base = masked_loss(cfg, params, batches, fn=fn)
    scores = np.zeros(n_layers)
    for layer in range(n_layers):
        keep = np.ones(n_layers, np.float32)
        keep[layer] = 0
        scores[layer] = masked_loss(cfg, params, batches, layers=keep, fn=fn) - base
        if log:
            log(f"  layer {layer} ({layer + 1}/{n_layers}): calibration loss {scores[layer]:+.4f} nats when skipped")
    return scores


def lowest(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` lowest scores along the last axis, sorted (ties: the lower index)."""
    order = np.argsort(scores, axis=-1, kind="stable")[..., :n]
    return np.sort(order, axis=-1)


def kept(total: int, removed: np.ndarray) -> np.ndarray:
    """The complement of ``removed`` (per row when 2-D), in order."""
    removed = np.atleast_2d(removed)
    rows = [np.array([i for i in range(total) if i not in set(r.tolist())]) for r in removed]
    return np.stack(rows)


# ---- slicing


def _names(cfg: ModelConfig) -> Any:
    """Tree of each parameter's logical axis names (tuples)."""
    return jax.tree.map(tuple, sharding.logical_specs(model.abstract_params(cfg, boxed=True)))


def prune_heads(cfg: ModelConfig, params: Any, keep_groups: np.ndarray) -> tuple[ModelConfig, Any]:
    """Keep, in every layer l, the kv groups ``keep_groups[l]`` (a [L, K'] array of group indices;
    the same K' in every layer): (config with n_heads = K'*G and n_kv_heads = K', sliced params)."""
    check_prunable(cfg)
    keep_groups = np.asarray(keep_groups)
    n_layers, k, g = cfg.n_layers, cfg.kv_heads, cfg.n_heads // cfg.kv_heads
    if keep_groups.ndim != 2 or keep_groups.shape[0] != n_layers or not 0 < keep_groups.shape[1] <= k:
        raise PruneError(f"keep_groups has shape {keep_groups.shape}; expected [{n_layers}, 1..{k}]")
    kv_index = keep_groups
    q_index = (kv_index[:, :, None] * g + np.arange(g)).reshape(n_layers, -1)  # query heads of each group

    def cut(names, x):
        for name, index in (("heads", q_index), ("kv_heads", kv_index)):
            if name in names:
                if names[0] != "layers":
                    raise PruneError(f"a {name} axis outside the layer stack: {names}")
                axis = names.index(name)
                shape = [1] * x.ndim
                shape[0], shape[axis] = n_layers, index.shape[1]
                x = jnp.take_along_axis(x, jnp.asarray(index.reshape(shape)), axis=axis)
        return x

    new_params = jax.tree.map(cut, _names(cfg), params, is_leaf=lambda n: isinstance(n, tuple))
    new_cfg = dataclasses.replace(cfg, n_heads=q_index.shape[1],
                                  n_kv_heads=kv_index.shape[1] if cfg.n_kv_heads else 0,
                                  head_dim=cfg.dim_per_head)  # d_model // n_heads changes with n_heads
    return new_cfg, new_params


def prune_layers(cfg: ModelConfig, params: Any, keep_layers: np.ndarray) -> tuple[ModelConfig, Any]:
    """Keep the layers ``keep_layers`` (indices, in order): (config with n_layers, sliced params)."""
    check_prunable(cfg)
    keep_layers = np.asarray(keep_layers).reshape(-1)
    if not 0 < keep_layers.size <= cfg.n_layers:
        raise PruneError(f"keep_layers has {keep_layers.size} entries; expected 1..{cfg.n_layers}")
    index = jnp.asarray(keep_layers)

    def cut(names, x):
        return jnp.take(x, index, axis=0) if names[:1] == ("layers",) else x

    new_params = jax.tree.map(cut, _names(cfg), params, is_leaf=lambda n: isinstance(n, tuple))
    return dataclasses.replace(cfg, n_layers=int(keep_layers.size)), new_params
