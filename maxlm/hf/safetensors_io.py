"""Where imported tensors come from: a safetensors checkpoint directory, read lazily one tensor at
a time (sharded or not; pickle files are refused), or a dict of numpy arrays already in memory.

Both answer ``files`` (name -> where it is), ``get(name, shape, dtype)`` and ``close()``;
``listing`` names the source in error messages (the file, index or glob a tensor was looked for in).
``get`` refuses what would import silently wrong (``checked``): integer or boolean tensors, which are
not weights, and NaN or Inf, which mark a broken checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # registers bfloat16 & co. with numpy, so safetensors can return them
import numpy as np

from maxlm.hf.hf_config import HFImportError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def _is_float(dtype: np.dtype) -> bool:
    if dtype.kind != "V":  # numpy's own floats are kind 'f'; ml_dtypes' (bfloat16, float8_*) are 'V'
        return dtype.kind == "f"
    try:
        ml_dtypes.finfo(dtype)
        return True
    except ValueError:
        return False


def checked(value: np.ndarray, where: object, name: str, dtype: np.dtype) -> np.ndarray:
    """``value`` as ``dtype``, or a one-line HFImportError for an integer, boolean or complex tensor,
    or for NaN/Inf in it (before the cast) or made by the cast (a float64 beyond ``dtype``'s range)."""
    if not _is_float(value.dtype):
        raise HFImportError(f"{where}: tensor '{name}' has dtype {value.dtype}, expected a floating-point "
                            "weight (float32, float16, bfloat16, ...)")
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, in one line, not as a warning
        out = value.astype(dtype)
    if not np.isfinite(out).all():
        bad = out.size - np.count_nonzero(np.isfinite(value))
        what = f"{bad} of {out.size} values are NaN or Inf" if bad else f"values overflow {np.dtype(dtype)}"
        raise HFImportError(f"{where}: tensor '{name}': {what}; refusing to import a broken checkpoint")
    return out


class SafetensorsDir:
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
            # model.safetensors when there is one, as transformers reads it: other safetensors files
            # beside it (a reward model's head, say) are not the model's weights.
            single = hf_dir / "model.safetensors"
            shards = [single] if single.is_file() else sorted(hf_dir.glob("*.safetensors"))
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
            value = np.asarray(handle.get_tensor(name))
        except Exception as err:
            raise HFImportError(f"{path}: tensor '{name}' cannot be read "
                                f"({' '.join(str(err).split())})") from None
        return checked(value, path, name, dtype)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


class InMemory:
    """Name -> tensor over a dict of arrays (e.g. ``safetensors.numpy.load_file``'s result)."""

    listing = "Hugging Face tensors"

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors
        self.files = dict.fromkeys(tensors, self.listing)

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if name not in self.tensors:
            raise HFImportError(f"{self.listing}: tensor '{name}' is missing (expected shape {tuple(shape)})")
        value = np.asarray(self.tensors[name])
        if value.shape != tuple(shape):
            raise HFImportError(f"{self.listing}: tensor '{name}' has shape {value.shape}, "
                                f"expected {tuple(shape)} (from the config)")
        return checked(value, self.listing, name, dtype)

    def close(self) -> None:
        pass
