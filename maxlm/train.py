"""``python -m maxlm.train --config=tiny.gin``: build, restore, loop, save.

The loop is read top to bottom in ``train``. Everything inside jit lives in ``maxlm.step``; this
file holds the side effects: data, checkpoints, preemption, metrics, progress and the closing sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm import tqdm

from maxlm import (checkpoint, config, data, distributed, generate, metrics, optim, pipeline, resilience,
                   sharding, step)

EPILOG = """examples:
  python -m maxlm.train --config=tiny.gin
  python -m maxlm.train --config=tiny.gin --run_dir=runs/lr1e-3 --gin_bindings='OptimConfig.learning_rate=1e-3'
  python -m maxlm.train --config=gpt2_124m.gin --gin_bindings='MeshConfig.fsdp=8' --gin_bindings='MeshConfig.data=1'

A bare config name is looked up in configs/. Rerunning with the same --run_dir resumes from its
latest good checkpoint. SIGTERM or Ctrl-C saves and exits 0; rerun the command to continue.
Watch a run with: tensorboard --logdir RUN_DIR/tensorboard"""

MAX_ROLLBACKS = 5  # a run that keeps diverging after this many rollbacks needs a person


class TrainingError(RuntimeError):
    """A failure the user must act on; the message is one line."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m maxlm.train", description=__doc__.splitlines()[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny.gin", help="gin file, or a bare name in configs/ (default: tiny.gin)")
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


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(msg)


def _evaluate(eval_step, params, batches) -> float:
    total = weight = 0.0
    for batch in batches:
        loss_sum, w = jax.device_get(eval_step(params, batch))
        total, weight = total + float(loss_sum), weight + float(w)
    return total / max(weight, 1.0)


def _test_nan_steps() -> set[int]:
    """Fault injection for tests: MAXLM_TEST_NAN_STEPS=5,9 poisons the batches of those steps."""
    return {int(s) for s in os.environ.get("MAXLM_TEST_NAN_STEPS", "").split(",") if s.strip()}


def _restore_data(batches, data_state: dict, where: str) -> None:
    try:
        batches.set_state(data_state)
    except ValueError as err:  # the pipeline refuses a state saved under another data config
        raise TrainingError(f"cannot resume the data pipeline from {where}: {err}") from None


def _restore(cfg, ckpt, resume_from, abstract, shardings):
    """(step, state, data_state, source) from --resume_from or the latest good checkpoint; None if none."""
    if resume_from is None:
        found = ckpt.restore_latest_good(abstract, shardings) if ckpt else None
        return None if found is None else (*found[:3], ckpt.directory / str(found[0]))
    if resume_from.isdigit():
        source, step_n = ckpt, int(resume_from)
    else:
        path = Path(resume_from).expanduser().resolve()
        if (path / "checkpoints").is_dir():
            source = checkpoint.Checkpointer(path, cfg.checkpoint, log=_say)
            found = source.restore_latest_good(abstract, shardings)
            if found is None:
                raise TrainingError(f"--resume_from={resume_from}: no usable checkpoint in {path / 'checkpoints'}")
            return (*found[:3], path / "checkpoints" / str(found[0]))
        if not (path.name.isdigit() and path.is_dir()):
            raise TrainingError(f"--resume_from={resume_from}: expected STEP, RUN_DIR or RUN_DIR/checkpoints/STEP")
        source, step_n = checkpoint.Checkpointer(path.parent.parent, cfg.checkpoint, log=_say), int(path.name)
    if source is None or step_n not in source.steps():
        raise TrainingError(f"--resume_from={resume_from}: no checkpoint of step {step_n}")
    problem = source.problem(step_n)
    if problem:
        raise TrainingError(f"--resume_from={resume_from}: checkpoint {source.directory / str(step_n)} is {problem}")
    state, data_state, _ = source.restore(step_n, abstract, shardings)
    if ckpt is not None:
        ckpt.supersede_after(step_n if source is ckpt else -1)
    return step_n, state, data_state, source.directory / str(step_n)


def _previous_progress(run_dir: Path) -> int:
    """The last step an earlier process of this run logged (steps past the checkpoint are redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def train(cfg: config.Config, resume_from: str | None = None, fresh: bool = False) -> dict[str, Any]:
    """Run (or resume) training as configured; returns a summary of the run."""
    goodput = resilience.Goodput()
    tc = cfg.train
    run_dir = Path(tc.run_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh and (run_dir / "checkpoints").exists() and jax.process_index() == 0:
        aside = run_dir / f"checkpoints_replaced_{time.strftime('%Y%m%d-%H%M%S')}"
        (run_dir / "checkpoints").rename(aside)
        _say(f"--fresh: moved the existing checkpoints to {aside}")
    previous_progress = _previous_progress(run_dir)
    if jax.process_index() == 0:
        (run_dir / "config.gin").write_text(config.operative_gin(cfg))
    recorder = metrics.RunRecorder(run_dir)

    mesh = sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    optimizer = optim.make_optimizer(cfg.optim, tc.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    ckpt = checkpoint.Checkpointer(run_dir, cfg.checkpoint, log=_say) if cfg.checkpoint.enabled else None
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    batches = data.make_train_iterator(cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                       process_index=jax.process_index(), process_count=jax.process_count())
    tokens_per_step = tc.global_batch * tc.seq_len
    nan_steps = _test_nan_steps()

    with jax.set_mesh(mesh), resilience.Preemption() as preemption:
        abstract = jax.eval_shape(lambda: step.init_state(cfg, optimizer, shardings))
        restored = _restore(cfg, ckpt, resume_from, abstract, shardings)
        if restored is not None:
            first, state, data_state, source = restored
            _restore_data(batches, data_state, str(source))
            _say(f"resuming from {source} (step {first})")
            recorder.event(first, "resume", source=str(source), redo_steps=max(previous_progress - first, 0))
        else:
            params = None
            if tc.init_params:
                params = checkpoint.restore_params(tc.init_params, abstract.params, shardings.params)
                _say(f"initialised parameters from {tc.init_params}")
            state = step.init_state(cfg, optimizer, shardings, params)
            first = 0
        redo_until = max(previous_progress, first) if restored is not None else 0
        train_step, eval_step = step.compile_steps(cfg, mesh, optimizer, shardings)
        eval_batches = [step.device_batch(b, mesh) for b in data.make_eval_batches(
            cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch, num_batches=tc.eval_batches,
            process_index=jax.process_index(), process_count=jax.process_count())]

        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        flops_per_token = metrics.flops_per_token(cfg.model, tc.seq_len)
        peak = tc.peak_flops or metrics.measure_peak_flops(cfg.model.dtype)
        bubble = pipeline.bubble_fraction(mesh.shape["pipeline"], cfg.model.pipeline_microbatches,
                                          cfg.model.pipeline_repeats)
        recorder.record_run({"config": cfg.source, "params": n_params, "devices": jax.device_count(),
                             "mesh": cfg.mesh.shape(jax.device_count()), "peak_flops_per_device": peak,
                             "flops_per_token": flops_per_token, "pipeline_bubble": bubble})
        if first >= tc.steps:
            _say(f"{run_dir} is already at step {first} of {tc.steps}: nothing to train "
                 "(raise TrainConfig.steps to continue, or pick a new --run_dir)")
        _say(f"maxlm: {n_params / 1e6:.2f}M parameters, mesh {dict(mesh.shape)}, "
             f"{tc.global_batch}x{tc.seq_len} tokens/step, steps {first}->{tc.steps}, run_dir {run_dir}"
             + (f", pipeline bubble {bubble:.1%}" if mesh.shape["pipeline"] > 1 else ""))

        eval_losses, window, last_loss, rollbacks, preempted = [], [], float("nan"), 0, None
        steps_run = redone = timed = 0

        def run_eval(at_step: int) -> float:
            """Evaluate; returns the seconds it took (not training throughput)."""
            jax.block_until_ready(state)  # finish pending steps first: their time is training's
            start = time.perf_counter()
            with goodput.timed("eval"):
                eval_loss = _evaluate(eval_step, state.params, eval_batches)
            eval_losses.append((at_step, eval_loss))
            recorder.log(at_step, {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0))})
            _say(f"step {at_step}: eval loss {eval_loss:.4f}")
            return time.perf_counter() - start

        def save(at_step: int) -> float:
            """Start a checkpoint; returns the seconds the loop was blocked."""
            jax.block_until_ready(state)
            start = time.perf_counter()
            with goodput.timed("checkpoint"):
                ckpt.save(at_step, state, batches.get_state(), cfg.to_dict(),
                          {"tokens_seen": at_step * tokens_per_step})
            return time.perf_counter() - start

        if first == 0 and first < tc.steps:
            run_eval(0)  # the baseline the run is judged against
        progress = tqdm(total=tc.steps, initial=first, desc="train", disable=jax.process_index() != 0,
                        dynamic_ncols=True)
        done, t_window = first, time.perf_counter()
        while done < tc.steps:
            with goodput.timed("data"):
                batch = next(batches)
            if done + 1 in nan_steps:  # each injected fault fires once
                nan_steps.discard(done + 1)
                batch = {**batch, "weights": batch["weights"] * np.float32("nan")}
            state, step_metrics = train_step(state, step.device_batch(batch, mesh))
            window.append(step_metrics)
            done += 1
            steps_run += 1
            timed += steps_run > 1  # the first step's time is compilation, not throughput
            redone += done <= redo_until
            progress.update(1)
            if steps_run == 1:
                jax.block_until_ready(state)
                goodput.add("startup", time.perf_counter() - goodput.start - sum(goodput.seconds.values()))
                t_window = time.perf_counter()
            if done % tc.log_every == 0 or done == tc.steps:
                fetched = jax.device_get(window)  # waits for the window's steps to finish
                elapsed = max(time.perf_counter() - t_window, 1e-9)
                last = fetched[-1]
                last_loss = float(last["loss"])
                logged = {"loss": last_loss, "perplexity": math.exp(min(last_loss, 50.0)),
                          "grad_norm": float(last["grad_norm"]), "lr": float(last["lr"]),
                          "skipped": int(sum(int(m["skipped"]) for m in fetched)),
                          "loss_scale": float(last["loss_scale"])}
                if timed:
                    tokens_per_s = timed * tokens_per_step / elapsed
                    logged.update(tokens_per_s=tokens_per_s, step_time_s=elapsed / timed,
                                  mfu=tokens_per_s * flops_per_token / (peak * jax.device_count()))
                    progress.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                         mfu=f"{logged['mfu']:.1%}")
                recorder.log(done, logged)
                for offset, m in enumerate(fetched):
                    if int(m["skipped"]):
                        at = done - len(fetched) + offset + 1
                        reason = "spike" if int(m["spike"]) else "non-finite"
                        recorder.event(at, "skipped_step", reason=reason, step_loss=float(m["loss"]),
                                       step_grad_norm=float(m["grad_norm"]))
                        _say(f"step {at}: skipped the update ({reason} loss {float(m['loss']):.4g}, "
                             f"grad norm {float(m['grad_norm']):.4g})")
                window, timed, t_window = [], 0, time.perf_counter()
                if tc.rollback_after and max(int(m["bad_streak"]) for m in fetched) >= tc.rollback_after:
                    rollbacks += 1
                    if rollbacks > MAX_ROLLBACKS:
                        raise TrainingError(f"step {done}: still {tc.rollback_after}+ bad steps in a row after "
                                            f"{MAX_ROLLBACKS} rollbacks; see {run_dir / 'metrics.jsonl'}")
                    with goodput.timed("checkpoint"):
                        ckpt.wait()
                        found = ckpt.restore_latest_good(abstract, shardings, before=done)
                    if found is None:
                        raise TrainingError(f"step {done}: {tc.rollback_after} bad steps in a row and no "
                                            "checkpoint to roll back to")
                    # The model goes back; the data stream does not (as in PaLM): the batches that
                    # led into the divergence are skipped rather than replayed.
                    back, state, _, _ = found
                    state = state.replace(lr_scale=state.lr_scale * tc.rollback_lr_factor,
                                          bad_streak=state.bad_streak * 0)
                    recorder.event(done, "rollback", to_step=back, lr_scale=float(state.lr_scale))
                    _say(f"step {done}: {tc.rollback_after} bad steps in a row; rolled back to step {back} "
                         f"with the learning rate scaled by {float(state.lr_scale):.3g}; skipping the "
                         f"{done - back} batches since")
                    redo_until, done = max(redo_until, done), back
                    progress.n = back
                    progress.refresh()
                    continue
            if done % tc.eval_every == 0 or done == tc.steps:
                t_window += run_eval(done)  # evaluation time is not training throughput
            if preemption.requested(done):
                preempted = preemption.signal_name or "preemption notice"
            if ckpt and (ckpt.due(done) or done == tc.steps or preempted):
                t_window += save(done)
            if preempted:
                break
        progress.close()
        batches.close()
        if ckpt:
            with goodput.timed("checkpoint"):
                ckpt.close()  # waits for the last save: never exit with a checkpoint in flight
        skipped = int(state.skipped)
        text = ""
        if preempted:
            recorder.event(done, "preempted", signal=preempted)
            where = f"saved step {done} in {ckpt.directory}" if ckpt else "checkpoints are disabled: nothing saved"
            _say(f"stopped by {preempted} after step {done}: {where}; rerun the same command to resume")
        elif tc.sample_tokens:
            prompt = tokenizer.encode("def ", add_eos=False)
            tokens = generate.sample(cfg.model, state.params, prompt, tc.sample_tokens, seed=tc.seed)
            text = "def " + tokenizer.decode(tokens)
            _say("sample:\n" + text)

    account = goodput.summary()
    measured = sum(v for k, v in account.items() if k.endswith("_s") and k != "wall_s")
    productive = max(account["wall_s"] - measured, 0.0)  # what is left is stepping
    per_step = productive / max(steps_run, 1)
    account.update(lost_s=redone * per_step, train_s=productive - redone * per_step, redone_steps=redone)
    account["goodput"] = account["train_s"] / account["wall_s"]
    recorder.log(done, {f"goodput/{k}": v for k, v in account.items()})
    plot = recorder.plot()
    recorder.close()
    summary = {"run_dir": str(run_dir), "first_step": first, "last_step": done, "loss": last_loss,
               "eval_losses": eval_losses, "skipped_steps": skipped, "rollbacks": rollbacks,
               "preempted": preempted, "sample": text, "goodput": account,
               "loss_png": str(plot) if plot else None}
    breakdown = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in account.items() if k.endswith("_s") and k != "wall_s")
    _say(f"done: steps {first}->{done} in {account['wall_s']:.1f}s, goodput {account['goodput']:.1%} ({breakdown})")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        distributed.initialize(args)  # before anything touches a device
        cfg = load_config(args)
        train(cfg, resume_from=args.resume_from, fresh=args.fresh)
    except config.ConfigError as err:
        print(f"maxlm.train: config error: {err}", file=sys.stderr)
        return 2
    except distributed.DistributedError as err:
        print(f"maxlm.train: {err}", file=sys.stderr)
        return 2
    except (checkpoint.CheckpointError, TrainingError) as err:
        print(f"maxlm.train: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
