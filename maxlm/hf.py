"""Hugging Face checkpoints in: ``python -m maxlm.hf import HF_DIR --out RUN_DIR``.

Reads a Llama (``LlamaForCausalLM``) or GPT-2 (``GPT2LMHeadModel``) directory -- ``config.json``
plus ``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``) -- and writes
``RUN_DIR/params`` (``maxlm.checkpoint.save_params``) and ``RUN_DIR/config.gin``, so that
``python -m maxlm.train --config=RUN_DIR/config.gin`` continues training from the imported weights.
Pickle files (``pytorch_model.bin``) are never opened.

The mapping is a table (maxlm's parameter names follow Hugging Face's):

    HF Llama                          HF GPT-2                   maxlm (layers stacked on axis 0)
    model.embed_tokens [V, D]         wte [V, D]                 embed [padded_vocab, D] (rows >= V zero)
    -                                 wpe [P, D]                 pos_embed [max_seq_len, D]
    input_layernorm                   ln_1                       layers/attn_norm/{scale, bias}
    self_attn.{q,k,v}_proj [N*H, D]   attn.c_attn [D, 3*D]       layers/attn/{q,k,v}_proj/kernel [D, N|K, H]
    self_attn.o_proj [D, N*H]         attn.c_proj [D, D]         layers/attn/o_proj/kernel [N, H, D]
    post_attention_layernorm          ln_2                       layers/mlp_norm/{scale, bias}
    mlp.{gate,up}_proj [F, D]         mlp.c_fc [D, F]            layers/mlp/{gate,up}_proj/kernel [D, F]
    mlp.down_proj [D, F]              mlp.c_proj [F, D]          layers/mlp/down_proj/kernel [F, D]
    model.norm                        ln_f                       final_norm/{scale, bias}
    lm_head [V, D] (untied)           (tied to wte)              lm_head/kernel [D, padded_vocab]

Llama's ``nn.Linear`` weights are [out, in] and are transposed; GPT-2's ``Conv1D`` weights are
already [in, out]. Llama's q/k projections are in rotate-half order, which is maxlm's rope layout
too, so no permutation is needed. maxlm has one ``use_bias`` switch: a Llama with only one of
``attention_bias``/``mlp_bias`` gets zero biases where Hugging Face has none (the same function).

Every user mistake is one line on stderr and exit status 2, naming the file and tensor at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, so safetensors can return them)
import numpy as np

from maxlm.config import ConfigError, ModelConfig

SUPPORTED = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")
# Non-parameter buffers that some checkpoints carry; they hold nothing to import.
IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")


class HFImportError(ValueError):
    """A user-facing import failure; str(err) is the one line to print."""


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
    if float(rope.get("attention_factor") or 1.0) != 1.0:
        raise HFImportError(f"{source}: rope attention_factor = {rope['attention_factor']} is not "
                            "supported (maxlm's llama3 scaling has no attention factor)")
    return out


def config_from_hf(hf_config: dict[str, Any], *, dtype: str = "bfloat16",
                   source: str = "config.json") -> ModelConfig:
    """The maxlm ModelConfig of a Hugging Face Llama or GPT-2 config.json (as a dict).

    ``dtype`` is maxlm's compute dtype; parameters stay float32. The vocabulary keeps maxlm's
    padding (``vocab_multiple``): the import zero-fills rows past ``vocab_size``."""
    hf, src = hf_config, source
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise HFImportError(f"{src}: model_type {model_type!r} is not supported "
                            f"(maxlm imports {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())})")
    if model_type == "llama":
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
        if d % fields["n_heads"]:
            raise HFImportError(f"{src}: n_embd = {d} is not divisible by n_head = {fields['n_heads']}")
    return ModelConfig(**{**_defaults(ModelConfig), **fields, "dtype": dtype})


def _defaults(cls: type) -> dict[str, Any]:
    """Every field of a config dataclass at its declared default. Passing all fields explicitly
    keeps gin bindings left over from an earlier ``config.load`` (gin is global) out of the result."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------------------------
# safetensors -> parameter tree


class _Tensors:
    """Name -> tensor over one or more safetensors files, opened lazily (numpy, no torch)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open  # the library's numpy API; never pickle

        self._safe_open = safe_open
        index = hf_dir / INDEX_FILE
        self.files: dict[str, Path] = {}
        if index.is_file():
            self.listing = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (OSError, ValueError, KeyError, TypeError, AssertionError):
                raise HFImportError(f"{index}: not a safetensors index (expected a JSON object "
                                    "with a 'weight_map' of tensor -> file)") from None
            for name, file in weight_map.items():
                path = hf_dir / file
                if not path.is_file():
                    raise HFImportError(f"{index}: shard '{file}' (holding '{name}') is missing")
                self.files[name] = path
        else:
            shards = sorted(hf_dir.glob("*.safetensors"))
            if not shards:
                pickles = [p.name for p in sorted(hf_dir.iterdir()) if p.name in PICKLE_FILES
                           or p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
                if pickles:
                    raise HFImportError(
                        f"{hf_dir}: only pickle weights ({', '.join(pickles)}); maxlm never loads pickle: "
                        "re-save them as safetensors with model.save_pretrained(dir, safe_serialization=True)")
                raise HFImportError(f"{hf_dir}: no *.safetensors weights found")
            self.listing = shards[0] if len(shards) == 1 else hf_dir / "*.safetensors"
            for path in shards:
                for name in self._open(path).keys():
                    self.files.setdefault(name, path)
        self._handles: dict[Path, Any] = {}

    def _open(self, path: Path) -> Any:
        try:
            return self._safe_open(str(path), framework="np")
        except Exception as err:  # safetensors raises its own SafetensorError and OSError
            raise HFImportError(f"{path}: not a readable safetensors file "
                                f"({' '.join(str(err).split())})") from None

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if name not in self.files:
            raise HFImportError(f"{self.listing}: tensor '{name}' is missing "
                                f"(expected shape {tuple(shape)})")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        handle = self._handles[path]
        found = tuple(handle.get_slice(name).get_shape())
        if found != tuple(shape):
            raise HFImportError(f"{path}: tensor '{name}' has shape {found}, expected {tuple(shape)} "
                                "(from config.json)")
        try:
            return np.asarray(handle.get_tensor(name)).astype(dtype)
        except Exception as err:
            raise HFImportError(f"{path}: tensor '{name}' cannot be read "
                                f"({' '.join(str(err).split())})") from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


# One row of the table: maxlm path (within a layer, or top level), HF name (None: zeros),
# HF shape, and the function taking the HF array to maxlm's layout.
_Row = tuple[tuple[str, ...], "str | None", tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


def _llama_rows(m: ModelConfig, hf: dict) -> tuple[list[_Row], list[_Row], str]:
    d, n, k, h, f = m.d_model, m.n_heads, m.kv_heads, m.dim_per_head, m.d_ff
    attn_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))

    def linear(out_shape):  # nn.Linear [out, in] -> [in, *out]
        return lambda w: w.T.reshape(w.shape[1], *out_shape)

    layer: list[_Row] = [
        (("attn_norm", "scale"), "input_layernorm.weight", (d,), lambda w: w),
        (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", (n * h, d), linear((n, h))),
        (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", (k * h, d), linear((k, h))),
        (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", (k * h, d), linear((k, h))),
        (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (d, n * h), lambda w: w.T.reshape(n, h, d)),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), lambda w: w),
        (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", (f, d), linear((f,))),
        (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", (f, d), linear((f,))),
        (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", (d, f), linear((d,))),
    ]
    if m.use_bias:  # one switch in maxlm: biases Hugging Face lacks are zeros (None below)
        biases = [("attn", "q_proj", (n, h)), ("attn", "k_proj", (k, h)), ("attn", "v_proj", (k, h)),
                  ("attn", "o_proj", (d,)), ("mlp", "gate_proj", (f,)), ("mlp", "up_proj", (f,)),
                  ("mlp", "down_proj", (d,))]
        for block, name, shape in biases:
            present = attn_bias if block == "attn" else mlp_bias
            hf_name = f"{'self_attn' if block == 'attn' else 'mlp'}.{name}.bias" if present else None
            layer.append(((block, name, "bias"), hf_name, (math.prod(shape),),
                          lambda b, shape=shape: b.reshape(shape)))
    top: list[_Row] = [(("final_norm", "scale"), "norm.weight", (d,), lambda w: w)]
    return layer, top, "embed_tokens.weight"


def _gpt2_rows(m: ModelConfig, hf: dict) -> tuple[list[_Row], list[_Row], str]:
    d, n, h, f = m.d_model, m.n_heads, m.dim_per_head, m.d_ff

    def part(i, heads_shape):  # slice i of the fused q|k|v Conv1D output axis
        return lambda w: w[..., i * d:(i + 1) * d].reshape(*w.shape[:-1], *heads_shape)

    layer: list[_Row] = [(("attn_norm", "scale"), "ln_1.weight", (d,), lambda w: w),
                         (("attn_norm", "bias"), "ln_1.bias", (d,), lambda w: w)]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        layer += [(("attn", name, "kernel"), "attn.c_attn.weight", (d, 3 * d), part(i, (n, h))),
                  (("attn", name, "bias"), "attn.c_attn.bias", (3 * d,), part(i, (n, h)))]
    layer += [
        (("attn", "o_proj", "kernel"), "attn.c_proj.weight", (d, d), lambda w: w.reshape(n, h, d)),
        (("attn", "o_proj", "bias"), "attn.c_proj.bias", (d,), lambda w: w),
        (("mlp_norm", "scale"), "ln_2.weight", (d,), lambda w: w),
        (("mlp_norm", "bias"), "ln_2.bias", (d,), lambda w: w),
        (("mlp", "up_proj", "kernel"), "mlp.c_fc.weight", (d, f), lambda w: w),
        (("mlp", "up_proj", "bias"), "mlp.c_fc.bias", (f,), lambda w: w),
        (("mlp", "down_proj", "kernel"), "mlp.c_proj.weight", (f, d), lambda w: w),
        (("mlp", "down_proj", "bias"), "mlp.c_proj.bias", (d,), lambda w: w),
    ]
    top: list[_Row] = [(("pos_embed",), "wpe.weight", (m.max_seq_len, d), lambda w: w),
                       (("final_norm", "scale"), "ln_f.weight", (d,), lambda w: w),
                       (("final_norm", "bias"), "ln_f.bias", (d,), lambda w: w)]
    return layer, top, "wte.weight"


def _set(tree: dict, path: tuple[str, ...], value: np.ndarray) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _prefix(tensors: _Tensors, candidates: tuple[str, ...], probe: str) -> str:
    for prefix in candidates:
        if prefix + probe in tensors.files:
            return prefix
    return candidates[0]  # the lookup below then names the tensor as missing


def params_from_hf(hf_dir: str | Path, model_cfg: ModelConfig,
                   dtype: Any = np.float32) -> dict[str, Any]:
    """maxlm's parameter tree (numpy, ``dtype``) from a Hugging Face checkpoint directory.

    ``model_cfg`` is ``config_from_hf`` of the same directory (its compute dtype does not matter)."""
    hf_dir = Path(hf_dir).expanduser()
    hf = read_hf_config(hf_dir)
    config_path = hf_dir / "config.json"
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise HFImportError(f"{config_path}: model_type {model_type!r} is not supported "
                            f"(maxlm imports {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())})")
    m, dtype = model_cfg, np.dtype(dtype)
    tensors = _Tensors(hf_dir)
    try:
        if model_type == "llama":
            layer_rows, top_rows, embed_name = _llama_rows(m, hf)
            prefix = _prefix(tensors, ("model.", ""), embed_name)
            head_name = "lm_head.weight"
        else:
            layer_rows, top_rows, embed_name = _gpt2_rows(m, hf)
            prefix = _prefix(tensors, ("transformer.", ""), embed_name)
            head_name = None
        layer_prefix = prefix + ("h." if model_type == "gpt2" else "layers.")
        used: set[str] = set()

        def load(name: str | None, shape: tuple[int, ...], fn: Callable, zeros_like: Callable) -> np.ndarray:
            if name is None:
                return zeros_like()
            used.add(name)
            return np.ascontiguousarray(fn(tensors.get(name, shape, dtype)), dtype=dtype)

        params: dict[str, Any] = {}
        v, vp, d = m.vocab_size, m.padded_vocab, m.d_model
        embed = np.zeros((vp, d), dtype)
        embed[:v] = load(prefix + embed_name, (v, d), lambda w: w, None)
        params["embed"] = embed
        for path, name, shape, fn in top_rows:
            _set(params, path, load(prefix + name, shape, fn, None))
        for path, name, shape, fn in layer_rows:
            per_layer = []
            for i in range(m.n_layers):
                full = None if name is None else f"{layer_prefix}{i}.{name}"
                per_layer.append(load(full, shape, fn, lambda: fn(np.zeros(shape, dtype))))
            _set(params, ("layers", *path), np.stack(per_layer))
        if not m.tie_embeddings:
            head = np.zeros((d, vp), dtype)
            head[:, :v] = load(head_name, (v, d), lambda w: w.T, None)
            params["lm_head"] = {"kernel": head}
            if m.use_bias:
                params["lm_head"]["bias"] = np.zeros((vp,), dtype)
        unused = sorted(name for name in tensors.files if name not in used and not IGNORED.search(name)
                        and not (m.tie_embeddings and name == "lm_head.weight"))
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise HFImportError(f"{tensors.listing}: unexpected tensors {', '.join(unused[:3])}{more} "
                                f"(not part of a {SUPPORTED[model_type]} as described by {config_path})")
        return params
    finally:
        tensors.close()


def param_tree_count(params: dict[str, Any]) -> int:
    total = 0
    stack = [params]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        else:
            total += int(np.prod(node.shape))
    return total


# ---------------------------------------------------------------------------------------------
# the CLI


def _check_tree(params: dict[str, Any], model_cfg: ModelConfig) -> None:
    """The imported tree must be exactly the model's (paths, shapes): a guard against table bugs."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from maxlm.model import Transformer

    expected = nn.unbox(jax.eval_shape(lambda: Transformer(model_cfg).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))))["params"]
    want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
    got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise RuntimeError(f"imported parameter tree differs from maxlm's model: {diff}")


def import_checkpoint(hf_dir: str | Path, out: str | Path, dtype: str = "bfloat16") -> str:
    """Write RUN_DIR/params and RUN_DIR/config.gin from a HF checkpoint; returns the summary line."""
    from maxlm import config as config_lib

    hf_dir, run_dir = Path(hf_dir).expanduser(), Path(out).expanduser().resolve()
    params_dir, gin_path = run_dir / "params", run_dir / "config.gin"
    for existing in (params_dir, gin_path):
        if existing.exists():
            raise HFImportError(f"{existing}: already exists; maxlm.hf never overwrites (choose another --out)")
    hf = read_hf_config(hf_dir)
    model_cfg = config_from_hf(hf, dtype=dtype, source=str(hf_dir / "config.json"))
    try:
        sections = {name: _defaults(cls) for name, cls in config_lib.SECTIONS.items()}
        sections["model"] = dataclasses.asdict(model_cfg)
        sections["train"].update(init_params=str(params_dir), run_dir=str(run_dir),
                                 seq_len=min(2048, model_cfg.max_seq_len))
        cfg = config_lib.build(**sections)
    except ConfigError as err:
        raise HFImportError(f"{hf_dir / 'config.json'}: {err}") from None
    params = params_from_hf(hf_dir, model_cfg)
    _check_tree(params, model_cfg)

    from maxlm.checkpoint import save_params

    run_dir.mkdir(parents=True, exist_ok=True)
    save_params(params_dir, params)
    gin_text = config_lib.operative_gin(dataclasses.replace(cfg, source=f"maxlm.hf import {hf_dir}"))
    tmp = gin_path.with_suffix(".gin.tmp")
    tmp.write_text(gin_text)
    tmp.replace(gin_path)
    count = param_tree_count(params)
    return (f"imported {SUPPORTED[hf['model_type']]} ({hf['model_type']}) from {hf_dir}: "
            f"{count:,} parameters ({count / 1e6:.1f}M, vocab {model_cfg.vocab_size} padded to "
            f"{model_cfg.padded_vocab}) -> {params_dir} and {gin_path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maxlm.hf",
        description="Move weights between Hugging Face checkpoints and maxlm run directories.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    imp = sub.add_parser(
        "import", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="import a Hugging Face Llama or GPT-2 checkpoint into a maxlm run directory",
        description=(
            "Import a Hugging Face LlamaForCausalLM or GPT2LMHeadModel checkpoint directory\n"
            "(config.json + *.safetensors, sharded or not; pickle files are refused) into RUN_DIR:\n"
            "  RUN_DIR/params      the parameters (float32, maxlm's tree, Orbax format)\n"
            "  RUN_DIR/config.gin  the operative config; TrainConfig.init_params points at the params\n"
            "Nothing existing is overwritten. The embedding is padded to a multiple of 128 rows\n"
            "(zero-filled); logits past the real vocabulary are ignored by the loss."),
        epilog=("example:\n"
                "  python -m maxlm.hf import ~/hf/Llama-3.2-1B --out runs/llama1b\n"
                "  python -m maxlm.train --config=runs/llama1b/config.gin"))
    imp.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    imp.add_argument("--out", required=True, metavar="RUN_DIR",
                     help="maxlm run directory to create (must not already hold params or config.gin)")
    imp.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                     help="compute dtype written as ModelConfig.dtype (parameters stay float32; "
                          "default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        summary = import_checkpoint(args.hf_dir, args.out, args.dtype)
    except (HFImportError, ConfigError) as err:
        print(f"maxlm.hf: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
