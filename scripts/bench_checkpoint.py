"""How much does an async checkpoint slow training down, per step while it is written and in all?

Trains a Llama-style model (by default 31.7M parameters, d_model 512, 8 layers, fp32: a 363 MiB
train state with AdamW's two moments) with the real maxlm train step, and saves with the real
Checkpointer under the default CheckpointConfig (async, sha256 manifest, 3 kept). The run
alternates blocks of --steps steps: one with a save after every --save_every steps (and a wait for
the last save at the end of the block), one without saves, in turn over --repeats repeats, so both
see the same machine load. Each step is timed (blocking).

Printed, all from this run:
  per step   the median step with a save in flight (the save's background work overlapping it)
             against the median step of the blocks without saves;
  amortised  the total time of the blocks with saves (save() calls and the final wait included)
             against the total time of the blocks without;
  save()     the blocking part (the device-to-host copy, Orbax's bookkeeping, old steps deleted)
             and how long each save's background work took to finish (wall).

``--compare`` adds, in the same alternation, blocks saved the way maxlm saved before (arrays zstd
compressed, background threads at normal priority); each block ends by waiting for its last save,
which gives the save's threads normal priority back (where the system allows). Last line:
`ratio step_time during_save/median = X` (the goal is X <= 1.10).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import jax
import numpy as np

from maxlm import config
from maxlm.parallel import sharding
from maxlm.train import checkpoint, optim, step, tasks


def build(args):
    return config.build(
        num_devices=1,
        model=dict(d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4, d_ff=4 * args.d_model,
                   vocab_size=259, vocab_multiple=8, max_seq_len=args.seq_len, dtype="float32"),
        mesh=dict(data=1), train=dict(global_batch=args.batch, seq_len=args.seq_len, steps=10_000, sample_tokens=0),
        optim=dict(warmup_steps=10))  # CheckpointConfig left at its defaults


class Variant:
    """How saves are made: array compression and the niceness of the background threads."""

    def __init__(self, name: str, compress: bool, nice: int):
        self.name, self.compress, self.nice = name, compress, nice
        self.in_flight, self.quiet, self.blocks, self.save_calls, self.background = [], [], [], [], []


def watch(finisher: threading.Thread, start: float, into: list) -> None:
    """Record how long a save's background work (Orbax's write, then hashing) took."""
    finisher.join()
    into.append(time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="steps per block")
    p.add_argument("--save_every", type=int, default=4, help="a save after every this many steps of a block")
    p.add_argument("--repeats", type=int, default=3, help="rounds of alternating blocks")
    p.add_argument("--nice", type=int, help="niceness of the default saves' background threads "
                   "(default: checkpoint.BACKGROUND_NICE)")
    p.add_argument("--compare", action="store_true",
                   help="also time saves as maxlm made them before (zstd, normal priority)")
    args = p.parse_args()
    if not 0 < args.save_every < args.steps:
        p.error("--save_every must be below --steps (a block needs steps after its saves)")

    cfg = build(args)
    mesh = sharding.make_mesh(cfg.mesh.shape(1), jax.devices()[:1])
    opt = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, opt)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 259, (args.batch, args.seq_len + 1)).astype(np.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones_like(tokens[:, 1:]),
                 positions=np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), (args.batch, args.seq_len)).copy(),
                 weights=np.ones((args.batch, args.seq_len), np.float32))
    variants = [Variant("default", checkpoint.COMPRESS_ARRAYS,
                        checkpoint.BACKGROUND_NICE if args.nice is None else args.nice)]
    if args.compare:
        variants.append(Variant("before", True, 0))
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh):
        ckpts = {}
        for v in variants:
            checkpoint.BACKGROUND_NICE = v.nice  # read when a Checkpointer is made
            ckpts[v.name] = checkpoint.Checkpointer(os.path.join(tmp, v.name), cfg.checkpoint,
                                                    log=lambda m: None, compress=v.compress)
        state = step.init_state(cfg, opt, shardings)
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 2**20
        train_step, _ = tasks.lm_steps(cfg, mesh, opt, shardings)
        device_batch = step.device_batch(batch, mesh, tasks.LM_BATCH)
        for _ in range(3):  # compile and warm up
            state, _ = train_step(state, device_batch)
        jax.block_until_ready(state)

        saved = 0
        plain_steps, plain_blocks = [], []

        def block(v: Variant | None):
            nonlocal state, saved
            ckpt = ckpts[v.name] if v else None
            start = time.perf_counter()
            for i in range(1, args.steps + 1):
                saving = v is not None and ckpt._finisher is not None and ckpt._finisher.is_alive()
                t = time.perf_counter()
                state, metrics = train_step(state, device_batch)
                jax.block_until_ready(metrics)
                dt = time.perf_counter() - t
                if v is None:
                    plain_steps.append(dt)
                else:
                    (v.in_flight if saving else v.quiet).append(dt)
                if v and i % args.save_every == 0 and i < args.steps:
                    saved += 1
                    t = time.perf_counter()
                    ckpt.save(saved, state, {}, cfg.to_dict(), {})
                    v.save_calls.append(time.perf_counter() - t)
                    threading.Thread(target=watch, args=(ckpt._finisher, time.perf_counter(), v.background),
                                     daemon=True).start()
            if ckpt:
                ckpt.wait()
            (v.blocks if v else plain_blocks).append(time.perf_counter() - start)

        kinds = [None, *variants]
        for r in range(args.repeats):
            for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotate the order each repeat
                block(k)
        for c in ckpts.values():
            c.close()
    load_end = os.getloadavg()

    base = statistics.median(plain_steps)
    print(f"model: {n_params / 1e6:.1f}M parameters, train state {state_mb:.0f} MiB, batch "
          f"{args.batch}x{args.seq_len}; CheckpointConfig defaults (async_save={cfg.checkpoint.async_save}, "
          f"verify_hashes={cfg.checkpoint.verify_hashes}, max_to_keep={cfg.checkpoint.max_to_keep})")
    print(f"{args.repeats} repeats of alternating {args.steps}-step blocks, a save after every "
          f"{args.save_every} steps in the blocks with saves; load average {load_start[0]:.2f} at start, "
          f"{load_end[0]:.2f} at end ({os.cpu_count()} CPUs)")
    print(f"{'':38s}{'steps':>6s}{'median ms':>11s}")
    print(f"{'blocks without saves':38s}{len(plain_steps):6d}{base * 1e3:11.1f}")
    ratio = None
    for v in variants:
        label = f"{v.name} (compress={v.compress}, nice={v.nice})"
        print(label)
        print(f"{'  no save in flight':38s}{len(v.quiet):6d}{statistics.median(v.quiet) * 1e3:11.1f}")
        if not v.in_flight:
            raise SystemExit("no step overlapped a save: raise the model size or lower --save_every")
        during = statistics.median(v.in_flight)
        print(f"{'  save in flight':38s}{len(v.in_flight):6d}{during * 1e3:11.1f}")
        print(f"  save(): blocking median {statistics.median(v.save_calls) * 1e3:.1f} ms over {len(v.save_calls)} "
              f"saves; background done after median {statistics.median(v.background):.2f} s")
        amortised = sum(v.blocks) / sum(plain_blocks)
        print(f"  amortised: {len(v.blocks)} blocks with saves {sum(v.blocks):.1f} s vs without "
              f"{sum(plain_blocks):.1f} s: overhead {100 * (amortised - 1):+.1f}% "
              f"(a save every {args.save_every} steps of {base:.2f} s)")
        print(f"  per step: step during a save / median step without saves = {during / base:.3f}")
        if ratio is None:
            ratio = during / base
    print(f"ratio step_time during_save/median = {ratio:.3f}")


if __name__ == "__main__":
    main()
