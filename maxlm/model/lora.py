"""LoRA adapters over the parameter tree: which leaves they are, how many, and folding them in.

The adapters themselves are computed in the linear seam (``maxlm.model.linear.lora``); this module
works on whole parameter trees, for the trainer (``trainable``: adapters only, so the base is frozen
and has no optimizer state), for export (``merge``: W + (alpha / r) A B, the model without
adapters) and for saving adapters alone (``adapters`` / ``with_adapters``).

Leaves are addressed by slash paths as ``maxlm.hf.convert`` writes them, e.g.
``layers/attn/q_proj/lora_a`` [n_layers, d_model, r].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from maxlm.config import ModelConfig

ADAPTER_LEAVES = ("lora_a", "lora_b")


def is_adapter(path: tuple) -> bool:
    """Whether a tree path (of jax.tree_util keys or strings) ends in an adapter leaf."""
    last = path[-1] if path else None
    return getattr(last, "key", last) in ADAPTER_LEAVES


def trainable(params: Any) -> Any:
    """The Task mask of a run with adapters: True on adapter leaves, False on the frozen base."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_adapter(path), params)


def count(cfg: ModelConfig) -> int:
    """Adapter parameters in closed form: r (in + out) per targeted Linear, in every layer."""
    sizes = {"attn/q_proj": (cfg.d_model, cfg.n_heads * cfg.dim_per_head),
             "attn/k_proj": (cfg.d_model, cfg.kv_heads * cfg.dim_per_head),
             "attn/v_proj": (cfg.d_model, cfg.kv_heads * cfg.dim_per_head),
             "attn/o_proj": (cfg.n_heads * cfg.dim_per_head, cfg.d_model),
             "mlp/gate_proj": (cfg.d_model, cfg.d_ff), "mlp/up_proj": (cfg.d_model, cfg.d_ff),
             "mlp/down_proj": (cfg.d_ff, cfg.d_model), "lm_head": (cfg.d_model, cfg.padded_vocab)}
    return sum(cfg.lora_rank * sum(sizes[p]) * (1 if p == "lm_head" else cfg.n_layers)
               for p in cfg.lora_paths())


def _node(tree: Mapping, path: str) -> Mapping:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _module_path(linear_path: str) -> str:
    """The parameter-tree path of a Linear (``attn/q_proj`` -> ``layers/attn/q_proj``)."""
    return linear_path if linear_path == "lm_head" else f"layers/{linear_path}"


def _copy(tree: Mapping) -> dict:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def delta(cfg: ModelConfig, node: Mapping, layered: bool) -> jax.Array:
    """(alpha / r) A B of one Linear's adapters, shaped like its kernel ([L,] *in, *out), in fp32."""
    a, b = jnp.asarray(node["lora_a"], jnp.float32), jnp.asarray(node["lora_b"], jnp.float32)
    lead, r = a.shape[:1] if layered else (), cfg.lora_rank
    in_shape, out_shape = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
    ab = jnp.matmul(a.reshape(*lead, math.prod(in_shape), r), b.reshape(*lead, r, math.prod(out_shape)))
    return (ab * (cfg.lora_alpha / r)).reshape(*lead, *in_shape, *out_shape)


def base_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without adapters: the base they sit on."""
    return dataclasses.replace(cfg, lora_rank=0)


def merged_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without adapters; a quantized Linear that carried them becomes dense (merging
    dequantizes it: the sum of an INT4 weight and a low-rank update is not INT4)."""
    quantized = [p for p in cfg.lora_paths() if cfg.linear_impl(p) != "dense"]
    rules = tuple((f"^{p}$", "dense") for p in quantized) + tuple(cfg.linear_rules)
    return dataclasses.replace(base_config(cfg), linear_rules=rules)


def merge(cfg: ModelConfig, params: Mapping) -> tuple[ModelConfig, dict]:
    """(config, params) of the same function without adapters: each adapted kernel becomes
    W + (alpha / r) A B in the adapters' dtype (an int8/int4 base is dequantized first)."""
    from maxlm.model.linear import dequantize

    out = _copy(params)
    for path in cfg.lora_paths():
        node, layered = _node(out, _module_path(path)), path != "lm_head"
        d = delta(cfg, node, layered)
        impl = cfg.linear_impl(path)
        if impl == "dense":
            base = jnp.asarray(node["kernel"], jnp.float32)
        else:  # each layer's qweight/scales [rows, *out] -> W [K, *out]
            q, s = node.pop("qweight"), node.pop("scales")
            n_out = math.prod(q.shape[1 + layered:])
            deq = lambda q, s: dequantize(impl, q.reshape(q.shape[0], n_out), s.reshape(s.shape[0], n_out))
            base = (jax.vmap(deq) if layered else deq)(q, s).reshape(d.shape)
        node["kernel"] = (base + d).astype(node["lora_a"].dtype)
        del node["lora_a"], node["lora_b"]
    return merged_config(cfg), out


def adapters(params: Any) -> dict[str, jax.Array]:
    """The adapter leaves alone, by slash path (``layers/attn/q_proj/lora_a``, ...)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat if is_adapter(path)}


def with_adapters(cfg: ModelConfig, params: Mapping, found: Mapping[str, Any]) -> dict:
    """``params`` (of ``cfg``, or its base without adapters) with the adapter leaves ``found``
    (slash path -> array): every adapter ``cfg`` has must be there with its shape, and nothing
    else (a ValueError names the first that is not)."""
    from maxlm.model.transformer import abstract_params

    want = adapters(abstract_params(cfg))
    missing = [p for p in want if p not in found]
    if missing:
        raise ValueError(f"no adapter for {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [p for p in found if p not in want]
    if extra:
        raise ValueError(f"adapter {extra[0]} has no place in this model (ModelConfig.lora_targets)")
    out = _copy(params)
    for path, leaf in want.items():
        if tuple(found[path].shape) != tuple(leaf.shape):
            raise ValueError(f"adapter {path} is {tuple(found[path].shape)}, the model's is {tuple(leaf.shape)} "
                             "(ModelConfig.lora_rank or the model's sizes differ)")
        *parents, name = path.split("/")
        _node(out, "/".join(parents))[name] = jnp.asarray(found[path], leaf.dtype)
    return out


def base_bytes(params: Any) -> int:
    """Bytes of the frozen base (everything but the adapters), as stored."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(leaf.size * leaf.dtype.itemsize for path, leaf in flat if not is_adapter(path))


def without_adapters(tree: Any) -> Any:
    """A nested-dict tree (params, their shardings or shapes) without its adapter leaves: the base
    a LoRA run starts from."""
    if not isinstance(tree, Mapping):
        return tree
    return {k: without_adapters(v) for k, v in tree.items() if k not in ADAPTER_LEAVES}


def with_base(params: Mapping, base: Mapping) -> dict:
    """``params`` (fresh, adapters included) with every leaf ``base`` has taken from ``base``."""
    return {k: (with_base(v, base[k]) if isinstance(v, Mapping) else base[k]) if k in base else v
            for k, v in params.items()}
