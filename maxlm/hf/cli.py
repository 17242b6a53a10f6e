"""Hugging Face checkpoints in and out: ``python -m maxlm.hf import HF_DIR --out RUN_DIR`` and
``python -m maxlm.hf export PATH --out DIR``.

import reads a Llama (``LlamaForCausalLM``) or GPT-2 (``GPT2LMHeadModel``) directory -- ``config.json``
plus ``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``) -- and writes
``RUN_DIR/params`` (``maxlm.train.checkpoint.save_params``) and ``RUN_DIR/config.gin``, so that
``python -m maxlm.train --config=RUN_DIR/config.gin`` continues training from the imported weights.
Pickle files (``pytorch_model.bin``) are never opened. The mapping is ``maxlm.hf.table``.

export writes a run's checkpoint (or a Hugging Face directory) as a directory transformers and vLLM
load (``maxlm.hf.export``): config.json, safetensors weights, generation_config.json, the tokenizer
and a sha256 manifest.

Every user mistake, in the arguments or in the checkpoint (a NaN or Inf, an integer or boolean
tensor, a wrong shape, a missing checkpoint or step, an architecture Hugging Face cannot express, a
non-empty output directory), is one line on stderr and exit status 2, naming the file and field at
fault, and leaves nothing behind. The outputs appear whole or not at all (``maxlm.hf.staging``).
"""

from __future__ import annotations

import argparse
import sys

from maxlm.config import ConfigError
from maxlm.hf.convert import import_checkpoint
from maxlm.hf.hf_config import HFExportError, HFImportError


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
    exp = sub.add_parser(
        "export", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="export a maxlm checkpoint as a Hugging Face directory (transformers, vLLM)",
        description=(
            "Export PATH -- a maxlm run directory (its newest verified checkpoint, or --step N),\n"
            "one RUN_DIR/checkpoints/STEP, a run made by `maxlm.hf import`, or a Hugging Face\n"
            "directory -- as a Hugging Face directory that transformers' from_pretrained and\n"
            "`vllm serve` load. DIR must not exist or be empty; it receives:\n"
            "  config.json             LlamaForCausalLM or GPT2LMHeadModel, every field explicit\n"
            "  model.safetensors       the weights (vocabulary padding cropped), metadata format=pt;\n"
            "                          above --max-shard-gb: model-0000i-of-0000n.safetensors +\n"
            "                          model.safetensors.index.json\n"
            "  generation_config.json  bos/eos/pad ids, greedy decoding\n"
            "  tokenizer.json, tokenizer_config.json, special_tokens_map.json\n"
            "                          the run's tokenizer; Hugging Face tokenises a prompt exactly as\n"
            "                          maxlm does (bos first, no eos)\n"
            "  maxlm_manifest.json     sha256 and size of every file, the source and the step\n"
            "Everything is written into a hidden sibling of DIR, renamed onto DIR last: an\n"
            "interrupted export leaves no directory that looks complete. A model transformers\n"
            "cannot express (e.g. ModelConfig.sliding_window > 0) is refused.\n"
            "\n"
            "INT4 (llama family; maxlm.hf.quant_export describes the formats): a model made INT4\n"
            "by `python -m maxlm.quantize` (RTN, GPTQ or AWQ) is written INT4 as it is, losslessly;\n"
            "--quant int4 also quantizes every other Linear by round-to-nearest; the LM head stays\n"
            "dense. config.json gets a quantization_config; transformers loads the default format\n"
            "with the compressed-tensors package installed, and vLLM serves it (on CPU its kernel\n"
            "needs every Linear's inputs and outputs a multiple of 32: a note says when not)."),
        epilog=("example:\n"
                "  python -m maxlm.hf export runs/tiny --out exports/tiny --dtype bf16\n"
                "  python -m maxlm.hf export runs/tiny --out exports/tiny-w4 --quant int4 --quant-group 64\n"
                "  python -m maxlm.quantize --checkpoint runs/tiny --method gptq --bits 4 --group 64 --out runs/tiny-gptq\n"
                "  python -m maxlm.hf export runs/tiny-gptq --out exports/tiny-gptq --quant-format gptq\n"
                "  python -m maxlm.hf export runs/lora --out exports/lora-base --lora base\n"
                "  python -m maxlm.hf export runs/lora --out exports/lora-adapter --lora peft --base-model exports/lora-base\n"
                "  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('exports/tiny')\"\n"
                "  scripts/serve_vllm.sh exports/tiny --cpu"))
    exp.add_argument("path", metavar="PATH", type=_path,
                     help="maxlm run directory, RUN_DIR/checkpoints/STEP, or Hugging Face directory")
    exp.add_argument("--out", required=True, metavar="DIR", type=_path,
                     help="directory to create (must not exist, or be empty)")
    exp.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16", "float32", "bfloat16", "float16"),
                     help="dtype the weights are stored in (default: a Hugging Face source's own "
                          "dtype, so a round trip is bit-exact; fp32 for a maxlm run)")
    exp.add_argument("--step", type=_step, metavar="N",
                     help="checkpoint step of a run directory (default: the newest verified one)")
    exp.add_argument("--family", choices=("llama", "gpt2"),
                     help="Hugging Face family (default: the one the ModelConfig fits: llama for "
                          "rms+swiglu+rope, gpt2 for layer+gelu+learned)")
    exp.add_argument("--max-shard-gb", type=_positive_float, default=5.0, metavar="GB",
                     help="largest safetensors file before the weights are sharded, in GiB "
                          "(default: %(default)s)")
    exp.add_argument("--quant", choices=("int4", "none"), default=None,
                     help="int4: every Linear but the LM head INT4 (the model's own INT4 weights as they "
                          "are, the others by round-to-nearest); none: every weight dense (quantized ones "
                          "dequantized); default: the model as it is")
    exp.add_argument("--quant-format", choices=("compressed-tensors", "gptq"), default=None,
                     help="INT4 on disk: compressed-tensors pack-quantized (default; transformers and vLLM) "
                          "or GPTQ (qweight/qzeros/scales/g_idx; vLLM, or transformers with gptqmodel)")
    exp.add_argument("--quant-group", type=_group, default=None, metavar="N",
                     help="INT4 inputs per scale, a multiple of 8 dividing every Linear's inputs "
                          "(default: 128, or the INT4 model's own ModelConfig.quant_group)")
    exp.add_argument("--lora", choices=("merge", "base", "peft"), default="merge",
                     help="a model with LoRA adapters: merge them into the weights (default), write the "
                          "frozen base without them, or write the adapters alone in PEFT's format "
                          "(adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained "
                          "on the --lora base export)")
    exp.add_argument("--base-model", default="", metavar="NAME_OR_DIR",
                     help="with --lora peft: the base_model_name_or_path written into adapter_config.json")
    return parser


def _group(text: str) -> int:
    if not text.isdigit() or int(text) == 0 or int(text) % 8:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive multiple of 8 (8 INT4 values per int32)")
    return int(text)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a whole number >= 0)")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _reward_head(loaded) -> dict:
    """A reward model run's head, written beside its export (``maxlm.posttrain.reward.HEAD_FILE``)."""
    if loaded.run_config is None or loaded.run_config.train.task != "reward":
        return {}
    from maxlm.posttrain import reward

    return {reward.HEAD_FILE: reward.head_file(*reward.read_head(loaded.source, loaded.cfg, loaded.run_config))}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "import":
            summary = import_checkpoint(args.hf_dir, args.out, args.dtype)
        else:
            from maxlm.hf.export import export_model

            summary = export_model(args.path, args.out, dtype=args.dtype, step=args.step, family=args.family,
                                   max_shard_bytes=max(1, int(args.max_shard_gb * 2**30)), quant=args.quant,
                                   quant_format=args.quant_format, quant_group=args.quant_group,
                                   lora=args.lora, base_model=args.base_model, extra_files=_reward_head)
    except (HFImportError, HFExportError, ConfigError) as err:
        print(f"maxlm.hf: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(summary)
    return 0
