"""Hugging Face checkpoints in: ``python -m maxlm.hf import HF_DIR --out RUN_DIR``.

Reads a Llama (``LlamaForCausalLM``) or GPT-2 (``GPT2LMHeadModel``) directory -- ``config.json``
plus ``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``) -- and writes
``RUN_DIR/params`` (``maxlm.train.checkpoint.save_params``) and ``RUN_DIR/config.gin``, so that
``python -m maxlm.train --config=RUN_DIR/config.gin`` continues training from the imported weights.
Pickle files (``pytorch_model.bin``) are never opened. The mapping is ``maxlm.hf.table``.

Every user mistake, in the arguments or in the checkpoint (a NaN or Inf, an integer or boolean
tensor, a wrong shape), is one line on stderr and exit status 2, naming the file and tensor at fault,
and leaves nothing behind. The outputs appear whole or not at all (``maxlm.hf.staging``).
"""

from __future__ import annotations

import argparse
import sys

from maxlm.config import ConfigError
from maxlm.hf.convert import import_checkpoint
from maxlm.hf.hf_config import HFImportError


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr (not the usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"maxlm.hf: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for key, value in vars(parsed).items():
            if isinstance(value, list):  # Python 3.11's argparse turns "--out=--" into []
                self.error(f"argument --{key}: '--' is not a value")
        return parsed


def _path(text: str) -> str:
    if not text.strip():  # "" would mean the current directory
        raise argparse.ArgumentTypeError("an empty path is not allowed")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a path (it holds a NUL byte)")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
            "Both appear only once complete. Nothing existing is overwritten, and RUN_DIR must not\n"
            "be, contain or lie inside HF_DIR. NaN/Inf weights and integer or boolean tensors are\n"
            "refused. The embedding is padded to a multiple of 128 rows (zero-filled); logits past\n"
            "the real vocabulary are ignored by the loss."),
        epilog=("example:\n"
                "  python -m maxlm.hf import ~/hf/Llama-3.2-1B --out runs/llama1b\n"
                "  python -m maxlm.train --config=runs/llama1b/config.gin"))
    imp.add_argument("hf_dir", metavar="HF_DIR", type=_path,
                     help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    imp.add_argument("--out", required=True, metavar="RUN_DIR", type=_path,
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
