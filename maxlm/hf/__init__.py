"""Hugging Face checkpoints, both ways: one table per family drives import and export.
``python -m maxlm.hf``. Imports ``maxlm.model`` and ``maxlm.train.checkpoint``.

``hf_config`` maps config.json <-> ModelConfig, ``table`` holds the per-family rows (maxlm path,
HF name, HF shape, transform and its inverse), ``safetensors_io`` reads checkpoints lazily,
``convert`` runs the table both ways, ``cli`` is the command line.
"""

from maxlm.hf.cli import main
from maxlm.hf.convert import export_params, import_checkpoint, import_params, params_from_hf
from maxlm.hf.hf_config import (SUPPORTED, HFExportError, HFImportError, config_from_hf, config_to_hf,
                                read_hf_config)
from maxlm.hf.safetensors_io import INDEX_FILE

__all__ = ["INDEX_FILE", "SUPPORTED", "HFExportError", "HFImportError", "config_from_hf", "config_to_hf",
           "export_params", "import_checkpoint", "import_params", "main", "params_from_hf", "read_hf_config"]
