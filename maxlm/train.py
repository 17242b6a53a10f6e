"""``python -m maxlm.train --config=tiny.gin``: build, restore, loop, save.

The loop is read top to bottom in ``train``. Everything inside jit lives in ``maxlm.step``; this
file holds the side effects: data, checkpoints, metrics, progress and the closing sample.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
from tqdm import tqdm

from maxlm import checkpoint, config, data, generate, metrics, optim, sharding, step

EPILOG = """examples:
  python -m maxlm.train --config=tiny.gin
  python -m maxlm.train --config=tiny.gin --run_dir=runs/lr1e-3 --gin_bindings='OptimConfig.learning_rate=1e-3'
  python -m maxlm.train --config=gpt2_124m.gin --gin_bindings='MeshConfig.fsdp=8' --gin_bindings='MeshConfig.data=1'

A bare config name is looked up in configs/. Rerunning with the same --run_dir resumes from its
latest checkpoint. Watch a run with: tensorboard --logdir RUN_DIR/tensorboard"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m maxlm.train", description=__doc__.splitlines()[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny.gin", help="gin file, or a bare name in configs/ (default: tiny.gin)")
    p.add_argument("--gin_bindings", action="append", default=[], metavar="BINDING",
                   help="override one field, e.g. 'TrainConfig.steps=100' (repeatable)")
    p.add_argument("--run_dir", help="where checkpoints and records go (overrides TrainConfig.run_dir)")
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


def train(cfg: config.Config) -> dict[str, Any]:
    """Run (or resume) training as configured; returns a summary of the run."""
    tc = cfg.train
    run_dir = Path(tc.run_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (run_dir / "config.gin").write_text(config.operative_gin(cfg))
    recorder = metrics.RunRecorder(run_dir)

    mesh = sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    optimizer = optim.make_optimizer(cfg.optim, tc.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    ckpt = checkpoint.Checkpointer(run_dir, cfg.checkpoint) if cfg.checkpoint.enabled else None
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    batches = data.make_train_iterator(cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                       process_index=jax.process_index(), process_count=jax.process_count())
    t_start = time.perf_counter()

    with jax.set_mesh(mesh):
        latest = ckpt.latest_step() if ckpt else None
        if latest is not None:
            abstract = jax.eval_shape(lambda: step.init_state(cfg, optimizer, shardings))
            state, data_state = ckpt.restore(latest, abstract, shardings)
            batches.set_state(data_state)
            _say(f"resuming from {ckpt.directory / str(latest)} (step {latest})")
        else:
            params = None
            if tc.init_params:
                abstract_params = jax.eval_shape(lambda: step.init_state(cfg, optimizer, shardings).params)
                params = checkpoint.restore_params(tc.init_params, abstract_params, shardings.params)
                _say(f"initialised parameters from {tc.init_params}")
            state = step.init_state(cfg, optimizer, shardings, params)
        train_step, eval_step = step.compile_steps(cfg, mesh, optimizer, shardings)
        eval_batches = [step.device_batch(b, mesh) for b in data.make_eval_batches(
            cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch, num_batches=tc.eval_batches,
            process_index=jax.process_index(), process_count=jax.process_count())]

        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        flops_per_token = metrics.flops_per_token(cfg.model, tc.seq_len)
        peak = tc.peak_flops or metrics.measure_peak_flops(cfg.model.dtype)
        recorder.record_run({"config": cfg.source, "params": n_params, "devices": jax.device_count(),
                             "mesh": cfg.mesh.shape(jax.device_count()), "peak_flops_per_device": peak,
                             "flops_per_token": flops_per_token})
        first = int(state.step)
        if first >= tc.steps:
            _say(f"{run_dir} is already at step {first} of {tc.steps}: nothing to train "
                 "(raise TrainConfig.steps to continue, or pick a new --run_dir)")
        _say(f"maxlm: {n_params / 1e6:.2f}M parameters, mesh {dict(mesh.shape)}, "
             f"{tc.global_batch}x{tc.seq_len} tokens/step, steps {first}->{tc.steps}, run_dir {run_dir}")

        eval_losses, window, last_loss = [], [], float("nan")

        def run_eval(at_step: int) -> None:
            eval_loss = _evaluate(eval_step, state.params, eval_batches)
            eval_losses.append((at_step, eval_loss))
            recorder.log(at_step, {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0))})
            _say(f"step {at_step}: eval loss {eval_loss:.4f}")

        if first == 0:
            run_eval(0)  # the baseline the run is judged against
        t_window = time.perf_counter()
        progress = tqdm(range(first, tc.steps), initial=first, total=tc.steps, desc="train",
                        disable=jax.process_index() != 0, dynamic_ncols=True)
        for i in progress:
            state, step_metrics = train_step(state, step.device_batch(next(batches), mesh))
            window.append(step_metrics)
            done = i + 1
            if done % tc.log_every == 0 or done == tc.steps:
                fetched = jax.device_get(window)  # waits for the window's steps to finish
                elapsed = time.perf_counter() - t_window
                tokens = sum(float(m["tokens"]) for m in fetched)
                last_loss = float(fetched[-1]["loss"])
                tokens_per_s = len(fetched) * tc.global_batch * tc.seq_len / elapsed
                logged = {"loss": last_loss, "perplexity": math.exp(min(last_loss, 50.0)),
                          "grad_norm": float(fetched[-1]["grad_norm"]), "lr": float(fetched[-1]["lr"]),
                          "tokens_per_s": tokens_per_s, "step_time_s": elapsed / len(fetched),
                          "mfu": tokens_per_s * flops_per_token / (peak * jax.device_count()),
                          "skipped": int(sum(int(m["skipped"]) for m in fetched)),
                          "loss_scale": float(fetched[-1]["loss_scale"]), "target_tokens": tokens}
                recorder.log(done, logged)
                progress.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                     mfu=f"{logged['mfu']:.1%}")
                window, t_window = [], time.perf_counter()
            if done % tc.eval_every == 0 or done == tc.steps:
                run_eval(done)
                t_window = time.perf_counter()  # evaluation time is not training throughput
            if ckpt and (done % cfg.checkpoint.every_steps == 0 or done == tc.steps):
                ckpt.save(done, state, batches.get_state(), cfg.to_dict(), force=True)
        progress.close()
        batches.close()
        if ckpt:
            ckpt.wait()
            ckpt.close()
        skipped = int(state.skipped)
        text = ""
        if tc.sample_tokens:
            prompt = tokenizer.encode("def ", add_eos=False)
            tokens = generate.sample(cfg.model, state.params, prompt, tc.sample_tokens, seed=tc.seed)
            text = "def " + tokenizer.decode(tokens)
            _say("sample:\n" + text)
    plot = recorder.plot()
    recorder.close()
    summary = {"run_dir": str(run_dir), "first_step": first, "last_step": tc.steps, "loss": last_loss,
               "eval_losses": eval_losses, "skipped_steps": skipped, "sample": text,
               "wall_s": time.perf_counter() - t_start, "loss_png": str(plot) if plot else None}
    _say(f"done: {json.dumps({k: v for k, v in summary.items() if k not in ('sample', 'eval_losses')})}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except config.ConfigError as err:
        print(f"maxlm.train: config error: {err}", file=sys.stderr)
        return 2
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
