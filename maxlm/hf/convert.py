"""Hugging Face weights <-> maxlm parameter trees; both directions are driven by ``maxlm.hf.table``.

* ``import_params(tensors, model_cfg, hf_config_or_family)``: HF-named numpy arrays -> maxlm tree.
* ``export_params(params, model_cfg, hf_config_or_family)``: maxlm tree -> HF-named numpy arrays,
  named as ``save_pretrained`` names them (a tied head is not written).
* ``params_from_hf(hf_dir, model_cfg)``: the same import over a checkpoint directory, read lazily.
* ``import_checkpoint(hf_dir, out)``: a maxlm run directory (params + config.gin) from a checkpoint.

``export_params(import_params(x)) == x`` bit for bit, and ``import_params(export_params(p)) == p``
when ``p``'s vocabulary padding and the biases Hugging Face has no tensor for are zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from maxlm.config import ConfigError, ModelConfig
from maxlm.hf.hf_config import (SUPPORTED, HFExportError, HFImportError, _defaults, config_from_hf,
                                family_of, read_hf_config, resolve)
from maxlm.hf.safetensors_io import InMemory, SafetensorsDir
from maxlm.hf.staging import check_out, staged
from maxlm.storage import local_input
from maxlm.hf.table import IGNORED, Table, table


def _table(model_cfg: ModelConfig, family: str, hf: dict[str, Any], error: type[ValueError]) -> Table:
    try:
        return table(model_cfg, family, hf)
    except ValueError as err:  # the HF config and ModelConfig disagree
        raise error(str(err)) from None


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """Slash path -> leaf of a nested mapping (dict or FrozenDict)."""
    out = {}
    for key, node in tree.items():
        if isinstance(node, Mapping):
            out.update(_flatten(node, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = node
    return out


def _set(tree: dict, path: str, value: np.ndarray) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _tree_diff(leaves: dict[str, Any], model_cfg: ModelConfig) -> str:
    """How a flat tree differs from the model's (paths, shapes); empty when it does not."""
    from maxlm.model import abstract_params

    want = {path: tuple(x.shape) for path, x in _flatten(abstract_params(model_cfg)).items()}
    got = {path: tuple(np.shape(x)) for path, x in leaves.items()}
    problems = [f"'{p}' is missing" for p in sorted(set(want) - set(got))]
    problems += [f"'{p}' is unexpected" for p in sorted(set(got) - set(want))]
    problems += [f"'{p}' has shape {got[p]}, expected {want[p]}" for p in sorted(set(want) & set(got))
                 if got[p] != want[p]]
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def _import(source: InMemory | SafetensorsDir, model_cfg: ModelConfig, family: str, hf: dict[str, Any],
            dtype: Any, config_source: str) -> dict[str, Any]:
    tbl, dtype = _table(model_cfg, family, hf, HFImportError), np.dtype(dtype)
    # A checkpoint of the bare base model (LlamaModel, GPT2Model) names its tensors without the prefix.
    bare = bool(source.files) and not any(name.startswith(tbl.base) for name in source.files)
    used: set[str] = set()
    if model_cfg.n_layers > len(source.files):  # before listing a name per layer of an absurd count
        raise HFImportError(f"{source.listing}: {len(source.files)} tensors cannot hold the "
                            f"{model_cfg.n_layers} layers described by {config_source}")

    def read(name: str | None, shape: tuple[int, ...]) -> np.ndarray:
        if name is None:  # a bias HF lacks: zeros
            return np.zeros(shape, dtype)
        name = name.removeprefix(tbl.base) if bare else name
        used.add(name)
        return source.get(name, shape, dtype)

    params: dict[str, Any] = {}
    for row in tbl.rows:
        per_layer = [read(name, row.shape) for name in row.names(model_cfg.n_layers)]
        for path, leaf in zip(row.paths, row.to_maxlm(per_layer)):
            _set(params, path, np.ascontiguousarray(leaf, dtype=dtype))
    unused = sorted(name for name in source.files if name not in used and not IGNORED.search(name)
                    and name not in tbl.tolerated)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise HFImportError(f"{source.listing}: unexpected tensors {', '.join(unused[:3])}{more} "
                            f"(not part of a {SUPPORTED[family]} as described by {config_source})")
    return params


def import_params(tensors: Mapping[str, np.ndarray], model_cfg: ModelConfig,
                  hf_config_or_family: dict[str, Any] | str, dtype: Any = np.float32) -> dict[str, Any]:
    """maxlm's parameter tree (numpy, ``dtype``) from Hugging Face-named arrays.

    ``hf_config_or_family`` is the checkpoint's config.json (as a dict) or a family name ('llama',
    'gpt2'; then the HF config is ``config_to_hf(model_cfg, family)``). Vocabulary rows past
    ``vocab_size`` and biases Hugging Face lacks are zero-filled."""
    family, hf = resolve(model_cfg, hf_config_or_family, HFImportError)
    return _import(InMemory(tensors), model_cfg, family, hf, dtype, "the Hugging Face config")


def params_from_hf(hf_dir: str | Path, model_cfg: ModelConfig,
                   dtype: Any = np.float32) -> dict[str, Any]:
    """maxlm's parameter tree (numpy, ``dtype``) from a Hugging Face checkpoint directory.

    ``model_cfg`` is ``config_from_hf`` of the same directory (its compute dtype does not matter)."""
    hf_dir = Path(hf_dir).expanduser()
    hf = read_hf_config(hf_dir)
    config_path = hf_dir / "config.json"
    model_type = family_of(hf, str(config_path), HFImportError)
    resolve(model_cfg, hf, HFImportError)
    source = SafetensorsDir(hf_dir)
    try:
        return _import(source, model_cfg, model_type, hf, dtype, str(config_path))
    finally:
        source.close()


def export_params(params: Mapping[str, Any], model_cfg: ModelConfig,
                  hf_config_or_family: dict[str, Any] | str, dtype: Any = None) -> dict[str, np.ndarray]:
    """Hugging Face name -> numpy array for a maxlm parameter tree (numpy or jax arrays).

    ``hf_config_or_family`` as for ``import_params``. ``dtype`` None keeps each leaf's dtype.
    Vocabulary rows past ``vocab_size`` are dropped; a bias Hugging Face has no tensor for must be
    zero (HFExportError otherwise, as exporting it would change the model). Arrays that need no
    copy (e.g. one layer of a norm scale) are views into ``params``."""
    family, hf = resolve(model_cfg, hf_config_or_family, HFExportError)
    tbl = _table(model_cfg, family, hf, HFExportError)
    leaves = _flatten(params)
    diff = _tree_diff(leaves, model_cfg)
    if diff:
        raise HFExportError(f"params: not the tree of this ModelConfig ({diff})")
    out: dict[str, np.ndarray] = {}
    for row in tbl.rows:
        per_layer = row.to_hf(tuple(np.asarray(leaves.pop(path)) for path in row.paths))
        for i, (name, x) in enumerate(zip(row.names(model_cfg.n_layers), per_layer)):
            if name is None:
                if np.any(x):
                    where = f"{row.paths[0]}[{i}]" if row.layered else row.paths[0]
                    raise HFExportError(
                        f"params: '{where}' is nonzero, but a {SUPPORTED[family]} with attention_bias="
                        f"{bool(hf.get('attention_bias'))}, mlp_bias={bool(hf.get('mlp_bias'))} has no "
                        "tensor for it (exporting would change the model)")
                continue
            out[name] = np.ascontiguousarray(x if dtype is None else x.astype(dtype))
    if leaves:  # every leaf of the model's tree has a row: a guard against table bugs
        raise RuntimeError(f"maxlm.hf.table ({family}) has no row for {sorted(leaves)}")
    return out


# ---------------------------------------------------------------------------------------------
# a maxlm run directory from a checkpoint


def import_checkpoint(hf_dir: str | Path, out: str | Path, dtype: str = "bfloat16") -> str:
    """Write RUN_DIR/params and RUN_DIR/config.gin from a HF checkpoint; returns the summary line.

    Every check runs before anything is written, and the two outputs appear together, complete, or
    not at all (``maxlm.hf.staging``); config.gin names the final params path."""
    from maxlm import config as config_lib

    hf_dir = Path(local_input(str(hf_dir)))  # a bucket HF directory is read through the local cache
    run_dir = check_out(hf_dir, out)
    params_dir, gin_path = run_dir / "params", run_dir / "config.gin"
    hf = read_hf_config(hf_dir)
    model_cfg = config_from_hf(hf, dtype=dtype, source=str(hf_dir / "config.json"))
    try:
        sections = {name: _defaults(cls) for name, cls in config_lib.SECTIONS.items()}
        sections["model"] = dataclasses.asdict(model_cfg)
        train = sections["train"]  # a short context (a small test model) shortens the sample too
        train.update(init_params=str(params_dir), run_dir=str(run_dir),
                     seq_len=min(2048, model_cfg.max_seq_len),
                     sample_tokens=min(train["sample_tokens"], model_cfg.max_seq_len - 1))
        cfg = config_lib.build(**sections)
    except ConfigError as err:  # built from keyword dicts, so config names its source '<bindings>'
        raise HFImportError(f"{hf_dir / 'config.json'}: {str(err).removeprefix('<bindings>: ')}") from None
    params = params_from_hf(hf_dir, model_cfg)
    diff = _tree_diff(_flatten(params), model_cfg)
    if diff:  # a guard against table bugs
        raise RuntimeError(f"imported parameter tree differs from maxlm's model: {diff}")

    from maxlm.train.checkpoint import save_params

    gin_text = config_lib.operative_gin(dataclasses.replace(cfg, source=f"maxlm.hf import {hf_dir}"))
    with staged(run_dir) as stage:
        save_params(stage / "params", params)
        (stage / "config.gin").write_text(gin_text)
    count = sum(x.size for x in _flatten(params).values())
    return (f"imported {SUPPORTED[hf['model_type']]} ({hf['model_type']}) from {hf_dir}: "
            f"{count:,} parameters ({count / 1e6:.1f}M, vocab {model_cfg.vocab_size} padded to "
            f"{model_cfg.padded_vocab}) -> {params_dir} and {gin_path}")
