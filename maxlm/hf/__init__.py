"""Weights in and out: Hugging Face checkpoints both ways (one table per family drives import and
export), and ``load`` opens any trained model (run directory, checkpoint or Hugging Face directory)
for generation, evaluation, export and serving. ``python -m maxlm.hf import|export``. Imports
``maxlm.model``, ``maxlm.infer.placement`` and ``maxlm.train.checkpoint``.

``hf_config`` maps config.json <-> ModelConfig, ``table`` holds the per-family rows (maxlm path,
HF name, HF shape, transform and its inverse), ``safetensors_io`` reads checkpoints lazily,
``convert`` runs the table both ways, ``export`` writes a directory transformers and vLLM load
(``export_model``), ``tokenizer_files`` writes maxlm tokenizers as Hugging Face tokenizer files and
reads them back (``write_tokenizer``, ``load_tokenizer``), ``staging`` makes every output appear
whole or not at all, ``cli`` is the command line.
"""

from maxlm.hf.cli import main
from maxlm.hf.convert import export_params, import_checkpoint, import_params, params_from_hf
from maxlm.hf.export import MANIFEST, export_model, infer_family, verify_manifest
from maxlm.hf.load import LoadedModel, LoadError, load_model
from maxlm.hf.hf_config import (SUPPORTED, HFExportError, HFImportError, config_from_hf, config_to_hf,
                                read_hf_config)
from maxlm.hf.safetensors_io import INDEX_FILE
from maxlm.hf.tokenizer_files import load_tokenizer, write_tokenizer

__all__ = ["INDEX_FILE", "MANIFEST", "SUPPORTED", "HFExportError", "HFImportError", "config_from_hf",
           "config_to_hf", "export_model", "export_params", "import_checkpoint", "import_params",
           "infer_family", "LoadedModel", "LoadError", "load_model", "load_tokenizer", "main", "params_from_hf", "read_hf_config", "verify_manifest",
           "write_tokenizer"]
