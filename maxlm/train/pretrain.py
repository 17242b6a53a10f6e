"""``python -m maxlm.train --config=tiny.gin``: pre-train a model as configured.

``train`` builds the mesh, the task TrainConfig.task names (pre-training here, post-training tasks
from ``maxlm.posttrain``) and the loop, and runs it; the loop
(``maxlm.train.loop``) and the step (``maxlm.train.step``) are shared with every other task.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any, Callable, Sequence

import jax

from maxlm import config
from maxlm.model import lora
from maxlm.parallel import distributed, sharding
from maxlm.train import allocator, checkpoint, loop, step, tasks
from maxlm.train.resilience import TrainingError

EPILOG = """examples:
  python -m maxlm.train --config=tiny.gin
  python -m maxlm.train --config=tiny.gin --run_dir=runs/lr1e-3 --gin_bindings='OptimConfig.learning_rate=1e-3'
  python -m maxlm.train --config=gpt2_124m.gin --gin_bindings='MeshConfig.fsdp=8' --gin_bindings='MeshConfig.data=1'
  python -m maxlm.train --config=runs/pruned/config.gin --run_dir=runs/ft --gin_bindings="TrainConfig.init_from='runs/pruned'"

A bare config name is looked up in configs/. Rerunning with the same --run_dir resumes from its
latest good checkpoint. TrainConfig.init_from (a run directory or RUN_DIR/checkpoints/STEP) starts
a fresh run from those parameters (step 0, new optimizer state): fine-tuning a pruned model.
SIGTERM or Ctrl-C saves and exits 0; rerun the command to continue.
Watch a run with: tensorboard --logdir RUN_DIR/tensorboard"""


def parse_args(argv: Sequence[str] | None, prog: str = "python -m maxlm.train", description: str | None = None,
               epilog: str = EPILOG, default_config: str = "tiny.gin") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0],
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config,
                   help=f"gin file, or a bare name in configs/ (default: {default_config})")
    p.add_argument("--gin_bindings", action="append", default=[], metavar="BINDING",
                   help="override one field, e.g. 'TrainConfig.steps=100' (repeatable)")
    p.add_argument("--run_dir", help="where checkpoints and records go (overrides TrainConfig.run_dir)")
    p.add_argument("--resume_from", metavar="STEP|PATH",
                   help="restore this step of the run directory, or a checkpoint path "
                        "(RUN_DIR or RUN_DIR/checkpoints/STEP), instead of the latest")
    p.add_argument("--fresh", action="store_true",
                   help="start from scratch even if the run directory holds checkpoints "
                        "(they are moved aside, never deleted)")
    distributed.add_flags(p)
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> config.Config:
    bindings = list(args.gin_bindings)
    if args.run_dir:
        bindings.append(f"TrainConfig.run_dir = {str(args.run_dir)!r}")
    return config.load(args.config, bindings, num_devices=jax.device_count())


def train(cfg: config.Config, resume_from: str | None = None, fresh: bool = False,
          build_task: Callable | None = None) -> dict[str, Any]:
    """Run (or resume) the task TrainConfig.task names; returns a summary of the run. Tasks other
    than pre-training come from ``build_task(cfg, forward)`` (``maxlm.posttrain.build_task``: the
    commands pass it in, since this package sits below posttrain)."""
    mesh = sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    forward = step.model_forward(cfg, mesh)
    if cfg.train.task == "pretraining":
        task = tasks.pretraining(cfg, forward)
    elif build_task is None:
        raise config.ConfigError(f"{cfg.source}: TrainConfig.task = {cfg.train.task!r} needs its task "
                                 "builder (run it with python -m maxlm.train or python -m maxlm.sft)")
    else:
        task = build_task(cfg, forward)
    if cfg.model.lora_rank:  # any task, LoRA: only the adapters train; the base has no optimizer state
        task = dataclasses.replace(task, trainable=lora.trainable)
    return loop.run(cfg, task, mesh, resume_from=resume_from, fresh=fresh)


def _fail(message: str) -> int:
    """Print the one line, then keep library threads that are still winding down (tensorstore
    writes of a failed save) from adding their tracebacks to the terminal."""
    print(message, file=sys.__stderr__, flush=True)
    sys.stderr = open(os.devnull, "w")
    logging.disable(logging.CRITICAL)  # asyncio reports the failed save's tasks when they are collected
    return 1


def main(argv: Sequence[str] | None = None, build_task: Callable | None = None, name: str = "maxlm.train",
         task: str | None = None, **parser: Any) -> int:
    """The command line of ``python -m maxlm.train`` (and, with ``task="sft"``, of
    ``python -m maxlm.sft``, which insists that the config trains that task)."""
    if argv is None:  # the command line, not a call from Python: run on huge-page malloc
        allocator.use_huge_pages()
    args = parse_args(argv, prog=f"python -m {name}", **parser)
    try:
        distributed.initialize(args)  # before anything touches a device
        cfg = load_config(args)
        if task is not None and cfg.train.task != task:
            raise config.ConfigError(f"{cfg.source}: TrainConfig.task = {cfg.train.task!r}, but {name} "
                                     f"runs {task!r} (set TrainConfig.task = {task!r})")
        train(cfg, resume_from=args.resume_from, fresh=args.fresh, build_task=build_task)
    except config.ConfigError as err:
        print(f"{name}: config error: {err}", file=sys.stderr)
        return 2
    except distributed.DistributedError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return 2
    except (checkpoint.CheckpointError, TrainingError) as err:
        return _fail(f"{name}: error: {err}")
    except OSError as err:  # the run directory's disk: full, read-only, vanished, no permission
        where = f" ({err.filename})" if err.filename else ""
        return _fail(f"{name}: error: {err.strerror or err}{where}; the last good checkpoint is intact")
    return 0
