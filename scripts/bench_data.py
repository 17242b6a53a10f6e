"""What the input pipeline costs the training step, measured where it is paid.

    python scripts/bench_data.py            # ~3-4 minutes on 2 CPU cores
    python scripts/bench_data.py --quick    # fewer and shorter blocks, a smaller dedup corpus

The real tiny.gin training step (maxlm.train.tasks.lm_steps: tiny.gin's model and batch, state
donated, on a mesh over this machine's devices) runs in blocks of --steps steps, dispatched as
maxlm.train's loop dispatches them (asynchronously, synchronised at the end of each block). It is
fed two ways, alternately, in the same run:

  loader   the real loader, make_train_iterator with packing (concat-then-split) on, reading a
           two-source weighted mixture: the Python standard library and maxlm's own source files
           (``stdlib; files:<maxlm>/**/*.py``, weights 0.8, 0.2), raw text tokenised on the fly
           (byte tokenizer), tiny.gin's other DataConfig settings (prefetch thread, read threads). No cleaning (the trainer
           never cleans: ``python -m maxlm.data clean`` is a separate step).
  memory   the same number of batches read from that loader beforehand and held in memory.

Each round runs one block of each (the order alternates between rounds), so both feeds see the
same machine load; the loader's cost is the median over rounds of (loader block time / memory
block time) - 1, as a fraction of the step time. Also printed: the time the loop spent blocked in
next(), the loader's throughput on its own, and the rate of MinHash near-dedup.

``--h100`` adds the old secondary figure, clearly computed rather than measured: packed
llama3_1b-shaped rows (a BPE tokenizer trained here, `prepare`d at seq 4096) against the tokens/s
one 8xH100 node would consume at 40% MFU.

Last line: ``ratio loader_step/memory_step = X`` (the goal is X < 1.02).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import numpy as np

H100_BF16_PEAK = 989.4e12
ASSUMED_MFU = 0.40
NODE_GPUS = 8


def mixture_config(data_cfg):
    """tiny.gin's DataConfig with a second, local source mixed in (0.8 stdlib, 0.2 maxlm's code)."""
    import maxlm

    package = os.path.dirname(os.path.abspath(maxlm.__file__))
    return dataclasses.replace(data_cfg, source=f"stdlib; files:{package}/**/*.py", weights="0.8, 0.2")


def pipeline_tokens_per_s(data_cfg, seq_len: int, global_batch: int, batches: int, warmup: int = 2) -> float:
    from maxlm.data import make_train_iterator

    it = make_train_iterator(data_cfg, seq_len=seq_len, global_batch=global_batch)
    try:
        for _ in range(warmup):
            next(it)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batches * global_batch * seq_len / (time.perf_counter() - start)
    finally:
        it.close()


def loader_vs_memory(steps: int, rounds: int) -> dict:
    """Block times of the tiny.gin step fed by the loader and by in-memory batches, alternately."""
    import jax

    from maxlm import config
    from maxlm.data import make_train_iterator
    from maxlm.parallel import sharding
    from maxlm.train import optim, step, tasks

    cfg = config.load("tiny.gin", num_devices=jax.device_count())
    tc = cfg.train
    data_cfg = mixture_config(cfg.data)
    mesh = sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    optimizer = optim.make_optimizer(cfg.optim, tc.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    it = make_train_iterator(data_cfg, seq_len=tc.seq_len, global_batch=tc.global_batch)
    memory = [next(it) for _ in range(steps)]
    out = {"loader": [], "memory": [], "waits": [], "ratios": [], "data_cfg": data_cfg, "devices": jax.device_count(),
           "batch": (tc.global_batch, tc.seq_len)}
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings)
        out["params"] = sum(x.size for x in jax.tree.leaves(state.params))
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        for b in memory[:3]:  # compile and warm up
            state, metrics = train_step(state, step.device_batch(b, mesh, tasks.LM_BATCH))
        jax.block_until_ready(metrics)

        def block(feed: str) -> float:
            nonlocal state
            waited = 0.0
            start = time.perf_counter()
            for i in range(steps):
                if feed == "loader":
                    t = time.perf_counter()
                    b = next(it)
                    waited += time.perf_counter() - t
                else:
                    b = memory[i]
                state, metrics = train_step(state, step.device_batch(b, mesh, tasks.LM_BATCH))
            jax.block_until_ready((state, metrics))
            if feed == "loader":
                out["waits"].append(waited / steps)
            return time.perf_counter() - start

        for r in range(rounds):
            order = ("loader", "memory") if r % 2 == 0 else ("memory", "loader")
            times = {feed: block(feed) for feed in order}
            for feed, t in times.items():
                out[feed].append(t / steps)
            out["ratios"].append(times["loader"] / times["memory"])
    it.close()
    return out


def h100_computed(quick: bool, work: str) -> None:
    """The secondary, computed figure: packed llama3_1b rows against an 8xH100 node's appetite."""
    from maxlm import config, model
    from maxlm.data.prepare import prepare
    from maxlm.data.sources import open_source
    from maxlm.data.tokenizer import train_bpe

    llama = config.load("llama3_1b.gin")
    seq_len, batch = llama.train.seq_len, llama.train.global_batch
    src = open_source("stdlib")
    n_docs = 300 if quick else 1000
    texts = (src.read(i).text or "" for i in range(0, len(src), max(1, len(src) // n_docs)))
    tok = train_bpe(texts, 8192, show_progress=False)
    tok_path = os.path.join(work, "tokenizer.json")
    tok.save(tok_path)
    prepare("stdlib", os.path.join(work, "packed"), tok_path, seq_len, eval_fraction=0.0,
            limit=400 if quick else 1200, progress=False, overwrite=True)
    packed_cfg = config.DataConfig(source=f"packed:{os.path.join(work, 'packed')}", tokenizer=tok_path)
    pipe = pipeline_tokens_per_s(packed_cfg, seq_len, batch, 5 if quick else 20, warmup=1)
    fpt = model.flops_per_token(llama.model, seq_len)
    consume = NODE_GPUS * H100_BF16_PEAK * ASSUMED_MFU / fpt
    print(f"computed, not measured: llama3_1b packed rows {pipe:,.0f} tokens/s against {consume:,.0f} tokens/s "
          f"for {NODE_GPUS}xH100 at {ASSUMED_MFU:.0%} MFU ({fpt / 1e9:.2f} GFLOP/token): "
          f"pipeline/consumption {pipe / consume:,.1f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer and shorter blocks, a smaller dedup corpus")
    p.add_argument("--steps", type=int, help="steps per block (default 16; 8 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds of one loader and one memory block (default 8; 4 with --quick)")
    p.add_argument("--h100", action="store_true", help="also print the computed llama3_1b/8xH100 ratio (slow)")
    p.add_argument("--workdir", help="where --h100's tokenizer and packed shards go (default: a temp dir)")
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps or (8 if quick else 16)
    rounds = args.rounds or (4 if quick else 8)
    if steps < 1 or rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    from maxlm import config
    from maxlm.data import dedup

    load_start = os.getloadavg()
    print(f"maxlm data benchmark ({os.cpu_count()} CPU cores{', quick' if quick else ''}; load average "
          f"{load_start[0]:.2f})", flush=True)

    res = loader_vs_memory(steps, rounds)
    dc = res["data_cfg"]
    rows, seq = res["batch"]
    print(f"tiny.gin step: {res['params'] / 1e6:.1f}M parameters, batch {rows}x{seq}, {res['devices']} device(s); "
          f"{rounds} rounds of a {steps}-step block per feed, alternating")
    print(f"loader: source {dc.source!r} weights {dc.weights!r}, tokenizer {dc.tokenizer}, packing on, "
          f"prefetch {dc.prefetch}, read_threads {dc.read_threads}, worker_count {dc.worker_count}")
    print(f"{'feed':10s}{'median step ms':>16s}{'min':>9s}{'max':>9s}")
    for feed in ("loader", "memory"):
        ts = res[feed]
        print(f"{feed:10s}{statistics.median(ts) * 1e3:16.1f}{min(ts) * 1e3:9.1f}{max(ts) * 1e3:9.1f}")
    ratio = statistics.median(res["ratios"])
    print(f"loader cost: {100 * (ratio - 1):+.2f}% of step time (median over rounds; per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in res['ratios'])})")
    print(f"blocked in next(): median {statistics.median(res['waits']) * 1e3:.2f} ms per step", flush=True)

    tiny = config.load("tiny.gin")
    alone = pipeline_tokens_per_s(mixture_config(tiny.data), tiny.train.seq_len, tiny.train.global_batch,
                                  100 if quick else 300)
    step_tokens = rows * seq / statistics.median(res["memory"])
    print(f"loader alone: {alone:,.0f} tokens/s, {alone / step_tokens:,.0f}x what the step consumes "
          f"({step_tokens:,.0f} tokens/s)", flush=True)

    docs, pairs = dedup.planted_corpus(n_base=200 if quick else 1000, copies_per_target=10 if quick else 30)
    score = dedup.score_planted(docs, pairs)
    print(f"near-dedup: {score['docs_per_s']:,.0f} docs/s (MinHash 256 perms + LSH, one core, "
          f"{np.mean([len(d) for d in docs]):,.0f} chars/doc); planted pairs: recall {score['recall']:.3f} "
          f"({score['found']}/{score['pairs_above']} at J >= 0.8), precision {score['precision']:.3f} "
          f"({score['true_reported']}/{score['reported']})", flush=True)

    if args.h100:
        with tempfile.TemporaryDirectory() as tmp:
            work = args.workdir or tmp
            os.makedirs(work, exist_ok=True)
            h100_computed(quick, work)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(f"ratio loader_step/memory_step = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
