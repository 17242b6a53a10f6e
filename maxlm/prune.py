"""Prune a trained model: ``python -m maxlm.prune --checkpoint RUN_DIR --heads FRACTION | --layers N
[--method importance|taylor|random] [--finetune STEPS] --out DIR``.

A thin command line over ``maxlm.quant.prune``: it scores every kv group (or layer) on the run's
own training data, slices the least important away, prints the held-out perplexity before and
after (and of a seeded random choice of the same size, the baseline the ranking must beat), the
parameter and FLOP reduction, and optionally fine-tunes the pruned model with the shared training
loop (``TrainConfig.init_from``, a warm start). DIR is a run directory that ``maxlm.generate``,
``maxlm.eval``, ``maxlm.hf export`` and ``maxlm.serve`` open like any other. Every user mistake is
one line on stderr and exit status 2; DIR appears whole or not at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from maxlm.cli_args import OneLineParser, UserError, check_new_dir, number, run_command

EXAMPLES = """\
examples:
  # a quarter of the heads of every layer (whole kv groups under GQA), ranked by calibration loss
  python -m maxlm.prune --checkpoint runs/tiny_mha --heads 0.25 --out runs/tiny_mha-h75

  # drop the least important layer, then fine-tune 200 steps on the run's own data
  python -m maxlm.prune --checkpoint runs/tiny --layers 1 --finetune 200 --out runs/tiny-l3

  python -m maxlm.generate --checkpoint runs/tiny-l3 --prompt 'def '

--heads F removes round(F * n_kv_heads) kv groups from every layer (a kv head with the query heads
that read it; with MHA one head), each layer losing its own least important ones, so the config
stays uniform (n_heads and n_kv_heads shrink). --layers N removes the N least important layers.
Importance is the calibration loss increase when the unit alone is masked; taylor is the first-order
estimate |sum(grad * weight)|; random is a seeded choice.

DIR receives config.gin (the run's config with the new n_heads, n_kv_heads, head_dim or n_layers),
checkpoints/STEP (the pruned parameters), the tokenizer file if the run names one, and
prune_report.json (scores, what was removed, perplexities, parameters, FLOPs). With --finetune,
DIR is the fine-tuning run (its checkpoints, metrics and config.gin with TrainConfig.init_from) and
the pruned model before fine-tuning is kept in DIR/pruned.
"""

PROG = "maxlm.prune"




def _parser() -> argparse.ArgumentParser:
    from maxlm.quant.prune import METHODS

    p = OneLineParser(prog="python -m maxlm.prune", description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CKPT_DIR",
                   help="a maxlm run directory (its newest good checkpoint, or --step) or RUN_DIR/checkpoints/STEP")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--heads", type=number(float, lambda v: 0 < v < 1, "must lie in (0, 1)"), metavar="FRACTION",
                      help="fraction of the attention heads to remove from every layer, in whole kv groups")
    what.add_argument("--layers", type=number(int, lambda v: v >= 1, "must be >= 1"), metavar="N",
                      help="number of whole layers to remove")
    p.add_argument("--method", choices=METHODS, default="importance",
                   help="how units are ranked (default: %(default)s)")
    p.add_argument("--seed", type=number(int, lambda v: 0 <= v < 2**32, "must lie in [0, 2**32)"), default=0,
                   help="seed of the random choice (--method random, and the baseline printed beside the "
                        "others; default: %(default)s)")
    p.add_argument("--calib-samples", type=number(int, lambda v: v >= 1, "must be >= 1"), default=128,
                   help="calibration sequences from the run's training data, rounded up to whole batches of "
                        "TrainConfig.global_batch (default: %(default)s)")
    p.add_argument("--eval-batches", type=number(int, lambda v: v >= 1, "must be >= 1"),
                   help="held-out batches scored (default: the run's TrainConfig.eval_batches)")
    p.add_argument("--finetune", type=number(int, lambda v: v >= 0, "must be >= 0"), default=0, metavar="STEPS",
                   help="fine-tune the pruned model this many steps on the run's data (default: 0, none)")
    p.add_argument("--finetune-lr", type=number(float, lambda v: 0 < v < math.inf, "must be > 0"),
                   help="peak learning rate of the fine-tuning (default: 0.1 x the run's "
                        "OptimConfig.learning_rate), cosine over STEPS after a short warmup")
    p.add_argument("--step", type=number(int, lambda v: v >= 0, "must be >= 0"),
                   help="checkpoint step of the run (default: the newest good one)")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory to create (must not exist)")
    return p


def say(msg: str) -> None:
    print(msg, flush=True)




def _prune(args, m, params, calib, method: str, log=None) -> tuple[Any, Any, dict]:
    """(pruned model config, pruned params, what was removed) for ``method``."""
    import numpy as np

    from maxlm.quant import prune

    if args.heads is not None:
        r = prune.groups_to_remove(m, args.heads)
        scores = prune.head_scores(m, params, calib, method, args.seed, log)
        removed = prune.lowest(scores, r)
        keep = prune.kept(m.kv_heads, removed)
        new_m, new_params = prune.prune_heads(m, params, keep)
        return new_m, new_params, {"scores": scores.tolist(), "removed_kv_groups": removed.tolist(),
                                   "kept_kv_groups": keep.tolist()}
    scores = prune.layer_scores(m, params, calib, method, args.seed, log)
    removed = prune.lowest(scores, args.layers)
    keep = prune.kept(m.n_layers, removed)[0]
    new_m, new_params = prune.prune_layers(m, params, keep)
    return new_m, new_params, {"scores": np.asarray(scores).tolist(), "removed_layers": removed.tolist(),
                               "kept_layers": keep.tolist()}


def _pruned_config(run_cfg, new_m, source: str):
    """The run's config with the pruned model's shape fields, checked as any config is."""
    from maxlm import config as config_lib

    fields = {f: getattr(new_m, f) for f in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}
    cfg = dataclasses.replace(run_cfg, model=dataclasses.replace(run_cfg.model, **fields), source=source)
    try:
        config_lib.validate(cfg)
    except config_lib.ConfigError as err:
        raise UserError(f"the pruned model's config is invalid: {str(err).removeprefix(source + ': ')}") from None
    return cfg


def _save_run(directory: Path, final: Path, cfg, params: Any, step: int, info: dict) -> Any:
    """A params-only run directory at ``directory`` (config.gin naming ``final`` as its run_dir,
    checkpoints/STEP, the tokenizer file); returns the config written."""
    import jax

    from maxlm.config import CheckpointConfig, operative_gin
    from maxlm.train.checkpoint import Checkpointer

    directory.mkdir()
    tokenizer = Path(cfg.data.tokenizer).expanduser()
    if cfg.data.tokenizer != "byte" and tokenizer.is_file():  # travels with the weights
        shutil.copyfile(tokenizer, directory / tokenizer.name)
        cfg = cfg.replace(data={"tokenizer": str(final / tokenizer.name)})
    cfg = cfg.replace(train={"run_dir": str(final), "init_params": "", "init_from": ""})
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False, max_to_keep=1), log=say)
    try:
        ckpt.save(step, {"params": jax.device_put(params)}, {}, cfg.to_dict(), info)
    finally:
        ckpt.close()
    (directory / "config.gin").write_text(operative_gin(cfg))
    return cfg


def _finetune(args, cfg, stage: Path, out: Path) -> dict:
    """Train the pruned model (stage/pruned) into ``stage`` with the shared loop; returns its summary."""
    import jax

    from maxlm import config as config_lib
    from maxlm.train import checkpoint, pretrain
    from maxlm.train.resilience import TrainingError

    steps, o, tc = args.finetune, cfg.optim, cfg.train
    lr = args.finetune_lr or 0.1 * o.learning_rate
    ft = cfg.replace(train={"steps": steps, "run_dir": str(stage), "init_from": str(stage / "pruned"),
                            "eval_every": steps, "log_every": min(tc.log_every, steps), "sample_tokens": 0,
                            "rollback_after": 0},
                     optim={"learning_rate": lr, "warmup_steps": min(o.warmup_steps, max(steps // 10, 1))},
                     checkpoint={"every_steps": 0, "every_minutes": 0.0, "keep_every_steps": 0})
    ft = dataclasses.replace(ft, source=f"{PROG} --finetune")
    try:
        config_lib.validate(ft, jax.device_count())
    except config_lib.ConfigError as err:
        raise UserError(f"--finetune: the pruned model cannot train here: "
                        f"{str(err).removeprefix(ft.source + ': ')}") from None
    say(f"fine-tuning {steps} steps at peak learning rate {lr:g} ({o.schedule}, warmup "
        f"{ft.optim.warmup_steps}) on the run's training data")
    try:
        summary = pretrain.train(ft)
    except (config_lib.ConfigError, checkpoint.CheckpointError, TrainingError) as err:
        raise UserError(f"--finetune: {err}") from None
    if summary["preempted"]:
        raise UserError(f"--finetune: interrupted by {summary['preempted']}; nothing written to {out}")
    final = ft.replace(train={"run_dir": str(out), "init_from": str(out / "pruned")})
    (stage / "config.gin").write_text(config_lib.operative_gin(dataclasses.replace(final, source=cfg.source)))
    return {"steps": steps, "learning_rate": lr, "warmup_steps": ft.optim.warmup_steps,
            "eval_losses": summary["eval_losses"]}


def _change(before: float, after: float) -> str:
    return f"{after:.4f} ({after / before - 1:+.2%})"


def run(args: argparse.Namespace) -> int:
    out = check_new_dir(args.out, PROG)
    start = time.perf_counter()

    import jax

    from maxlm import model
    from maxlm.hf.load import LoadError, load_model
    from maxlm.quant import calibrate, prune

    try:
        loaded = load_model(args.checkpoint, step=args.step)
    except LoadError as err:
        raise UserError(str(err)) from None
    if loaded.run_config is None:
        raise UserError(f"{args.checkpoint}: a Hugging Face directory; {PROG} needs a maxlm run directory "
                        "(its config names the training data): import it first with `python -m maxlm.hf import`")
    m, run_cfg = loaded.cfg, loaded.run_config
    try:
        prune.check_prunable(m)
        if args.heads is not None:
            r = prune.groups_to_remove(m, args.heads)
            g = m.n_heads // m.kv_heads
            unit = f"kv groups ({g} query heads each)" if g > 1 else "heads (MHA: a group is one head)"
            what = (f"{r} of {m.kv_heads} {unit} per layer = {r * g}/{m.n_heads} heads ({r / m.kv_heads:.0%})")
        else:
            prune.check_layers(m, args.layers)
            what = f"{args.layers} of {m.n_layers} layers"
    except prune.PruneError as err:
        raise UserError(str(err)) from None
    say(f"{PROG}: removing {what} by {args.method}; from {loaded.source}")
    calib, held = calibrate.run_batches(run_cfg, args, calibrate=args.method != "random")
    tokens = sum(int(b["weights"].sum()) for b in held)
    before = calibrate.perplexity(m, loaded.params, held)
    say(f"held-out perplexity, original: {before:.4f} ({tokens:,} tokens)")
    if calib:
        say(f"scoring on {len(calib) * calib[0]['inputs'].shape[0]} calibration sequences of "
            f"{calib[0]['inputs'].shape[1]} tokens from the run's training data ({args.method})")
    new_m, new_params, chosen = _prune(args, m, loaded.params, calib, args.method, say)
    after = calibrate.perplexity(new_m, new_params, held)
    removed = chosen.get("removed_kv_groups", chosen.get("removed_layers"))
    say(f"removed {'kv groups per layer' if args.heads is not None else 'layers'} (counting from 0): {removed}")
    say(f"held-out perplexity, pruned ({args.method}): {_change(before, after)}")
    perplexity = {"original": before, "pruned": after}
    if args.method != "random":
        rand_m, rand_params, rand_chosen = _prune(args, m, loaded.params, calib, "random")
        perplexity["random"] = calibrate.perplexity(rand_m, rand_params, held)
        say(f"held-out perplexity, pruned (random, seed {args.seed}): {_change(before, perplexity['random'])} "
            f"removing {rand_chosen.get('removed_kv_groups', rand_chosen.get('removed_layers'))}")
    seq = run_cfg.train.seq_len
    sizes = {"params": [model.param_count(m), model.param_count(new_m)],
             "flops_per_token": [model.flops_per_token(m, seq), model.flops_per_token(new_m, seq)]}
    p0, p1 = sizes["params"]
    f0, f1 = sizes["flops_per_token"]
    say(f"parameters: {p0 / 1e6:.3f}M -> {p1 / 1e6:.3f}M ({p1 / p0 - 1:+.1%}); training FLOPs per token at "
        f"seq_len {seq}: {f0 / 1e6:.2f}M -> {f1 / 1e6:.2f}M ({f1 / f0 - 1:+.1%})")
    cfg = _pruned_config(run_cfg, new_m, f"{PROG} {args.checkpoint}")
    report = {"source": loaded.source, "step": loaded.step, "target": "heads" if args.heads is not None else "layers",
              "heads_fraction": args.heads, "layers": args.layers, "method": args.method, "seed": args.seed,
              "calibration_sequences": sum(b["inputs"].shape[0] for b in calib), "heldout_tokens": tokens,
              "model": {f: [getattr(m, f), getattr(new_m, f)] for f in ("n_layers", "n_heads", "n_kv_heads")},
              **chosen, "perplexity": perplexity, **sizes, "finetune": None, "seconds": 0.0}
    stage = out.parent / f".{out.name}.prune.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        step = loaded.step or 0
        info = {"pruned_from": loaded.source}
        if args.finetune:
            stage.mkdir()
            cfg = _save_run(stage / "pruned", out / "pruned", cfg, new_params, step, info)
            report["finetune"] = _finetune(args, cfg, stage, out)
            tuned = load_model(stage)
            perplexity["finetuned"] = calibrate.perplexity(tuned.cfg, tuned.params, held)
            say(f"held-out perplexity, fine-tuned: {_change(before, perplexity['finetuned'])} "
                f"(pruned {after:.4f}, recovered {(after - perplexity['finetuned']) / max(after - before, 1e-12):.0%} "
                "of the increase)")
        else:
            _save_run(stage, out, cfg, new_params, step, info)
        report["seconds"] = round(time.perf_counter() - start, 1)
        (stage / "prune_report.json").write_text(json.dumps(report, indent=1) + "\n")
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    say(f"wrote {out} in {report['seconds']}s; try: python -m maxlm.generate --checkpoint {out} --prompt 'def '")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_command(PROG, run, args)


if __name__ == "__main__":
    sys.exit(main())
