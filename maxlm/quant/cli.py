"""``python -m maxlm.quantize``: quantize a trained run's weights (RTN, GPTQ or AWQ; INT4/INT8 under a
policy) into a new run directory that generation, evaluation and serving open like any other.

It prints the held-out perplexity of the original and the quantized model (the trainer's eval
batches) and the bytes of the weights before and after. Every user mistake (a missing run, bits
3, a group that does not divide a layer's inputs, an existing --out) is one line on stderr and
exit status 2; the output appears whole or not at all (built in a hidden sibling, renamed last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from maxlm.cli_args import OneLineParser, UserError, check_new_dir, number, run_command

EXAMPLES = """\
policies:
  all       attention and MLP Linears at --bits (the LM head and embedding stay unless --lm-head/--embedding)
  ffn-only  the MLP Linears at --bits
  layered   attention stays, MLP INT8 per channel, embedding INT4 in --group groups (INT8 when tied to
            the LM head); takes no --bits

examples:
  python -m maxlm.quantize --checkpoint runs/tiny --method gptq --bits 4 --group 64 --out runs/tiny-gptq4
  python -m maxlm.quantize --checkpoint runs/tiny --method awq --bits 4 --group 64 --policy ffn-only --out q/awq
  python -m maxlm.quantize --checkpoint runs/tiny --method rtn --bits 8 --out runs/tiny-int8
  python -m maxlm.quantize --checkpoint runs/tiny --method gptq --policy layered --group 64 --out q/layered
  python -m maxlm.generate --checkpoint runs/tiny-gptq4 --prompt 'def '

--out receives config.gin (the run's config with ModelConfig.linear_rules, quant_group, int8_group and
embedding set), checkpoints/STEP (the quantized parameters, verified like a training checkpoint),
the tokenizer file if the run names one, and quant_report.json (the settings, perplexities, bytes,
and per-Linear relative output error ||X(W - Q)||^2 / ||XW||^2 on the calibration data).
"""




def _parser() -> argparse.ArgumentParser:
    from maxlm.quant.apply import METHODS
    from maxlm.quant.policy import POLICIES

    p = OneLineParser(prog="python -m maxlm.quantize", description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CKPT_DIR",
                   help="a maxlm run directory (its newest good checkpoint, or --step) or RUN_DIR/checkpoints/STEP")
    p.add_argument("--method", required=True, choices=METHODS, help="rtn needs no data; gptq and awq calibrate "
                   "on the run's own training data")
    p.add_argument("--bits", type=number(int, lambda v: v in (4, 8), "is not a supported width (4 or 8)"),
                   help="4 (INT4, grouped) or 8 (INT8); required unless --policy layered")
    p.add_argument("--group", type=number(int, lambda v: v >= 1, "must be >= 1"),
                   help="inputs per scale: INT4 default 128 (a multiple of 8); INT8 default one scale per "
                        "output channel")
    p.add_argument("--policy", choices=POLICIES, default="all", help="which weights (default: %(default)s)")
    p.add_argument("--lm-head", action="store_true", help="also quantize the LM head (policy all/ffn-only)")
    p.add_argument("--embedding", choices=("dense", "int8", "int4"),
                   help="store the embedding table so (default: as the policy says)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize inputs by decreasing Hessian diagonal")
    p.add_argument("--damp", type=number(float, lambda v: 0 < v < 1, "must lie in (0, 1)"), default=0.01,
                   help="gptq: dampening as a fraction of the Hessian's mean diagonal (default: %(default)s)")
    p.add_argument("--calib-samples", type=number(int, lambda v: v >= 1, "must be >= 1"), default=128,
                   help="gptq/awq: calibration sequences from the run's training data, rounded up to whole "
                        "batches of TrainConfig.global_batch (default: %(default)s)")
    p.add_argument("--eval-batches", type=number(int, lambda v: v >= 1, "must be >= 1"),
                   help="held-out batches scored (default: the run's TrainConfig.eval_batches)")
    p.add_argument("--step", type=number(int, lambda v: v >= 0, "must be >= 0"),
                   help="checkpoint step of the run (default: the newest good one)")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory to create (must not exist)")
    return p


def say(msg: str) -> None:
    print(msg, flush=True)



def _check_options(args: argparse.Namespace) -> None:
    if args.policy == "layered" and args.bits is not None:
        raise UserError("--policy layered sets its own widths (attention unquantized, MLP int8, embedding int4); "
                        "drop --bits")
    if args.policy != "layered" and args.bits is None:
        raise UserError(f"--bits is required with --policy {args.policy} (4 or 8)")
    if args.method != "gptq" and args.act_order:
        raise UserError(f"--act-order applies to --method gptq, not {args.method}")
    if args.group is not None and (args.bits == 4 or args.policy == "layered") and args.group % 8:
        raise UserError(f"--group {args.group}: INT4 groups must be a multiple of 8 (8 values per int32)")


def _quantized_run_config(args, run_cfg) -> Any:
    """The run's config with the quantization rules, checked as any config is (one line if not)."""
    from maxlm import config as config_lib
    from maxlm.quant.policy import quantized_config

    qmodel = quantized_config(run_cfg.model, args.policy, args.bits, args.group, args.lm_head, args.embedding)
    cfg = dataclasses.replace(run_cfg, model=qmodel, source=f"maxlm.quantize {args.checkpoint}")
    try:
        config_lib.validate(cfg)
    except config_lib.ConfigError as err:
        detail = str(err).removeprefix(f"{cfg.source}: ")
        flag = f"--group {args.group}" if args.group else "the default group"
        raise UserError(f"{flag}: {detail}") from None
    return cfg



def _write(out: Path, cfg, params: Any, step: int, report: dict) -> None:
    """config.gin, checkpoints/STEP, the tokenizer file and quant_report.json, staged and renamed."""
    import jax

    from maxlm.config import CheckpointConfig, operative_gin
    from maxlm.train.checkpoint import Checkpointer

    stage = out.parent / f".{out.name}.quantize.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        tokenizer = Path(cfg.data.tokenizer).expanduser()
        if cfg.data.tokenizer != "byte" and tokenizer.is_file():  # travel with the weights
            shutil.copyfile(tokenizer, stage / tokenizer.name)
            cfg = cfg.replace(data={"tokenizer": str(out / tokenizer.name)})
        cfg = cfg.replace(train={"run_dir": str(out), "init_params": ""})
        ckpt = Checkpointer(stage, CheckpointConfig(async_save=False, max_to_keep=1), log=say)
        try:
            ckpt.save(step, {"params": jax.device_put(params)}, {}, cfg.to_dict(),
                      {"quantized_from": report["source"]})
        finally:
            ckpt.close()
        (stage / "config.gin").write_text(operative_gin(cfg))
        (stage / "quant_report.json").write_text(json.dumps(report, indent=1) + "\n")
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _bf16_rounded(x):
    import jax.numpy as jnp

    return x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x


def quantize(args: argparse.Namespace) -> int:
    _check_options(args)
    out = check_new_dir(args.out, "maxlm.quantize")
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from maxlm.config import QUANT_IMPLS
    from maxlm.hf.load import LoadError, load_model
    from maxlm.quant import apply, calibrate
    from maxlm.quant.gptq import GPTQError

    try:
        loaded = load_model(args.checkpoint, step=args.step)
    except LoadError as err:
        raise UserError(str(err)) from None
    if loaded.run_config is None:
        raise UserError(f"{args.checkpoint}: a Hugging Face directory; maxlm.quantize needs a maxlm run directory "
                        "(its config names the training data): import it first with `python -m maxlm.hf import`")
    m = loaded.cfg
    if m.linear_rules or m.linear in QUANT_IMPLS or m.embedding in QUANT_IMPLS:
        raise UserError(f"{loaded.config_file}: the model is already quantized (ModelConfig.linear_rules = "
                        f"{m.linear_rules!r}, embedding = {m.embedding!r}); quantize the original run")
    cfg = _quantized_run_config(args, loaded.run_config)
    qmodel = dataclasses.replace(cfg.model, dtype=m.dtype, remat="none")
    say(f"maxlm.quantize: {args.method} {qmodel.linear_rules} embedding {qmodel.embedding}, int4 group "
        f"{qmodel.quant_group}, int8 group {qmodel.int8_group or 'per channel'}; from {loaded.source}")
    calib, held = calibrate.run_batches(loaded.run_config, args, calibrate=args.method != "rtn")
    tokens = sum(int(b["weights"].sum()) for b in held)
    before = calibrate.perplexity(m, loaded.params, held)
    say(f"held-out perplexity, original: {before:.4f} ({tokens:,} tokens)")
    as_bf16 = None
    if any(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded.params)):
        # the baseline a bf16 deployment would ship: the same weights rounded to bfloat16
        as_bf16 = calibrate.perplexity(m, jax.tree.map(_bf16_rounded, loaded.params), held)
        say(f"held-out perplexity, original with weights rounded to bf16: {as_bf16:.4f}")
    if calib:
        say(f"calibration: {len(calib) * calib[0]['inputs'].shape[0]} sequences of {calib[0]['inputs'].shape[1]} "
            "tokens from the run's training data")
    try:
        qparams, errors = apply.quantize_model(m, loaded.params, qmodel, args.method, calib, damp=args.damp,
                                               act_order=args.act_order, log=say)
    except GPTQError as err:
        raise UserError(str(err)) from None
    after = calibrate.perplexity(qmodel, qparams, held)
    bytes_before, bytes_after = apply.weight_bytes(loaded.params), apply.weight_bytes(qparams)
    n_params = sum(x.size for x in jax.tree.leaves(loaded.params))
    change = after / before - 1
    say(f"held-out perplexity, quantized: {after:.4f} ({change:+.2%} vs original"
        + (f", {after / as_bf16 - 1:+.2%} vs bf16 weights)" if as_bf16 else ")"))
    say(f"weights: {bytes_before / 2**20:.2f} MiB ({m.param_dtype}; {2 * n_params / 2**20:.2f} MiB as bf16) -> "
        f"{bytes_after / 2**20:.2f} MiB ({bytes_before / bytes_after:.2f}x smaller, "
        f"{2 * n_params / bytes_after:.2f}x vs bf16)")
    report = {"source": loaded.source, "step": loaded.step, "method": args.method, "bits": args.bits,
              "policy": args.policy, "group": args.group, "act_order": args.act_order, "damp": args.damp,
              "linear_rules": [list(r) for r in qmodel.linear_rules], "embedding": qmodel.embedding,
              "quant_group": qmodel.quant_group, "int8_group": qmodel.int8_group,
              "calibration_sequences": len(calib) * (calib[0]["inputs"].shape[0] if calib else 0),
              "heldout_tokens": tokens,
              "perplexity": {"original": before, "original_bf16_weights": as_bf16, "quantized": after,
                             "change": change, "change_vs_bf16": after / as_bf16 - 1 if as_bf16 else None},
              "bytes": {"original": bytes_before, "original_as_bf16": 2 * n_params, "quantized": bytes_after},
              "relative_output_error": errors, "seconds": 0.0}
    report["seconds"] = round(time.perf_counter() - start, 1)
    _write(out, cfg, qparams, loaded.step or 0, report)
    say(f"wrote {out} (config.gin, checkpoints/{loaded.step or 0}, quant_report.json) in {report['seconds']}s; "
        f"try: python -m maxlm.generate --checkpoint {out} --prompt 'def '")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_command("maxlm.quantize", quantize, args)
