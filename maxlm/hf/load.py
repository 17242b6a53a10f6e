"""Open a trained model for use: ``load_model(PATH)`` for generation, evaluation, export and serving.

PATH is any of:

- a maxlm run directory (``config.gin`` + ``checkpoints/STEP``): the newest checkpoint whose
  manifest and hashes check out, or ``step``; only the parameters are read, never the optimizer
  state. A run directory made by ``maxlm.hf import`` (``config.gin`` + ``params/``, no checkpoint
  yet) gives its imported parameters;
- one checkpoint, ``RUN_DIR/checkpoints/STEP``;
- a Hugging Face directory (``config.json`` + ``*.safetensors``), e.g. one ``maxlm.hf export`` wrote.

The parameters are placed on an inference mesh: ``tensor`` devices on the mesh's ``tensor`` axis
(heads and MLP columns split across them, as in training; None picks the number,
``maxlm.infer.placement.auto_tensor``), every other axis of degree 1. Every
problem with PATH is a one-line ``LoadError`` naming the file at fault.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxlm import config as config_lib
from maxlm import model, storage
from maxlm.config import Config, ModelConfig
from maxlm.infer.placement import auto_tensor, inference_mesh, param_shardings


class LoadError(ValueError):
    """A model that cannot be opened; str(err) is the one line to print."""


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Any  # on ``mesh``, with the training shardings restricted to the inference mesh
    tokenizer: Any  # maxlm.data tokenizer interface (encode/decode/bos_id/eos_id/pad_id), or None
    mesh: jax.sharding.Mesh
    source: str  # what was read: a checkpoint folder, a params folder or a Hugging Face directory
    step: int | None = None  # the training step of a checkpoint
    run_config: Config | None = None  # the whole config of a run directory (None for HF dirs)
    hf_config: dict | None = None  # config.json of a Hugging Face directory
    config_file: str = ""  # where ``cfg`` was read: RUN_DIR/config.gin or HF_DIR/config.json


def _mesh(cfg: ModelConfig, tensor: int | None, source: str) -> jax.sharding.Mesh:
    """The inference mesh for ``cfg``: ``tensor`` devices, or with None as many as ``auto_tensor``
    picks."""
    t = auto_tensor(cfg) if tensor is None else tensor
    try:
        mesh = inference_mesh(t)  # checks the device count first
    except ValueError as err:
        raise LoadError(str(err)) from None
    for field, value in (("n_heads", cfg.n_heads), ("kv_heads", cfg.kv_heads), ("d_ff", cfg.d_ff)):
        if value % t:
            raise LoadError(f"{source}: ModelConfig.{field} = {value} does not divide by --tensor = {t}")
    return mesh


def _run_config(run_dir: Path) -> Config:
    gin_path = run_dir / "config.gin"
    try:  # the mesh it trained on need not fit this machine: inference builds its own
        return config_lib.load(str(gin_path))  # a bucket's through the local cache (config.resolve_path)
    except config_lib.ConfigError as err:
        raise LoadError(f"{gin_path}: {str(err).removeprefix(gin_path.name + ': ')}") from None


def _checkpoint_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir())


def _pick_step(run_dir: Path, step: int | None) -> Path | None:
    """The checkpoint folder to read: ``step``, else the newest good one; None when the run has
    no checkpoint at all."""
    from maxlm.train.checkpoint import checkpoint_problem

    ckpt_dir = run_dir / "checkpoints"
    steps = _checkpoint_steps(ckpt_dir)
    if step is not None:
        if step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise LoadError(f"{ckpt_dir}: no checkpoint of step {step} (have: {have})")
        problem = checkpoint_problem(ckpt_dir / str(step))
        if problem:
            raise LoadError(f"{ckpt_dir / str(step)}: checkpoint is {problem}")
        return ckpt_dir / str(step)
    problems = []
    for s in reversed(steps):
        problem = checkpoint_problem(ckpt_dir / str(s))
        if problem is None:
            return ckpt_dir / str(s)
        problems.append(f"{s}: {problem}")
    if problems:
        raise LoadError(f"{ckpt_dir}: no usable checkpoint ({'; '.join(problems[:3])})")
    return None


def _tokenizer(name: str, source: str) -> Any:
    from maxlm.data import get_tokenizer

    try:
        return get_tokenizer(name)
    except (OSError, ValueError) as err:
        raise LoadError(f"{source}: DataConfig.tokenizer = {name!r} cannot be loaded ({err})") from None


def _load_run(run_dir: Path, step_dir: Path | None, step: int | None, dtype: str | None,
              tensor: int | None) -> LoadedModel:
    from maxlm.train.checkpoint import restore_params, restore_state_params

    run_cfg = _run_config(run_dir)
    cfg = run_cfg.model if dtype is None else dataclasses.replace(run_cfg.model, dtype=dtype)
    cfg = dataclasses.replace(cfg, remat="none")  # nothing to recompute without a backward pass
    mesh = _mesh(cfg, tensor, str(run_dir / "config.gin"))
    if step_dir is None:
        step_dir = _pick_step(run_dir, step)
    abstract, shardings = model.abstract_params(cfg), param_shardings(cfg, mesh)
    try:
        if step_dir is not None:
            params = restore_state_params(step_dir, abstract, shardings)
            source, at = str(step_dir), int(step_dir.name)
        elif run_cfg.train.init_params:
            params = restore_params(run_cfg.train.init_params, abstract, shardings)
            source, at = run_cfg.train.init_params, None
        else:
            raise LoadError(f"{run_dir}: holds no checkpoint yet (no {run_dir / 'checkpoints'}/STEP) "
                            "and config.gin sets no TrainConfig.init_params")
    except LoadError:
        raise
    except Exception as err:  # noqa: BLE001 - Orbax/tensorstore raise many types for damaged files
        reason = " ".join(str(err).split())[:300]
        raise LoadError(f"{step_dir or run_cfg.train.init_params}: cannot read the parameters "
                        f"({type(err).__name__}: {reason})") from None
    return LoadedModel(cfg, params, _tokenizer(run_cfg.data.tokenizer, str(run_dir / "config.gin")),
                       mesh, source, at, run_cfg, config_file=str(run_dir / "config.gin"))


def _load_hf(hf_dir: Path, dtype: str | None, tensor: int | None) -> LoadedModel:
    from maxlm.hf import HFImportError, config_from_hf, params_from_hf, read_hf_config

    try:
        hf = read_hf_config(hf_dir)
        cfg = config_from_hf(hf, dtype=dtype or "float32", source=str(hf_dir / "config.json"))
        mesh = _mesh(cfg, tensor, str(hf_dir / "config.json"))
        params = params_from_hf(hf_dir, cfg)
    except HFImportError as err:
        raise LoadError(str(err)) from None
    params = jax.device_put(params, param_shardings(cfg, mesh))
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file():
        from maxlm.hf.tokenizer_files import load_tokenizer

        try:
            tokenizer = load_tokenizer(hf_dir)
        except (OSError, ValueError) as err:
            raise LoadError(f"{hf_dir / 'tokenizer.json'}: cannot be loaded "
                            f"({' '.join(str(err).split())[:300]})") from None
    return LoadedModel(cfg, params, tokenizer, mesh, str(hf_dir), None, None, hf,
                       config_file=str(hf_dir / "config.json"))


def load_model(path: str | Path, *, step: int | None = None, dtype: str | None = None,
               tensor: int | None = 1, adapter: str | Path | None = None) -> LoadedModel:
    """Open PATH (see the module docstring) on an inference mesh of ``tensor`` devices (None: as
    many as ``maxlm.infer.placement.auto_tensor`` picks for the model).

    ``dtype`` overrides the compute dtype (float32 | bfloat16 | float16); parameters keep theirs.
    ``adapter``, a PEFT LoRA directory (``maxlm.hf.peft``), is put on the model loaded."""
    loaded = _load_model(path, step, dtype, tensor)
    return loaded if adapter is None else _with_adapter(loaded, Path(adapter).expanduser())


def _with_adapter(loaded: LoadedModel, adapter: Path) -> LoadedModel:
    from maxlm.hf import peft
    from maxlm.model import lora

    if loaded.cfg.lora_rank:
        raise LoadError(f"{loaded.source}: already has LoRA adapters; --adapter {adapter} goes on a base model")
    if not (adapter / peft.CONFIG_FILE).is_file():
        raise LoadError(f"{adapter}: not a PEFT adapter directory (no {peft.CONFIG_FILE})")
    from maxlm.hf.hf_config import HFImportError

    try:
        cfg, found = peft.read_adapter(adapter, loaded.cfg)  # its errors name the file
        params = lora.with_adapters(cfg, loaded.params, found)
    except HFImportError as err:
        raise LoadError(" ".join(str(err).split())) from None
    except ValueError as err:
        raise LoadError(f"{adapter}: {err} (the base is {loaded.source})") from None
    params = jax.device_put(params, param_shardings(cfg, loaded.mesh))
    return dataclasses.replace(loaded, cfg=cfg, params=params, source=f"{loaded.source} + {adapter}")


def _load_model(path: str | Path, step: int | None, dtype: str | None, tensor: int | None) -> LoadedModel:
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise LoadError(f"dtype {dtype!r} is not one of float32, bfloat16, float16")
    path = storage.path(path)
    if not path.exists():
        raise LoadError(f"{path}: does not exist (expected a maxlm run directory, RUN_DIR/checkpoints/STEP "
                        "or a Hugging Face directory)")
    if (path / "config.gin").is_file():
        return _load_run(path, None, step, dtype, tensor)
    if path.name.isdigit() and path.parent.name == "checkpoints" and (path.parent.parent / "config.gin").is_file():
        if step is not None and step != int(path.name):
            raise LoadError(f"{path}: is the checkpoint of step {path.name}, but --step {step} was asked")
        from maxlm.train.checkpoint import checkpoint_problem

        problem = checkpoint_problem(path)
        if problem:
            raise LoadError(f"{path}: checkpoint is {problem}")
        return _load_run(path.parent.parent, path, None, dtype, tensor)
    if (path / "config.json").is_file():
        if step is not None:
            raise LoadError(f"{path}: --step applies to maxlm run directories, not Hugging Face directories")
        if storage.is_remote(path):  # safetensors and tokenizers read local files: the bucket cache
            return dataclasses.replace(_load_hf(Path(storage.local_input(str(path))), dtype, tensor), source=str(path))
        return _load_hf(path, dtype, tensor)
    raise LoadError(f"{path}: neither a maxlm run directory (config.gin), a checkpoint "
                    "(RUN_DIR/checkpoints/STEP) nor a Hugging Face directory (config.json)")


def to_numpy(params: Any) -> Any:
    """The parameter tree gathered to host numpy arrays (for export)."""
    return jax.tree.map(np.asarray, params)
