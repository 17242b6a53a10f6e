"""INT4 weights out to Hugging Face: ``python -m maxlm.hf export PATH --out DIR --quant int4``.

Which Linears are written as INT4 (``--quant``):

  (default)  the model as it is: Linears that ``maxlm.quantize`` made INT4 (``ModelConfig.linear_rules``;
             RTN, GPTQ or AWQ) are written from their packed ``qweight``/``scales`` unchanged, so the
             export is lossless; dense Linears stay dense (and are listed in the format's ignore)
  int4       every Linear except the LM head: the INT4 ones as stored, the others quantized by
             round-to-nearest (``maxlm.quant.rtn``, exactly as ``maxlm.quantize --method rtn``), in
             groups of ``--quant-group`` inputs (default 128, or the model's own ``quant_group``)
  none       every weight dense: quantized ones dequantized (exact in float32)

The LM head is always dense (``ignore: ["lm_head"]``): vLLM and transformers keep it unquantized.
INT8 Linears and a quantized embedding table are dequantized (a note says so; INT8 -> INT4 is a
second rounding). Symmetric INT4 in groups along the inputs, W4A16: the activations stay in the
stored dtype. Only the llama family is written INT4 (GPT-2's ``Conv1D`` is not an ``nn.Linear``,
which both formats quantize).

Formats (``--quant-format``); N outputs, K inputs, G the group, one HF ``nn.Linear`` [N, K] each:

  compressed-tensors (default) ``pack-quantized``, what llm-compressor writes for W4A16; loaded by
      transformers (with the ``compressed-tensors`` package) and vLLM (GPU: Marlin/Machete; CPU:
      its WNA16 kernel, which needs every input and output a multiple of 32 and an even group)
        NAME.weight_packed  int32 [N, K/8]  8 consecutive inputs per word, input 8w+j in bits 4j..4j+3
                                            as q + 8 (q in [-8, 7]): maxlm's ``qweight`` transposed
        NAME.weight_scale   dtype [N, K/G]  W[n, k] = q[n, k] * weight_scale[n, k // G]
        NAME.weight_shape   int64 [2]       (N, K)
      config.json quantization_config = {"quant_method": "compressed-tensors", "format":
      "pack-quantized", "quantization_status": "compressed", "config_groups": {"group_0":
      {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": true,
      "strategy": "group", "group_size": G, ...}}}, "ignore": ["lm_head", dense Linears ...]}
  gptq  AutoGPTQ's v1 checkpoint format (``checkpoint_format: gptq``, ``desc_act: false``, ``sym``);
      vLLM loads it (fp16/bf16 only); transformers needs the ``gptqmodel`` package for it
        NAME.qweight  int32 [K/8, N]  the same words as weight_packed, untransposed (= maxlm's qweight)
        NAME.scales   dtype [K/G, N]
        NAME.qzeros   int32 [K/G, N/8]  every nibble 7: the zero point 8, stored minus one (v1)
        NAME.g_idx    int32 [K]         k // G (no activation reordering)
      quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": true,
      "desc_act": false, "lm_head": false, "checkpoint_format": "gptq", ...}

The scales are stored in the export's dtype: float32 reproduces maxlm's INT4 model exactly; bf16
and fp16 round the scales (as every such checkpoint does). maxlm keeps a Linear's weight as
[*in, *out] (``maxlm.model.linear``); where HF's weight is that kernel reshaped and transposed
(``maxlm.hf.table``), the packed words and scales move the same way: ``packed_order`` runs the
table's own transform on an index kernel to find which maxlm output each HF row holds, and checks
that each HF row holds the inputs in order (so 8 consecutive inputs still share a word).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from maxlm.config import QUANT_IMPLS, ModelConfig
from maxlm.hf.hf_config import SUPPORTED, HFExportError
from maxlm.hf.table import Row, table

FORMATS = ("compressed-tensors", "gptq")
QUANT = ("none", "int4")
DEFAULT_GROUP = 128
PACK = 8  # 4-bit values per int32
GPTQ_ZEROS = int(np.uint32(0x77777777).view(np.int32))  # nibble 7 = zero point 8 minus one (GPTQ v1)
# vLLM fuses these HF Linears into one layer; it refuses a fused layer whose parts disagree.
FUSED = (("attn/q_proj", "attn/k_proj", "attn/v_proj"), ("mlp/gate_proj", "mlp/up_proj"))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The INT4 part of an export: ``cfg``/``params`` are the model as written (INT4 Linears
    packed, everything else dense), ``int4`` the Linear paths written INT4."""

    cfg: ModelConfig
    params: dict[str, Any]
    int4: tuple[str, ...]
    group: int
    fmt: str


def _linears(cfg: ModelConfig) -> list[Any]:
    from maxlm.quant.apply import linear_specs  # every Linear that owns a weight, with its shapes

    return linear_specs(cfg)


def _get(tree: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


def _copy(tree: Any) -> Any:
    """The nested dicts copied (leaves shared), so the plan never edits the caller's tree."""
    return {k: _copy(v) for k, v in tree.items()} if hasattr(tree, "items") else tree


def _dequantize(impl: str, qweight: np.ndarray, scales: np.ndarray, stacked: bool) -> np.ndarray:
    """Packed [L?, rows, *out] + scales [L?, K/G, *out] -> the dense [L?, K, N] weight (float32)."""
    import jax

    from maxlm.model.linear import dequantize

    lead = 1 if stacked else 0
    n = math.prod(qweight.shape[lead + 1:])

    def one(q, s):
        return dequantize(impl, q.reshape(q.shape[0], n), s.reshape(s.shape[0], n))
    fn = jax.jit(jax.vmap(one) if stacked else one)
    return np.asarray(fn(qweight, scales))


def _rtn(kernel: np.ndarray, spec: Any, group: int) -> dict[str, np.ndarray]:
    """RTN INT4 of a dense kernel [L?, *in, *out]: {"qweight", "scales"} as maxlm.quantize writes them."""
    import jax

    from maxlm.quant import rtn

    def one(w):
        q, scales = rtn.rtn(w.reshape(spec.n_in, -1), "int4", group)
        return rtn.pack("int4", q, scales, spec.out_shape)
    fn = jax.jit(jax.vmap(one) if spec.stacked else one)
    return {k: np.asarray(v) for k, v in fn(kernel).items()}


def _check_leaf(spec: Any, node: Any, impl: str, cfg: ModelConfig) -> None:
    from maxlm.model.linear import quant_shapes

    lead = (cfg.n_layers,) if spec.stacked else ()
    want = {k: lead + v for k, v in quant_shapes(cfg, impl, spec.n_in, spec.out_shape).items()}
    have = {k: tuple(np.shape(node[k])) for k in want if k in node}
    if have != want:
        raise HFExportError(f"params: '{'/'.join(spec.where)}' holds {have or sorted(node)}, but its "
                            f"ModelConfig ({impl}, group {cfg.quant_group_of(impl, spec.n_in)}) needs {want}")


def check_options(quant: str | None, fmt: str | None, group: int | None) -> None:
    """The INT4 options on their own (before anything is loaded)."""
    if quant is not None and quant not in QUANT:
        raise HFExportError(f"--quant {quant!r} is not one of {', '.join(QUANT)}")
    if fmt is not None and fmt not in FORMATS:
        raise HFExportError(f"--quant-format {fmt!r} is not one of {', '.join(FORMATS)}")
    if group is not None and (group <= 0 or group % PACK):
        raise HFExportError(f"--quant-group {group} must be a positive multiple of {PACK} (8 INT4 values per int32)")
    if quant == "none" and (fmt is not None or group is not None):
        raise HFExportError(f"{'--quant-format' if fmt is not None else '--quant-group'} applies to INT4 exports, "
                            "not to --quant none")


def plan(cfg: ModelConfig, params: Any, family: str, quant: str | None, fmt: str | None, group: int | None,
         say: Callable[[str], None]) -> Plan | None:
    """What an export writes INT4 (see the module docstring); None for an all-dense export, then
    ``dense_model`` gives the tree to write."""
    check_options(quant, fmt, group)
    specs = _linears(cfg)
    stored = {s.path: cfg.linear_impl(s.path) for s in specs}
    has_int4 = any(impl == "int4" for impl in stored.values())

    def target(path: str) -> str:
        if quant == "none" or path == "lm_head":
            return "dense"
        return "int4" if quant == "int4" or stored[path] == "int4" else "dense"
    targets = {s.path: target(s.path) for s in specs}
    if not any(t == "int4" for t in targets.values()):
        if fmt is not None or group is not None:
            option = "--quant-format" if fmt is not None else "--quant-group"
            raise HFExportError(f"{option} applies to INT4 exports (--quant int4, or a model with INT4 "
                                f"Linears without --quant none); this export writes every weight dense")
        return None
    if family != "llama":
        raise HFExportError(f"INT4 export writes the llama family only ({SUPPORTED[family]}'s Conv1D layers are "
                            "not nn.Linear, which compressed-tensors and GPTQ quantize); export with --quant none")
    kept = {p for p, t in targets.items() if t == "int4" and stored[p] == "int4"}
    if kept and group is not None and group != cfg.quant_group:
        raise HFExportError(f"--quant-group {group}: the model's INT4 Linears use ModelConfig.quant_group = "
                            f"{cfg.quant_group}, and regrouping them would quantize them again; omit --quant-group")
    group = group or (cfg.quant_group if has_int4 else DEFAULT_GROUP)
    for spec in specs:
        if targets[spec.path] == "int4" and spec.n_in % group:
            field = cfg.linear_inputs()[spec.path][0]
            raise HFExportError(f"--quant-group {group} does not divide the {spec.n_in} inputs of {spec.path} "
                                f"({field}); pass a --quant-group that does (a multiple of 8)")
    params = _copy(params)
    notes = []
    if cfg.embedding in QUANT_IMPLS:
        table_t = _dequantize(cfg.embedding, params.pop("embed_qweight"), params.pop("embed_scales"), False)
        params["embed"] = np.ascontiguousarray(table_t.T)
        notes.append(f"the {cfg.embedding} embedding table is written dequantized (Hugging Face embeddings are dense)")
    for spec in specs:
        node, impl, want = _get(params, spec.where), stored[spec.path], targets[spec.path]
        if impl in QUANT_IMPLS:
            _check_leaf(spec, node, impl, cfg)
        if impl == want:
            continue
        if impl in QUANT_IMPLS:  # to dense first
            dense = _dequantize(impl, node.pop("qweight"), node.pop("scales"), spec.stacked)
            lead = (cfg.n_layers,) if spec.stacked else ()
            node["kernel"] = dense.reshape(*lead, *spec.in_shape, *spec.out_shape)
            notes.append(f"{spec.path} ({impl}) is " + ("written dequantized" if want == "dense" else
                                                       f"dequantized and quantized again to int4 (RTN, group {group})"))
        if want == "int4":
            node.update(_rtn(node.pop("kernel"), spec, group))
    int4 = tuple(p for p, t in targets.items() if t == "int4")
    rtn_count = sum(1 for p in int4 if stored[p] == "dense")
    if rtn_count:
        say(f"quantized {rtn_count} Linear(s) to int4 by round-to-nearest, group {group} "
            "(for GPTQ or AWQ, run python -m maxlm.quantize first and export its output)")
    for note in notes:
        say(note)
    rules = ((f"^({'|'.join(re.escape(p) for p in int4)})$", "int4"),)
    out_cfg = dataclasses.replace(cfg, linear="dense", linear_rules=rules, embedding="dense", quant_group=group)
    result = Plan(out_cfg, params, int4, group, fmt or "compressed-tensors")
    _vllm_notes(result, specs, say)
    return result


def dense_model(cfg: ModelConfig, params: Any, say: Callable[[str], None]) -> tuple[ModelConfig, Any]:
    """(cfg, params) with every quantized weight dequantized, for an all-dense export."""
    specs = _linears(cfg)
    if cfg.embedding not in QUANT_IMPLS and all(cfg.linear_impl(s.path) not in QUANT_IMPLS for s in specs):
        return cfg, params
    params, quantized = _copy(params), []
    if cfg.embedding in QUANT_IMPLS:
        table_t = _dequantize(cfg.embedding, params.pop("embed_qweight"), params.pop("embed_scales"), False)
        params["embed"] = np.ascontiguousarray(table_t.T)
        quantized.append("embedding")
    for spec in specs:
        impl = cfg.linear_impl(spec.path)
        if impl in QUANT_IMPLS:
            node = _get(params, spec.where)
            _check_leaf(spec, node, impl, cfg)
            lead = (cfg.n_layers,) if spec.stacked else ()
            dense = _dequantize(impl, node.pop("qweight"), node.pop("scales"), spec.stacked)
            node["kernel"] = dense.reshape(*lead, *spec.in_shape, *spec.out_shape)
            quantized.append(spec.path)
    say(f"the quantized weights ({', '.join(quantized)}) are written dequantized (--quant none)")
    return dataclasses.replace(cfg, linear="dense", linear_rules=(), embedding="dense"), params


def _vllm_notes(p: Plan, specs: list[Any], say: Callable[[str], None]) -> None:
    """What keeps vLLM from serving the export: printed, the export goes ahead (transformers
    loads any shape)."""
    shapes = {s.path: (s.n_in, math.prod(s.out_shape)) for s in specs if s.path in p.int4}
    cpu = [f"{path} [{k} in, {n} out]" for path, (k, n) in shapes.items() if k % 32 or n % 32]
    if cpu or p.group % 2:
        why = ", ".join(cpu) if cpu else f"group {p.group} is odd"
        say(f"vLLM on CPU will refuse this export: its WNA16 kernel needs inputs and outputs that are multiples "
            f"of 32 and an even group ({why})")
    gpu = [f"{path} [{k} in, {n} out]" for path, (k, n) in shapes.items() if k % 128 or n % 64]
    if gpu or p.group not in (32, 64, 128):
        why = ", ".join(gpu) if gpu else f"group {p.group}"
        say(f"vLLM's GPU Marlin kernel needs inputs that are multiples of 128, outputs of 64 and group 32, 64 "
            f"or 128 ({why}); vLLM falls back to a slower kernel or refuses")
    every = {s.path for s in specs}
    for fused in FUSED:
        present = [path for path in fused if path in every]
        if len({path in p.int4 for path in present}) > 1:
            say(f"vLLM fuses {', '.join(present)} into one layer and refuses a fused layer that is only partly "
                f"quantized (int4: {', '.join(x for x in present if x in p.int4)}); transformers loads it")


# ---- the tensors


def packed_order(row: Row, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    """For HF's [N, K] weight of ``row``: which maxlm output (of the kernel flattened to [K, N]) each
    HF row holds, found by running the row's transform on an index kernel. Packing needs each HF row
    to hold the K inputs in order; a transform that reorders inputs cannot move packed words."""
    k, n = math.prod(in_shape), math.prod(out_shape)
    probe = np.arange(k * n, dtype=np.int64 if k * n >= 2**31 else np.int32).reshape(*in_shape, *out_shape)
    hf = np.asarray(row.transform.to_hf(probe))
    order = hf[:, 0] % n if hf.ndim == 2 else None
    if hf.shape != (n, k) or np.any(hf // n != np.arange(k)[None, :]) or np.any(hf % n != order[:, None]):
        raise HFExportError(f"{row.hf}: its transform does not keep the inputs of a row together "
                            f"(HF shape {hf.shape}), so packed INT4 words cannot be moved into it")
    return order


def _row_tensors(row: Row, node: dict, spec: Any, p: Plan, dtype: np.dtype, n_layers: int) -> dict[str, np.ndarray]:
    """The INT4 tensors of one Linear's row, every layer."""
    order = packed_order(row, spec.in_shape, spec.out_shape)
    n = math.prod(spec.out_shape)
    qweight = np.asarray(node["qweight"])
    scales = np.asarray(node["scales"])
    layers = list(zip(qweight, scales)) if spec.stacked else [(qweight, scales)]
    out = {}
    for name, (q, s) in zip(row.names(n_layers), layers):
        base = name.removesuffix(".weight")
        q = q.reshape(q.shape[0], n)[:, order]  # [K/8, N] in HF's output order
        s = s.reshape(s.shape[0], n)[:, order].astype(dtype)
        if p.fmt == "compressed-tensors":
            out[f"{base}.weight_packed"] = np.ascontiguousarray(q.T)
            out[f"{base}.weight_scale"] = np.ascontiguousarray(s.T)
            out[f"{base}.weight_shape"] = np.array([n, spec.n_in], np.int64)
        else:
            if n % PACK:
                raise HFExportError(f"--quant-format gptq packs 8 outputs per qzeros word, but {spec.path} "
                                    f"has {n} outputs; use --quant-format compressed-tensors")
            out[f"{base}.qweight"] = np.ascontiguousarray(q)
            out[f"{base}.qzeros"] = np.full((s.shape[0], n // PACK), GPTQ_ZEROS, np.int32)
            out[f"{base}.scales"] = np.ascontiguousarray(s)
            out[f"{base}.g_idx"] = (np.arange(spec.n_in) // p.group).astype(np.int32)
    return out


def quantized_tensors(p: Plan, family: str, dtype: np.dtype) -> tuple[dict[str, np.ndarray], list[str]]:
    """(HF name -> array, the HF Linears left dense): the table's rows over the planned tree, INT4
    Linears as the format's tensors, every other row as ``export_params`` writes it (floating
    tensors keep their dtype; the writer casts them). The rows run here rather than through
    ``export_params``, which would need a dense kernel for every Linear."""
    from maxlm.hf.convert import _flatten, _tree_diff

    leaves = _flatten(p.params)
    diff = _tree_diff(leaves, p.cfg)
    if diff:
        raise HFExportError(f"params: not the tree of this ModelConfig ({diff})")
    specs = {"/".join(s.where) + "/kernel": s for s in _linears(p.cfg) if s.path in p.int4}
    tbl = table(p.cfg, family, {"attention_bias": p.cfg.use_bias, "mlp_bias": p.cfg.use_bias})
    tensors, dense_linears = {}, []
    for row in tbl.rows:
        names = row.names(p.cfg.n_layers)
        if row.paths[0] in specs:
            if len(row.paths) > 1:
                raise HFExportError(f"{row.hf}: one HF tensor holds several maxlm Linears; not written INT4")
            spec = specs[row.paths[0]]
            node = _get(p.params, spec.where)
            tensors.update(_row_tensors(row, node, spec, p, dtype, p.cfg.n_layers))
            continue
        per_layer = row.to_hf(tuple(np.asarray(leaves[path]) for path in row.paths))
        for i, (name, x) in enumerate(zip(names, per_layer)):
            if name is None:  # a bias Hugging Face has no tensor for: must be zero (as export_params)
                if np.any(x):
                    raise HFExportError(f"params: '{row.paths[0]}[{i}]' is nonzero, but {SUPPORTED[family]} "
                                        "has no tensor for it (exporting would change the model)")
                continue
            tensors[name] = np.ascontiguousarray(x)
            if row.paths[0].endswith("/kernel"):
                dense_linears.append(name.removesuffix(".weight"))
    return tensors, dense_linears


def quantization_config(p: Plan, family: str, ignored: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for the plan's format; ``ignored`` the HF Linears
    left dense."""
    if p.fmt == "compressed-tensors":
        ignore = ["lm_head"] + [name for name in ignored if name != "lm_head"]
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": p.group,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": ignore, "kv_cache_scheme": None}
    rows = table(p.cfg, family, {"attention_bias": p.cfg.use_bias, "mlp_bias": p.cfg.use_bias}).rows
    paths = {"/".join(s.where) + "/kernel" for s in _linears(p.cfg) if s.path in p.int4}
    int4_names = [row.hf for row in rows if row.paths[0] in paths]  # per-layer templates: model.layers.{i}.NAME
    in_block = [name.split("{i}.", 1)[1].removesuffix(".weight") for name in int4_names]
    return {"quant_method": "gptq", "bits": 4, "group_size": p.group, "sym": True, "desc_act": False,
            "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "lm_head": False,
            "checkpoint_format": "gptq", "modules_in_block_to_quantize": [in_block]}
