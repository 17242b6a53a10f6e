"""maxlm models out to Hugging Face: ``python -m maxlm.hf export PATH --out DIR``.

``export_model`` reads PATH with ``maxlm.hf.load.load_model`` (a run directory's newest verified
checkpoint or ``--step``, one ``RUN_DIR/checkpoints/STEP``, an imported run, or a Hugging Face
directory) and writes a directory that ``transformers`` and ``vllm serve`` load:

  config.json                  every field the architecture reads, explicitly (plus dtype, token ids)
  model.safetensors            metadata {"format": "pt"}; above ``max_shard_bytes`` instead
                               model-0000i-of-0000n.safetensors + model.safetensors.index.json
  generation_config.json       bos/eos/pad ids, greedy decoding (a Hugging Face source's own, copied)
  tokenizer.json, tokenizer_config.json, special_tokens_map.json   (``maxlm.hf.tokenizer_files``)
  maxlm_manifest.json          sha256 and size of every other file, the source and step

The weights go through ``maxlm.hf.table`` (the same rows as the import, so import -> export is
bit-exact); the vocabulary padding is cropped. ``--quant int4`` (or a model ``maxlm.quantize`` made
INT4) writes the Linears as compressed-tensors ``pack-quantized`` or GPTQ INT4 with config.json's
``quantization_config`` (``maxlm.hf.quant_export``, where the formats are described). Everything is written into a hidden sibling of DIR
that is renamed onto DIR last (``maxlm.hf.staging.staged_dir``): an interrupted export leaves no
directory that looks complete. Every user mistake is a one-line ``HFExportError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes  # registers bfloat16 with numpy, so safetensors can write it
import numpy as np
from safetensors.numpy import save_file

from maxlm.config import ModelConfig
from maxlm.data import chat
from maxlm.data.atomic import file_sha256
from maxlm.hf.convert import export_params
from maxlm.hf.hf_config import SUPPORTED, HFExportError, config_to_hf
from maxlm.hf.safetensors_io import INDEX_FILE
from maxlm.hf.staging import check_export_out, staged_dir

MANIFEST = "maxlm_manifest.json"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16"}
# Tokenizer files a Hugging Face source directory may hold; an export of it copies them unchanged.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def infer_family(cfg: ModelConfig) -> str:
    """'llama' for RMSNorm + SwiGLU + RoPE, 'gpt2' for LayerNorm + GELU + learned positions."""
    shape = (cfg.norm, cfg.activation, cfg.position)
    if shape == ("rms", "swiglu", "rope"):
        return "llama"
    if shape == ("layer", "gelu", "learned"):
        return "gpt2"
    raise HFExportError(f"ModelConfig norm={cfg.norm!r}, activation={cfg.activation!r}, position="
                        f"{cfg.position!r} fits neither llama (rms, swiglu, rope) nor gpt2 (layer, gelu, "
                        "learned); no Hugging Face architecture computes this model")


def _token_ids(loaded: Any) -> dict[str, Any]:
    """bos/eos/pad ids: a Hugging Face source keeps its config.json's, a maxlm run takes its
    tokenizer's (None without one)."""
    if loaded.hf_config is not None:
        return {n: loaded.hf_config.get(f"{n}_token_id") for n in ("bos", "eos", "pad")}
    return {n: getattr(loaded.tokenizer, f"{n}_id", None) for n in ("bos", "eos", "pad")}


def export_config(cfg: ModelConfig, family: str, dtype: str, ids: dict[str, Any]) -> dict[str, Any]:
    """config.json: ``config_to_hf`` plus the stored dtype (``dtype`` for transformers v5,
    ``torch_dtype`` for v4 and vLLM) and the special token ids."""
    hf = config_to_hf(cfg, family)
    return {**hf, "dtype": dtype, "torch_dtype": dtype, **{f"{n}_token_id": i for n, i in ids.items()}}


def generation_config(ids: dict[str, Any]) -> dict[str, Any]:
    # Greedy, as maxlm.generate defaults to; sampling settings are the caller's choice.
    return {**{f"{n}_token_id": i for n, i in ids.items()}, "do_sample": False}


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per file, in order, each file at most ``max_shard_bytes`` (a bigger tensor gets
    a file of its own), as ``save_pretrained`` splits them; ``sizes`` the stored bytes of each."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file. safetensors reports I/O failures (a full disk) as its own
    ``SafetensorError``; they become an OSError naming the file, which ``staged_dir`` turns
    into one line (and removes the stage)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        message = " ".join(str(err).split())
        code = re.search(r"code: (\d+)", message)  # e.g. IoError(Os { code: 28, kind: StorageFull, ... })
        errno = int(code.group(1)) if code else None
        strerror = os.strerror(errno) if errno else f"safetensors could not write it ({message})"
        raise OSError(errno, strerror, str(path)) from None


def write_weights(out: Path, tensors: dict[str, np.ndarray], dtype: np.dtype, max_shard_bytes: int,
                  mode: int = 0o644) -> list[str]:
    """The safetensors file(s) (+ index when sharded); casts one shard at a time to bound memory.
    Floating tensors are stored as ``dtype``; integer ones (packed INT4 words, shapes) as they are.
    safetensors creates its files owner-only; ``mode`` makes them as readable as the other files
    (a server often runs as another user)."""
    def stored(x: np.ndarray) -> np.dtype:
        return dtype if np.issubdtype(x.dtype, np.floating) or x.dtype == DTYPES["bfloat16"] else x.dtype

    groups = plan_shards({name: x.size * stored(x).itemsize for name, x in tensors.items()}, max_shard_bytes)
    names = shard_names(len(groups))
    weight_map, total = {}, 0
    for file, group in zip(names, groups):
        shard = {name: np.ascontiguousarray(tensors[name], dtype=stored(tensors[name])) for name in group}
        _write_shard(out / file, shard)
        os.chmod(out / file, mode)
        total += sum(x.nbytes for x in shard.values())
        weight_map.update(dict.fromkeys(group, file))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX_FILE)
    return names


def write_manifest(out: Path, info: dict[str, Any]) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    (out / MANIFEST).write_text(json.dumps({**info, "files": files}, indent=2) + "\n")


def verify_manifest(out: str | Path) -> str | None:
    """None when every file listed in DIR's manifest is there with its size and sha256, else what
    is wrong (one line). For checking an export after copying it around."""
    out = Path(out)
    try:
        files = json.loads((out / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{out / MANIFEST}: unreadable ({' '.join(str(err).split())})"
    for name, want in files.items():
        path = out / name
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != want["bytes"] or file_sha256(path) != want["sha256"]:
            return f"{path}: size or sha256 differs from {MANIFEST}"
    return None


def _load(path_or_loaded: Any, step: int | None) -> Any:
    from maxlm.hf.load import LoadedModel, LoadError, load_model

    if isinstance(path_or_loaded, LoadedModel):
        if step is not None and path_or_loaded.step != step:
            raise HFExportError(f"{path_or_loaded.source}: holds step {path_or_loaded.step}, not --step {step}")
        return path_or_loaded
    try:
        return load_model(path_or_loaded, step=step, dtype="float32")
    except LoadError as err:
        raise HFExportError(str(err)) from None


def _check_tokenizer(loaded: Any, cfg: ModelConfig) -> None:
    """Refuse, before anything is written, a tokenizer the export cannot write or the model cannot use."""
    from maxlm.data.tokenizer import BPETokenizer, ByteTokenizer

    tok = loaded.tokenizer
    if loaded.hf_config is not None or tok is None:
        return
    if not isinstance(tok, (ByteTokenizer, BPETokenizer)):
        raise HFExportError(f"{loaded.source}: a {type(tok).__name__} cannot be exported "
                            "(maxlm exports its byte and BPE tokenizers)")
    if tok.vocab_size > cfg.vocab_size:
        raise HFExportError(f"{loaded.source}: the tokenizer has {tok.vocab_size} tokens but "
                            f"ModelConfig.vocab_size = {cfg.vocab_size}; the model cannot embed them all")


def _source_dtype(loaded: Any) -> str:
    """The stored dtype an export defaults to: a Hugging Face source's own (config.json's
    ``dtype`` or ``torch_dtype``, so a round trip is bit-exact), float32 for a maxlm run."""
    hf_config = loaded.hf_config or {}
    for field in ("dtype", "torch_dtype"):
        value = hf_config.get(field)
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
            return value.removeprefix("torch.")
    return "float32"


def _write_generation_config(loaded: Any, stage: Path, ids: dict[str, Any]) -> None:
    """A Hugging Face source's generation_config.json unchanged (its sampling defaults are the
    model's); else bos/eos/pad ids and greedy decoding."""
    if loaded.hf_config is not None and (Path(loaded.source) / "generation_config.json").is_file():
        shutil.copyfile(Path(loaded.source) / "generation_config.json", stage / "generation_config.json")
        return
    (stage / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2) + "\n")


def _write_tokenizer(loaded: Any, stage: Path, cfg: ModelConfig) -> str:
    """The tokenizer files; returns what was written, for the summary line."""
    from maxlm.hf.tokenizer_files import write_tokenizer

    if loaded.hf_config is not None:  # a Hugging Face source: its own files, unchanged
        src = Path(loaded.source)
        copied = [name for name in HF_TOKENIZER_FILES if (src / name).is_file()]
        for name in copied:
            shutil.copyfile(src / name, stage / name)
        return f"tokenizer copied from {src}" if copied else "no tokenizer"
    if loaded.tokenizer is None:
        return "no tokenizer"
    # maxlm's one chat template (maxlm/data/chat_template.jinja), so transformers' apply_chat_template
    # and vLLM render prompts exactly as SFT trained them.
    write_tokenizer(loaded.tokenizer, stage, model_max_length=cfg.max_seq_len, chat_template=chat.template_text())
    return f"{loaded.tokenizer.name} tokenizer and chat template"


def _note(message: str) -> None:
    print(f"maxlm.hf: note: {message}", file=sys.stderr, flush=True)


LORA_MODES = ("merge", "base", "peft")


def _without_adapters(loaded: Any, mode: str, say: Callable[[str], None]) -> Any:
    """``loaded`` made plain when it has LoRA adapters (merged, or dropped for 'base'); a new
    LoadedModel, the caller's is left as it is."""
    from maxlm.model import lora

    cfg = loaded.cfg
    if not cfg.lora_rank:
        if mode != "merge":
            raise HFExportError(f"{loaded.source}: --lora {mode}: the model has no LoRA adapters "
                                "(ModelConfig.lora_rank = 0)")
        return loaded
    if mode == "base":
        say(f"writing the frozen base without its LoRA adapters ({', '.join(cfg.lora_paths())})")
        return dataclasses.replace(loaded, cfg=lora.base_config(cfg),
                                   params=lora.without_adapters(loaded.params))
    merged_cfg, merged = lora.merge(cfg, loaded.params)
    say(f"LoRA adapters (rank {cfg.lora_rank}) merged into {', '.join(cfg.lora_paths())}"
        + ("; merged INT4/INT8 Linears are written dense" if merged_cfg.linear_rules != cfg.linear_rules else ""))
    return dataclasses.replace(loaded, cfg=merged_cfg, params=merged)


def _export_adapter(loaded: Any, out_path: Path, base_model: str) -> str:
    """The adapters alone, in PEFT's format (``maxlm.hf.peft``), published like an export."""
    from maxlm.hf import peft
    from maxlm.hf.load import to_numpy

    if not loaded.cfg.lora_rank:
        raise HFExportError(f"{loaded.source}: --lora peft: the model has no LoRA adapters (ModelConfig.lora_rank = 0)")
    try:
        tensors = peft.adapter_tensors(loaded.cfg, to_numpy(loaded.params))
    except HFExportError as err:
        raise HFExportError(f"{loaded.source}: {err}") from None
    with staged_dir(out_path) as stage:
        from safetensors.numpy import save_file

        save_file(tensors, str(stage / peft.WEIGHTS_FILE), metadata={"format": "pt"})
        (stage / peft.CONFIG_FILE).write_text(json.dumps(peft.adapter_config(loaded.cfg, base_model), indent=2) + "\n")
        write_manifest(stage, {"format": "maxlm.hf export 1", "source": str(loaded.source), "step": loaded.step,
                               "lora": "peft", "base_model": base_model or None})
    count = sum(x.size for x in tensors.values())
    return (f"exported LoRA adapters (PEFT) from {loaded.source}: rank {loaded.cfg.lora_rank} on "
            f"{', '.join(loaded.cfg.lora_paths())}, {count:,} parameters -> {out_path}")


def export_model(path_or_loaded: Any, out: str | Path, *, dtype: str | None = None, step: int | None = None,
                 family: str | None = None, max_shard_bytes: int = 5 * 2**30, quant: str | None = None,
                 quant_format: str | None = None, quant_group: int | None = None, lora: str = "merge",
                 base_model: str = "", say: Callable[[str], None] = _note,
                 extra_files: Callable[[Any], dict[str, tuple[dict[str, np.ndarray], dict[str, str]]]] | None = None
                 ) -> str:
    """Export PATH (or a ``maxlm.hf.load.LoadedModel``) to the Hugging Face directory ``out``;
    returns the summary line. ``dtype`` is the stored dtype (float32/fp32, bfloat16/bf16 or
    float16/fp16; None: a Hugging Face source's own, float32 for a maxlm run);
    ``family`` ('llama' | 'gpt2') defaults to the one the ModelConfig fits. ``quant`` (None: the
    model as it is, 'int4', 'none'), ``quant_format`` ('compressed-tensors' | 'gptq') and
    ``quant_group`` choose the INT4 export (``maxlm.hf.quant_export``); ``say`` gets its notes.
    A model with LoRA adapters is written as ``lora`` says: 'merge' (W + (alpha / r) A B, a plain
    model), 'base' (the frozen base alone) or 'peft' (the adapters alone, in PEFT's format,
    ``maxlm.hf.peft``, naming ``base_model`` as their base). ``extra_files(loaded)`` names more
    safetensors files to write beside the weights ({file name: (tensors, metadata)}; a reward model's head).
    Checks everything it can before loading the weights, and refuses a non-empty ``out``."""
    from maxlm.hf import quant_export

    if dtype is not None and dtype not in DTYPE_ALIASES:
        raise HFExportError(f"--dtype {dtype!r} is not one of fp32, bf16, fp16 (float32, bfloat16, float16)")
    dtype = DTYPE_ALIASES.get(dtype)
    if family is not None and family not in SUPPORTED:
        raise HFExportError(f"--family {family!r} is not supported (maxlm exports "
                            f"{', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())})")
    if max_shard_bytes < 1:
        raise HFExportError(f"max_shard_bytes = {max_shard_bytes} must be positive")
    quant_export.check_options(quant, quant_format, quant_group)
    if lora not in LORA_MODES:
        raise HFExportError(f"--lora {lora!r} is not one of {', '.join(LORA_MODES)}")
    out_path = check_export_out(out)
    loaded = _load(path_or_loaded, step)
    if lora == "peft":
        return _export_adapter(loaded, out_path, base_model)
    loaded = _without_adapters(loaded, lora, say)
    cfg = loaded.cfg
    try:  # the model's own config is at fault: name where it came from
        family = family or infer_family(cfg)
        dtype = dtype or _source_dtype(loaded)
        ids = _token_ids(loaded)
        config = export_config(cfg, family, dtype, ids)
    except HFExportError as err:
        raise HFExportError(f"{loaded.config_file or loaded.source}: {err}") from None
    _check_tokenizer(loaded, cfg)
    from maxlm.hf.load import to_numpy

    params = to_numpy(loaded.params)
    qplan = quant_export.plan(cfg, params, family, quant, quant_format, quant_group, say)
    if qplan is not None:
        tensors, dense_linears = quant_export.quantized_tensors(qplan, family, DTYPES[dtype])
        config["quantization_config"] = quant_export.quantization_config(qplan, family, dense_linears)
    else:
        dense_cfg, params = quant_export.dense_model(cfg, params, say)
        tensors = export_params(params, dense_cfg, family)
    del params
    extra = extra_files(loaded) if extra_files is not None else {}
    check_export_out(out)  # again: the load may have taken minutes
    with staged_dir(out_path) as stage:
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mode = (stage / "config.json").stat().st_mode & 0o777  # the umask's choice for new files
        files = write_weights(stage, tensors, DTYPES[dtype], max_shard_bytes, mode)
        for name, (more, metadata) in extra.items():
            save_file(more, str(stage / name), metadata=metadata)
            os.chmod(stage / name, mode)
        _write_generation_config(loaded, stage, ids)
        tokenizer = _write_tokenizer(loaded, stage, cfg)
        quant_info = None if qplan is None else {"format": qplan.fmt, "bits": 4, "group_size": qplan.group,
                                                 "linears": list(qplan.int4)}
        write_manifest(stage, {"format": "maxlm.hf export 1", "source": str(loaded.source), "step": loaded.step,
                               "family": family, "architecture": SUPPORTED[family], "dtype": dtype,
                               "quantization": quant_info})
        size = sum((stage / f).stat().st_size for f in files if f.endswith(".safetensors"))
    weights = files[0] if len(files) == 1 else f"{len(files) - 1} shards + {INDEX_FILE}"
    at = f" (step {loaded.step})" if loaded.step is not None else ""
    if qplan is None:
        count = sum(x.size for x in tensors.values())
        what = f"{count:,} parameters ({count / 1e6:.1f}M, vocab {cfg.vocab_size}), {dtype}"
    else:
        count = sum(math.prod(s) for s in _hf_weight_shapes(tensors))
        what = (f"{count:,} parameters ({count / 1e6:.1f}M, vocab {cfg.vocab_size}), {len(qplan.int4)} Linear(s) per "
                f"layer int4 ({qplan.fmt}, group {qplan.group}), the rest {dtype}")
    return (f"exported {SUPPORTED[family]} ({family}) from {loaded.source}{at}: {what}, "
            f"{size / 2**20:.1f} MiB in {weights}, {tokenizer}, manifest {MANIFEST} -> {out_path}")


def _hf_weight_shapes(tensors: dict[str, np.ndarray]) -> list[tuple[int, ...]]:
    """The unquantized shape of every weight: dense tensors as they are, an INT4 Linear by its
    [out, in] (from the packed words: 8 inputs per int32), its scales and zeros not counted."""
    shapes = []
    for name, x in tensors.items():
        if name.endswith(".weight_packed"):
            shapes.append((x.shape[0], x.shape[1] * 8))
        elif name.endswith(".qweight"):
            shapes.append((x.shape[0] * 8, x.shape[1]))
        elif not name.endswith((".weight_scale", ".weight_shape", ".scales", ".qzeros", ".g_idx")):
            shapes.append(x.shape)
    return shapes
