"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

``maxlm.hf export --lora peft`` saves a LoRA run's adapters alone (``adapter_tensors``,
``adapter_config``), so that ``PeftModel.from_pretrained(base, DIR)`` puts them on the exported
base (``maxlm.hf export --lora base``) and computes what maxlm's adapter model computes; ``read_adapter`` loads such a directory (written here or by PEFT) onto a
maxlm model. Llama family only: GPT-2 fuses q, k and v into one ``c_attn``, which has no
per-projection adapters.

The layouts, per layer ``i`` and Linear (``self_attn.q_proj`` ...; ``lm_head`` once):

    PEFT  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
          base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]
    maxlm layers/attn/q_proj/lora_a [L, *in, r], layers/attn/q_proj/lora_b [L, r, *out]

The in and out axes flatten row-major exactly as the base kernels do in ``maxlm.hf.table`` (Llama's
rotate-half q/k order is maxlm's), so a transpose and a reshape are the whole conversion; the
LM head's vocabulary padding is cropped on the way out and zero-filled on the way in. PEFT scales
by lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``, read as the equivalent alpha).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from maxlm.config import ModelConfig
from maxlm.hf.hf_config import HFExportError, HFImportError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# maxlm Linear path -> the module path inside a Llama decoder layer (lm_head sits outside the stack)
MODULES = {"attn/q_proj": "self_attn.q_proj", "attn/k_proj": "self_attn.k_proj", "attn/v_proj": "self_attn.v_proj",
           "attn/o_proj": "self_attn.o_proj", "mlp/gate_proj": "mlp.gate_proj", "mlp/up_proj": "mlp.up_proj",
           "mlp/down_proj": "mlp.down_proj", "lm_head": "lm_head"}
PREFIX = "base_model.model."


def _hf_module(path: str, layer: int | None) -> str:
    return PREFIX + ("lm_head" if path == "lm_head" else f"model.layers.{layer}.{MODULES[path]}")


def _check_family(cfg: ModelConfig, error: type[ValueError]) -> None:
    from maxlm.hf.export import infer_family

    try:
        family = infer_family(cfg)
    except HFExportError as err:
        raise error(str(err)) from None
    if family != "llama":
        raise error(f"PEFT adapters need the llama family (separate q/k/v projections); this model is {family}")


def adapter_config(cfg: ModelConfig, base_model: str = "") -> dict[str, Any]:
    """PEFT's LoraConfig of ``cfg``'s adapters, every field it reads explicit."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
            "target_modules": sorted({MODULES[p].split(".")[-1] for p in cfg.lora_paths()}),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}


def adapter_tensors(cfg: ModelConfig, params: Any) -> dict[str, np.ndarray]:
    """PEFT-named adapter tensors (fp32) of a LoRA model's parameters."""
    _check_family(cfg, HFExportError)
    out: dict[str, np.ndarray] = {}
    for path in cfg.lora_paths():
        node = params if path == "lm_head" else params["layers"]
        for key in path.split("/"):
            node = node[key]
        a, b = np.asarray(node["lora_a"], np.float32), np.asarray(node["lora_b"], np.float32)
        layered = path != "lm_head"
        for i, (a_i, b_i) in enumerate(zip(a, b) if layered else [(a, b)]):
            name = _hf_module(path, i if layered else None)
            b_hf = b_i.reshape(cfg.lora_rank, -1).T
            if path == "lm_head":
                b_hf = b_hf[:cfg.vocab_size]
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_i.reshape(-1, cfg.lora_rank).T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_hf)
    return out


def _targets(spec: Any, where: str) -> str:
    """PEFT's target_modules (a list of module names or one regex over module paths) -> lora_targets."""
    names = {v.split(".")[-1]: k for k, v in MODULES.items()}
    if isinstance(spec, str):
        paths = [p for p in MODULES if re.fullmatch(spec, _hf_module(p, 0).removeprefix(PREFIX))
                 or re.fullmatch(spec, MODULES[p].split(".")[-1])]
    elif isinstance(spec, list) and all(isinstance(x, str) for x in spec):
        unknown = [x for x in spec if x not in names]
        if unknown:
            raise HFImportError(f"{where}: target_modules {unknown} are not Llama Linears ({', '.join(names)})")
        paths = [names[x] for x in spec]
    else:
        raise HFImportError(f"{where}: target_modules = {spec!r} should be a list of module names or a regex")
    if not paths:
        raise HFImportError(f"{where}: target_modules = {spec!r} names no Llama Linear")
    return "^(" + "|".join(sorted(paths)) + ")$"


def read_config(directory: str | Path, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the lora_* fields of a PEFT adapter directory; HFImportError (one line) for
    what maxlm's adapters cannot express."""
    where = Path(directory) / CONFIG_FILE
    try:
        conf = json.loads(where.read_text())
    except (OSError, ValueError) as err:
        raise HFImportError(f"{where}: cannot read ({err})") from None
    if not isinstance(conf, dict) or conf.get("peft_type") != "LORA":
        raise HFImportError(f"{where}: peft_type = {conf.get('peft_type') if isinstance(conf, dict) else None!r}, "
                            "maxlm reads LORA adapters")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "layers_to_transform": None,
                   "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}
    for field, plain in unsupported.items():
        if conf.get(field, plain) not in (plain, None, [], {}, False):
            raise HFImportError(f"{where}: {field} = {conf[field]!r} is not supported (maxlm's adapters are "
                                f"plain LoRA: {field} = {plain!r})")
    r = conf.get("r")
    if not isinstance(r, int) or r < 1:
        raise HFImportError(f"{where}: r = {r!r} should be a positive integer")
    alpha = float(conf.get("lora_alpha", 8))
    if conf.get("use_rslora"):
        alpha *= math.sqrt(r)  # rsLoRA scales by alpha / sqrt(r) = (alpha sqrt(r)) / r
    new = dataclasses.replace(cfg, lora_rank=r, lora_alpha=alpha, lora_dropout=float(conf.get("lora_dropout") or 0.0),
                              lora_targets=_targets(conf.get("target_modules"), str(where)))
    _check_family(new, HFImportError)
    return new


def read_adapter(directory: str | Path, cfg: ModelConfig) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(cfg with the adapters' settings, maxlm slash path -> adapter array) of a PEFT directory, for
    ``maxlm.model.lora.with_adapters``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    cfg = read_config(directory, cfg)
    where = Path(directory) / WEIGHTS_FILE
    try:
        tensors = {k.replace(".default.", "."): v for k, v in load_file(str(where)).items()}
    except (OSError, SafetensorError) as err:
        raise HFImportError(f"{where}: cannot read ({' '.join(str(err).split())})") from None
    from maxlm.model import abstract_params
    from maxlm.model.lora import adapters

    want = adapters(abstract_params(cfg))
    out: dict[str, np.ndarray] = {}
    for path in cfg.lora_paths():
        module = path if path == "lm_head" else f"layers/{path}"
        layers = [None] if path == "lm_head" else range(cfg.n_layers)
        per: dict[str, list[np.ndarray]] = {"lora_a": [], "lora_b": []}
        for i in layers:
            name = _hf_module(path, i)
            try:
                a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            except KeyError as err:
                raise HFImportError(f"{where}: no tensor {err.args[0]} (the config targets {path})") from None
            a_shape, b_shape = want[f"{module}/lora_a"].shape, want[f"{module}/lora_b"].shape
            layer_a, layer_b = a_shape[1:] if i is not None else a_shape, b_shape[1:] if i is not None else b_shape
            b_t = np.asarray(b, np.float32).T
            if path == "lm_head" and b_t.shape[-1] == cfg.vocab_size:  # zero-fill the vocabulary padding
                b_t = np.pad(b_t, ((0, 0), (0, cfg.padded_vocab - cfg.vocab_size)))
            if a.size != math.prod(layer_a) or b_t.size != math.prod(layer_b):
                raise HFImportError(f"{where}: {name} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                                    f"the model's {path} with r = {cfg.lora_rank}")
            per["lora_a"].append(np.asarray(a, np.float32).T.reshape(layer_a))
            per["lora_b"].append(b_t.reshape(layer_b))
        for leaf, parts in per.items():
            out[f"{module}/{leaf}"] = np.stack(parts) if path != "lm_head" else parts[0]
    return cfg, out
