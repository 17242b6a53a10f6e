"""Quantize a model's parameter tree: dense params + the quantized ModelConfig -> quantized params.

``quantize_model(cfg, params, qcfg, method, batches)`` returns the tree ``maxlm.model`` builds for
``qcfg`` (``linear_rules``, groups, ``embedding``; see ``maxlm.quant.policy``), every quantized
Linear's ``kernel`` replaced by ``qweight``/``scales`` and everything else kept (AWQ also rescales
the norms and projections its scales fold into, ``maxlm.quant.awq``).

``rtn`` needs no data. ``gptq`` and ``awq`` run the calibration batches through the model one
layer at a time, sequentially: the embedding (quantized first if ``qcfg`` quantizes it) gives layer
0's inputs; each layer's Linear inputs are captured by intercepting ``Linear.__call__`` while the
layer runs with its dense weights; its Linears are quantized from those statistics; and the layer
then runs again with its quantized weights to give the next layer's inputs, so every layer is
fitted to the errors of the quantized layers below it (as the GPTQ reference does). Within one
layer all Linears see the dense layer's activations (the reference's default, not its
``--true-sequential``). An untied LM head, when quantized, is fitted last on the final norm's output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm import model
from maxlm.config import QUANT_IMPLS, ModelConfig
from maxlm.model.layers import Block, LayerContext, Norm
from maxlm.model.linear import Linear, linear_path
from maxlm.quant import awq, gptq, rtn

METHODS = ("rtn", "gptq", "awq")
AWQ_SAMPLE_ROWS = 4096  # calibration rows the AWQ scale search scores on


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    path: str  # as ModelConfig.linear_rules match it: attn/q_proj, mlp/down_proj, lm_head
    where: tuple[str, ...]  # its params' keys in the tree: ("layers", "attn", "q_proj")
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def stacked(self) -> bool:
        return self.where[0] == "layers"

    @property
    def n_in(self) -> int:
        return math.prod(self.in_shape)


def linear_specs(cfg: ModelConfig) -> list[LinearSpec]:
    """Every Linear that owns a weight (a tied LM head does not), found by running the model's
    init abstractly and intercepting ``Linear.__call__``."""
    specs: dict[str, LinearSpec] = {}

    def record(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, Linear) and context.method_name == "__call__" and kwargs.get("tied") is None:
            path = linear_path(module)
            specs[path] = LinearSpec(path, tuple(module.scope.path), tuple(module.in_shape), tuple(module.out_shape))
        return next_fun(*args, **kwargs)

    dense = dataclasses.replace(cfg, linear="dense", linear_rules=(), embedding="dense")
    with nn.intercept_methods(record):
        jax.eval_shape(lambda: model.Transformer(dense).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    return list(specs.values())


def weight_bytes(params: Any) -> int:
    return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def _get(tree: dict, keys: tuple[str, ...]) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def _with(tree: dict, keys: tuple[str, ...], value: Any) -> dict:
    """A copy of the nested dict ``tree`` with ``keys`` set to ``value``."""
    out = dict(tree)
    out[keys[0]] = value if len(keys) == 1 else _with(tree[keys[0]], keys[1:], value)
    return out


def _packed(spec: LinearSpec, impl: str, q: jax.Array, scales: jax.Array, old: dict) -> dict:
    """The Linear's quantized params: packed q and scales, and its bias as it was."""
    out = rtn.pack(impl, q, scales, spec.out_shape)
    if "bias" in old:
        out["bias"] = old["bias"]
    return out


# ---- round to nearest: no data, every layer at once


def _rtn_linear(spec: LinearSpec, impl: str, group: int, p: dict) -> dict:
    def one(kernel):
        q, scales = rtn.rtn(kernel.reshape(spec.n_in, -1), impl, group)
        return rtn.pack(impl, q, scales, spec.out_shape)
    out = jax.jit(jax.vmap(one) if spec.stacked else one)(p["kernel"])
    return {**out, **({"bias": p["bias"]} if "bias" in p else {})}


def quantize_embedding(qcfg: ModelConfig, params: dict) -> dict:
    """``params`` with the dense ``embed`` table replaced as ``qcfg.embedding`` says (RTN of the
    transposed table along d_model; a lookup only ever reads rows, so there is nothing to calibrate)."""
    if qcfg.embedding not in QUANT_IMPLS or "embed" not in params:
        return params
    impl = qcfg.embedding
    q, scales = rtn.rtn(params["embed"].T, impl, qcfg.quant_group_of(impl, qcfg.d_model))
    packed = rtn.pack(impl, q, scales, (qcfg.padded_vocab,))
    out = {k: v for k, v in params.items() if k != "embed"}
    return {**out, "embed_qweight": packed["qweight"], "embed_scales": packed["scales"]}


# ---- the layer-by-layer pass of the calibrated methods


def _dense_cfg(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, linear="dense", linear_rules=(), remat="none")


@functools.lru_cache(maxsize=8)
def _embed_fn(cfg: ModelConfig) -> Callable:
    """(params, batch) -> (layer 0's input, its LayerContext): the model up to its layer stack."""
    def inputs(params, batch):
        seen = {}

        def stack(block, cfg_, layers, x, ctx, cache):
            seen["x"], seen["ctx"] = x, ctx
            return x, cache
        model.forward(cfg, params, batch["inputs"], batch["segment_ids"], batch["positions"], stack=stack)
        return seen["x"], seen["ctx"]
    return jax.jit(inputs)


@functools.lru_cache(maxsize=8)
def _block_fn(cfg: ModelConfig) -> Callable:
    """(layer params, x, ctx) -> (the layer's output, {Linear path: its input [tokens, K] fp32})."""
    def run(layer_params, x, ctx: LayerContext):
        seen = {}

        def grab(next_fun, args, kwargs, context):
            module = context.module
            if isinstance(module, Linear) and context.method_name == "__call__":
                seen[linear_path(module)] = args[0].reshape(-1, math.prod(module.in_shape)).astype(jnp.float32)
            return next_fun(*args, **kwargs)
        with nn.intercept_methods(grab):
            y, _ = Block(cfg).apply({"params": layer_params}, x, ctx)
        return y, seen
    return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _norm_fn(cfg: ModelConfig) -> Callable:
    return jax.jit(lambda p, x: Norm(cfg).apply({"params": p}, x))


class _Stats:
    """Per-Linear statistics of its calibration inputs: H = 2 X^T X, mean |x| per input, and the
    first rows as a sample (AWQ)."""

    def __init__(self, keep_rows: int):
        self.keep_rows = keep_rows
        self.h: dict[str, jax.Array] = {}
        self.abs_sum: dict[str, jax.Array] = {}
        self.rows: dict[str, int] = {}
        self.sample: dict[str, list[jax.Array]] = {}

    def add(self, inputs: dict[str, jax.Array]) -> None:
        for path, x in inputs.items():
            self.h[path] = self.h.get(path, 0) + _hessian(x)
            self.abs_sum[path] = self.abs_sum.get(path, 0) + jnp.sum(jnp.abs(x), axis=0)
            self.rows[path] = self.rows.get(path, 0) + x.shape[0]
            have = sum(s.shape[0] for s in self.sample.get(path, []))
            if have < self.keep_rows:
                self.sample.setdefault(path, []).append(x[:self.keep_rows - have])

    def mean_abs(self, path: str) -> jax.Array:
        return self.abs_sum[path] / self.rows[path]

    def rows_of(self, path: str) -> jax.Array:
        return jnp.concatenate(self.sample[path])


_hessian = jax.jit(gptq.hessian)


def _awq_groups(cfg: ModelConfig) -> list[tuple[tuple[str, ...], tuple[str, str]]]:
    """(Linears that share one input, (kind, where the scale folds)) of one layer; see awq."""
    groups = [(("attn/q_proj", "attn/k_proj", "attn/v_proj"), ("norm", "attn_norm"))]
    if cfg.n_heads == cfg.kv_heads:
        groups.append((("attn/o_proj",), ("linear", "attn/v_proj")))
    mlp_in = ("mlp/gate_proj", "mlp/up_proj") if cfg.activation == "swiglu" else ("mlp/up_proj",)
    groups.append((mlp_in, ("norm", "mlp_norm")))
    if cfg.activation == "swiglu":
        groups.append((("mlp/down_proj",), ("linear", "mlp/up_proj")))
    return groups


def _fold(tree: dict, keys_of: Callable[[str], tuple[str, ...]], members: tuple[str, ...],
          prev: tuple[str, str], s: jax.Array, specs: dict[str, LinearSpec]) -> dict:
    """Scale the members' input rows up by s and the op before them down by s (exact in reals)."""
    for path in members:
        spec, p = specs[path], _get(tree, keys_of(path))
        kernel = p["kernel"].reshape(spec.n_in, -1) * s[:, None].astype(p["kernel"].dtype)
        tree = _with(tree, keys_of(path), {**p, "kernel": kernel.reshape(p["kernel"].shape)})
    kind, name = prev
    keys = keys_of(name) if kind == "linear" else (name,)
    p = dict(_get(tree, keys))
    if kind == "norm":
        p = {k: v / s.astype(v.dtype) for k, v in p.items()}  # scale, and LayerNorm's bias
    else:
        p["kernel"] = (p["kernel"].reshape(-1, s.shape[0]) / s.astype(p["kernel"].dtype)).reshape(p["kernel"].shape)
        if "bias" in p:
            p["bias"] = (p["bias"].reshape(-1) / s.astype(p["bias"].dtype)).reshape(p["bias"].shape)
    return _with(tree, keys, p)


class _Calibrated:
    """The sequential pass of GPTQ or AWQ over one model (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, qcfg: ModelConfig, method: str, damp: float, act_order: bool,
                 log: Callable[[str], None]):
        self.cfg, self.qcfg, self.method, self.damp, self.act_order, self.log = cfg, qcfg, method, damp, act_order, log
        self.specs = {s.path: s for s in linear_specs(cfg)}
        self.report: dict[str, list[float]] = {}

    def impl(self, path: str) -> str:
        return self.qcfg.linear_impl(path)

    def quantized(self, paths) -> list[str]:
        return [p for p in paths if p in self.specs and self.impl(p) in QUANT_IMPLS]

    def quantize_linear(self, spec: LinearSpec, p: dict, stats: _Stats, s: jax.Array | None) -> dict:
        """One Linear's quantized params; ``s``: AWQ's scale already folded into p (inputs are x / s)."""
        impl = self.impl(spec.path)
        group = self.qcfg.quant_group_of(impl, spec.n_in)
        w = p["kernel"].reshape(spec.n_in, -1).astype(jnp.float32)
        h = stats.h[spec.path]
        if s is not None:  # the statistics were of x; the folded Linear sees x / s
            h = h / s[:, None] / s[None, :]
        if self.method == "gptq":
            q, scales = gptq.quantize(w, h, impl, group, self.damp, self.act_order)
        else:
            x = stats.rows_of(spec.path)
            x = x / s if s is not None else x
            if spec.path.endswith(("q_proj", "k_proj")):  # AutoAWQ leaves q/k unclipped: scores are sensitive
                scales = rtn.group_scales(w, impl, group)
            else:
                scales = awq.clip_scales(x, w, impl, group)
            q = rtn.quantize_values(w, rtn.row_scales(scales, spec.n_in), impl)
        wq = q.astype(jnp.float32) * rtn.row_scales(scales, spec.n_in)
        self.report.setdefault(spec.path, []).append(gptq.output_error(w, wq, h))
        return _packed(spec, impl, q, scales, p)

    def layer(self, lp: dict, stats: _Stats) -> dict:
        """One layer's quantized params from its dense ones and its inputs' statistics."""
        keys_of = lambda path: tuple(path.split("/"))
        scaled: dict[str, jax.Array] = {}
        if self.method == "awq":
            for members, prev in _awq_groups(self.cfg):
                targets = self.quantized(members)
                if not targets:
                    continue
                first = targets[0]
                impl = self.impl(first)
                weights = [_get(lp, keys_of(m))["kernel"].reshape(self.specs[m].n_in, -1) for m in targets]
                s, alpha, before, after = awq.search_scale(
                    stats.rows_of(first), stats.mean_abs(first), weights, impl,
                    self.qcfg.quant_group_of(impl, self.specs[first].n_in))
                lp = _fold(lp, keys_of, members, prev, s, self.specs)
                scaled.update({m: s for m in members})
                self.report.setdefault(f"{'+'.join(members)} alpha", []).append(alpha)
        for path in self.quantized(p for p in self.specs if self.specs[p].stacked):
            lp = _with(lp, keys_of(path), self.quantize_linear(self.specs[path], _get(lp, keys_of(path)), stats,
                                                               scaled.get(path)))
        return lp

    def run(self, params: dict, batches: list[dict[str, np.ndarray]]) -> dict:
        cfg, qcfg = self.cfg, self.qcfg
        dense = _dense_cfg(cfg)
        params = quantize_embedding(qcfg, params)
        embed_cfg = dataclasses.replace(dense, embedding=qcfg.embedding, quant_group=qcfg.quant_group,
                                        int8_group=qcfg.int8_group)
        feed = [_embed_fn(embed_cfg)(params, b) for b in batches]
        keep = AWQ_SAMPLE_ROWS if self.method == "awq" else 0
        layers = []
        block_dense, block_quant = _block_fn(dense), _block_fn(dataclasses.replace(qcfg, remat="none"))
        for layer in range(cfg.n_layers):
            start = time.perf_counter()
            lp = jax.tree.map(lambda a: a[layer], params["layers"])
            stats = _Stats(keep)
            for x, ctx in feed:
                stats.add(block_dense(lp, x, ctx)[1])
            qlp = self.layer(lp, stats)
            feed = [(block_quant(qlp, x, ctx)[0], ctx) for x, ctx in feed]
            layers.append(qlp)
            errors = ", ".join(f"{p.split('/')[-1]} {v[-1]:.2e}" for p, v in self.report.items() if "alpha" not in p)
            self.log(f"layer {layer + 1}/{cfg.n_layers} ({self.method}, {time.perf_counter() - start:.1f}s): "
                     f"relative output error {errors}")
        params = {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
        head = self.specs.get("lm_head")
        if head is not None and self.impl("lm_head") in QUANT_IMPLS:
            stats = _Stats(keep)
            for x, _ in feed:
                stats.add({"lm_head": _norm_fn(dense)(params["final_norm"], x).reshape(-1, cfg.d_model).astype(jnp.float32)})
            s = None
            if self.method == "awq":
                w = params["lm_head"]["kernel"]
                s, alpha, _, _ = awq.search_scale(stats.rows_of("lm_head"), stats.mean_abs("lm_head"), [w],
                                                  self.impl("lm_head"),
                                                  qcfg.quant_group_of(self.impl("lm_head"), cfg.d_model))
                params = _fold(params, lambda path: tuple(path.split("/")), ("lm_head",), ("norm", "final_norm"),
                               s, self.specs)
                self.report.setdefault("lm_head alpha", []).append(alpha)
            params = {**params, "lm_head": self.quantize_linear(head, params["lm_head"], stats, s)}
            self.log(f"lm_head ({self.method}): relative output error {self.report['lm_head'][-1]:.2e}")
        return params


# ---- the entry point


def quantize_model(cfg: ModelConfig, params: Any, qcfg: ModelConfig, method: str,
                   batches: list[dict[str, np.ndarray]] | None = None, *, damp: float = 0.01,
                   act_order: bool = False, log: Callable[[str], None] = print) -> tuple[Any, dict[str, Any]]:
    """(quantized params for ``qcfg``, a report: per-Linear relative output error on the
    calibration data, mean over layers, and AWQ's chosen alphas). ``params`` are ``cfg``'s (dense)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    params = jax.device_get(params)
    if method == "rtn":
        out = quantize_embedding(qcfg, params)
        for spec in linear_specs(cfg):
            impl = qcfg.linear_impl(spec.path)
            if impl in QUANT_IMPLS:
                group = qcfg.quant_group_of(impl, spec.n_in)
                out = _with(out, spec.where, _rtn_linear(spec, impl, group, _get(out, spec.where)))
        report: dict[str, Any] = {}
    else:
        if not batches:
            raise ValueError(f"{method} needs calibration batches")
        run = _Calibrated(cfg, qcfg, method, damp, act_order, log)
        out = run.run(params, batches)
        report = {path: float(np.mean(v)) for path, v in run.report.items()}
    _check_tree(qcfg, out)
    return out, report


def _check_tree(qcfg: ModelConfig, params: Any) -> None:
    """The quantized tree must be exactly what the model builds for ``qcfg`` (a guard on this module)."""
    want = jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), model.abstract_params(qcfg))
    have = jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), params)
    if jax.tree.structure(want) != jax.tree.structure(have) or jax.tree.leaves(want) != jax.tree.leaves(have):
        raise RuntimeError(f"quantized parameters do not match ModelConfig {qcfg.linear_rules}: "
                           f"{jax.tree.structure(have)} vs {jax.tree.structure(want)}")
