"""How much does an async checkpoint slow training down while it is being written?

Trains a Llama-style model with the real maxlm train step and saves with the real Checkpointer
every few steps; each step is timed (blocking). Steps that ran while a save was in flight are
compared with the median step time of the same run. Last line:
`ratio step_time during_save/median = X` (the goal is X < 1.2).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

from maxlm import config
from maxlm.parallel import sharding
from maxlm.train import checkpoint, optim, step, tasks


def build(args):
    cfg = config.build(
        num_devices=1,
        model=dict(d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4, d_ff=4 * args.d_model,
                   vocab_size=259, vocab_multiple=8, max_seq_len=args.seq_len, dtype="float32"),
        mesh=dict(data=1), train=dict(global_batch=args.batch, seq_len=args.seq_len, steps=10_000, sample_tokens=0),
        optim=dict(warmup_steps=10), checkpoint=dict(max_to_keep=2))
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--save_every", type=int, default=12)
    args = p.parse_args()

    cfg = build(args)
    mesh = sharding.make_mesh(cfg.mesh.shape(1), jax.devices()[:1])
    opt = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, opt)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 259, (args.batch, args.seq_len + 1)).astype(np.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones_like(tokens[:, 1:]),
                 positions=np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), (args.batch, args.seq_len)).copy(),
                 weights=np.ones((args.batch, args.seq_len), np.float32))
    with tempfile.TemporaryDirectory() as run_dir, jax.set_mesh(mesh):
        ckpt = checkpoint.Checkpointer(run_dir, cfg.checkpoint, log=lambda m: None)
        state = step.init_state(cfg, opt, shardings)
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 2**20
        train_step, _ = tasks.lm_steps(cfg, mesh, opt, shardings)
        device_batch = step.device_batch(batch, mesh, tasks.LM_BATCH)
        for _ in range(3):  # compile and warm up
            state, _ = train_step(state, device_batch)
        jax.block_until_ready(state)

        times, in_flight, save_calls = [], [], []
        for i in range(1, args.steps + 1):
            saving = ckpt._finisher is not None and ckpt._finisher.is_alive()
            t = time.perf_counter()
            state, metrics = train_step(state, device_batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
            in_flight.append(saving)
            if i % args.save_every == 0:
                t = time.perf_counter()
                ckpt.save(i, state, {}, cfg.to_dict(), {})
                save_calls.append(time.perf_counter() - t)
        ckpt.close()

    median = statistics.median(times)
    during = [t for t, s in zip(times, in_flight) if s]
    quiet = [t for t, s in zip(times, in_flight) if not s]
    print(f"model: {n_params / 1e6:.1f}M parameters, train state {state_mb:.0f} MiB, "
          f"batch {args.batch}x{args.seq_len}, {args.steps} timed steps, a save every {args.save_every}")
    print(f"{'':28s}{'steps':>6s}{'median ms':>12s}")
    print(f"{'all steps':28s}{len(times):6d}{median * 1e3:12.1f}")
    print(f"{'no save in flight':28s}{len(quiet):6d}{statistics.median(quiet) * 1e3:12.1f}")
    if not during:
        raise SystemExit("no step overlapped a save: raise --steps or the model size")
    print(f"{'save in flight':28s}{len(during):6d}{statistics.median(during) * 1e3:12.1f}")
    print(f"blocking part of save(): median {statistics.median(save_calls) * 1e3:.1f} ms over {len(save_calls)} saves")
    print(f"ratio step_time during_save/median = {statistics.median(during) / median:.3f}")


if __name__ == "__main__":
    main()
