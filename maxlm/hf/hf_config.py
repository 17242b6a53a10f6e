"""Hugging Face ``config.json`` <-> maxlm ``ModelConfig``, for the families maxlm supports.

``config_from_hf`` reads either transformers layout (v4 ``rope_theta`` + ``rope_scaling``, v5
``rope_parameters``); ``config_to_hf`` writes the v4 layout, which transformers v5 and vLLM both
read. Every mismatch is a one-line ``HFImportError`` / ``HFExportError`` naming the file or field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from maxlm.config import ModelConfig

# family (Hugging Face model_type) -> the architecture maxlm reads and writes
SUPPORTED = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


class HFImportError(ValueError):
    """A user-facing import failure; str(err) is the one line to print."""


class HFExportError(ValueError):
    """A user-facing export failure (the maxlm model or tree does not fit the family); one line."""


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, with the directory's problems as one-line errors."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise HFImportError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint "
                            "directory with config.json and *.safetensors)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFImportError(f"{path}: not found (expected a Hugging Face checkpoint directory "
                            "with config.json and *.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFImportError(f"{path}: cannot be read as JSON ({' '.join(str(err).split())})") from None
    if not isinstance(cfg, dict):
        raise HFImportError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def family_of(hf: dict[str, Any], source: str, error: type[ValueError]) -> str:
    """The config's model_type, when maxlm supports it; else ``error`` naming ``source``."""
    family = hf.get("model_type")
    if not isinstance(family, str) or family not in SUPPORTED:  # a JSON list or object is unhashable
        raise error(f"{source}: model_type {family!r} is not supported "
                    f"(maxlm supports {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())})")
    return family


def _get(hf: dict, source: str, key: str, default: Any = ..., kind: type = int) -> Any:
    if key not in hf or hf[key] is None:
        if default is ...:
            raise HFImportError(f"{source}: required field '{key}' is missing")
        return default
    value = hf[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise HFImportError(f"{source}: field '{key}' = {value!r} should be {kind.__name__}")
    return kind(value)


def _rope_fields(hf: dict, source: str) -> dict[str, Any]:
    """rope_theta and Llama-3 scaling from either the v4 (rope_theta + rope_scaling) or the v5
    (rope_parameters) layout of config.json."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise HFImportError(f"{source}: rope_parameters/rope_scaling should be objects")
    if "rope_theta" in hf and hf["rope_theta"] is not None:
        theta = _get(hf, source, "rope_theta", kind=float)
    else:
        theta = _get(params, source, "rope_theta", 10000.0, float)
    rope = {**params, **scaling}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type in (None, "default"):
        return out
    if rope_type != "llama3":
        raise HFImportError(f"{source}: rope scaling type {rope_type!r} is not supported "
                            "(maxlm implements 'default' and 'llama3')")
    out.update(
        rope_scaling_factor=_get(rope, source, "factor", kind=float),
        rope_low_freq_factor=_get(rope, source, "low_freq_factor", kind=float),
        rope_high_freq_factor=_get(rope, source, "high_freq_factor", kind=float),
        rope_original_max_len=_get(rope, source, "original_max_position_embeddings"))
    if _get(rope, source, "attention_factor", 1.0, float) != 1.0:
        raise HFImportError(f"{source}: rope attention_factor = {rope['attention_factor']} is not "
                            "supported (maxlm's llama3 scaling has no attention factor)")
    return out


def config_from_hf(hf_config: dict[str, Any], *, dtype: str = "bfloat16",
                   source: str = "config.json") -> ModelConfig:
    """The maxlm ModelConfig of a Hugging Face Llama or GPT-2 config.json (as a dict).

    ``dtype`` is maxlm's compute dtype; parameters stay float32. The vocabulary keeps maxlm's
    padding (``vocab_multiple``): the import zero-fills rows past ``vocab_size``."""
    hf, src = hf_config, source
    if family_of(hf, src, HFImportError) == "llama":
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise HFImportError(f"{src}: hidden_act = {act!r} is not supported (Llama uses 'silu')")
        d, n = _get(hf, src, "hidden_size"), _get(hf, src, "num_attention_heads")
        fields = dict(
            vocab_size=_get(hf, src, "vocab_size"), d_model=d, n_layers=_get(hf, src, "num_hidden_layers"),
            n_heads=n, n_kv_heads=_get(hf, src, "num_key_value_heads", n),
            head_dim=_get(hf, src, "head_dim", 0), d_ff=_get(hf, src, "intermediate_size"),
            max_seq_len=_get(hf, src, "max_position_embeddings", 2048), norm="rms",
            norm_eps=_get(hf, src, "rms_norm_eps", 1e-6, float), activation="swiglu", position="rope",
            use_bias=_get(hf, src, "attention_bias", False, bool) or _get(hf, src, "mlp_bias", False, bool),
            tie_embeddings=_get(hf, src, "tie_word_embeddings", False, bool),
            init_std=_get(hf, src, "initializer_range", 0.02, float), **_rope_fields(hf, src))
    else:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFImportError(f"{src}: activation_function = {act!r} is not supported "
                                "(maxlm's gelu is the tanh approximation, 'gelu_new')")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            raise HFImportError(f"{src}: scale_attn_weights must be true and "
                                "scale_attn_by_inverse_layer_idx false (maxlm scales by 1/sqrt(head_dim))")
        if hf.get("add_cross_attention", False):
            raise HFImportError(f"{src}: add_cross_attention = true is not supported (decoder-only)")
        d = _get(hf, src, "n_embd")
        fields = dict(
            vocab_size=_get(hf, src, "vocab_size"), d_model=d, n_layers=_get(hf, src, "n_layer"),
            n_heads=_get(hf, src, "n_head"), d_ff=_get(hf, src, "n_inner", 4 * d),
            max_seq_len=_get(hf, src, "n_positions", _get(hf, src, "n_ctx", 1024)), norm="layer",
            norm_eps=_get(hf, src, "layer_norm_epsilon", 1e-5, float), activation="gelu",
            position="learned", use_bias=True, tie_embeddings=True,
            init_std=_get(hf, src, "initializer_range", 0.02, float))
        if fields["n_heads"] > 0 and d % fields["n_heads"]:  # n_head <= 0: config.validate names it
            raise HFImportError(f"{src}: n_embd = {d} is not divisible by n_head = {fields['n_heads']}")
    return ModelConfig(**{**_defaults(ModelConfig), **fields, "dtype": dtype})


def _defaults(cls: type) -> dict[str, Any]:
    """Every field of a config dataclass at its declared default. Passing all fields explicitly
    keeps gin bindings left over from an earlier ``config.load`` (gin is global) out of the result."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def _require(m: ModelConfig, family: str, **wanted: Any) -> None:
    for field, want in wanted.items():
        got = getattr(m, field)
        if got != want:
            raise HFExportError(f"ModelConfig.{field} = {got!r} does not fit {family} "
                                f"({SUPPORTED[family]} needs {want!r})")


def config_to_hf(model_cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The Hugging Face config (as a dict) of ``model_cfg`` in ``family`` ('llama' or 'gpt2');
    ``config_from_hf`` of the result gives back ``model_cfg`` up to maxlm-only fields (dtype,
    remat, vocab_multiple, ...). maxlm's single ``use_bias`` sets every HF bias flag. Every field the
    architecture reads is written explicitly (dropouts 0: maxlm trains without dropout), so no
    reader's defaults matter; a sliding window, which neither architecture has, is refused."""
    m = model_cfg
    if family not in SUPPORTED:
        raise HFExportError(f"family {family!r} is not supported "
                            f"(maxlm exports {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())})")
    if m.sliding_window:
        raise HFExportError(f"ModelConfig.sliding_window = {m.sliding_window} cannot be exported: "
                            f"{SUPPORTED[family]} always attends to the whole prefix, so the exported model "
                            "would compute different logits (export a model trained with sliding_window = 0)")
    common = dict(model_type=family, architectures=[SUPPORTED[family]], vocab_size=m.vocab_size,
                  initializer_range=m.init_std, tie_word_embeddings=m.tie_embeddings)
    if family == "llama":
        _require(m, family, norm="rms", activation="swiglu", position="rope")
        rope = None
        if m.rope_scaling_factor:
            rope = dict(rope_type="llama3", factor=m.rope_scaling_factor,
                        low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                        original_max_position_embeddings=m.rope_original_max_len)
        return dict(common, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
                    num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, head_dim=m.dim_per_head,
                    max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, hidden_act="silu",
                    rope_theta=m.rope_theta, rope_scaling=rope, attention_bias=m.use_bias,
                    mlp_bias=m.use_bias, attention_dropout=0.0, pretraining_tp=1, use_cache=True)
    # GPT-2 always has biases and a tied head, and one head count that splits d_model evenly.
    _require(m, family, norm="layer", activation="gelu", position="learned", use_bias=True,
             tie_embeddings=True)
    if m.kv_heads != m.n_heads or m.dim_per_head * m.n_heads != m.d_model:
        raise HFExportError(f"ModelConfig.n_kv_heads = {m.n_kv_heads}, head_dim = {m.head_dim} do not fit "
                            f"gpt2 ({SUPPORTED[family]} needs n_kv_heads = n_heads and "
                            "head_dim = d_model / n_heads)")
    return dict(common, n_embd=m.d_model, n_layer=m.n_layers, n_head=m.n_heads, n_inner=m.d_ff,
                n_positions=m.max_seq_len, n_ctx=m.max_seq_len, layer_norm_epsilon=m.norm_eps,
                activation_function="gelu_new", scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                reorder_and_upcast_attn=False, add_cross_attention=False, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, use_cache=True)


def resolve(model_cfg: ModelConfig, hf_config_or_family: dict[str, Any] | str,
            error: type[ValueError]) -> tuple[str, dict[str, Any]]:
    """(family, HF config dict) from either a config dict (its model_type) or a family name, after
    checking that ``model_cfg`` fits the family; mismatches raise ``error``."""
    try:
        if isinstance(hf_config_or_family, str):
            return hf_config_or_family, config_to_hf(model_cfg, hf_config_or_family)
        family = family_of(hf_config_or_family, "Hugging Face config", error)
        config_to_hf(model_cfg, family)
        return family, hf_config_or_family
    except HFExportError as err:
        if error is HFExportError:
            raise
        raise error(str(err)) from None
