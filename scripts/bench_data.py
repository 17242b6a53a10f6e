"""Input-pipeline throughput against the training step's consumption, and MinHash dedup speed.

    python scripts/bench_data.py            # ~2-3 minutes on 2 CPU cores
    python scripts/bench_data.py --quick    # fewer batches and documents, for a smoke run

What it measures, all in this run:

  tiny.gin      pipeline: make_train_iterator exactly as tiny.gin configures it (the stdlib corpus,
                byte tokenizer, read + tokenise + pack on the fly, seq 256, batch 8, prefetch thread).
                consumption: the real tiny.gin train step (maxlm.train.tasks.lm_steps on a mesh over
                this machine's devices, state donated, as maxlm.train runs it), on those batches.
  llama3_1b     pipeline: packed rows written by `maxlm.data prepare` (a BPE tokenizer trained here on
                the stdlib; seq 4096, one process's global batch of 256 rows = 1M tokens), memory-
                mapped, shuffled, batched. Also shown, not used in the ratio: the same BPE run on the
                fly over raw documents, to show why `prepare` exists.
                consumption (computed, not measured): one 8xH100 node at 40% MFU,
                tokens/s = 8 * 989.4e12 (H100 SXM dense bf16 peak) * 0.40 / flops_per_token,
                with flops_per_token from maxlm.model.flops (PaLM accounting) for llama3_1b at seq 4096.
  near-dedup    documents/s of MinHash signatures + LSH (datasketch) over a planted corpus, with the
                recall and precision it reaches there.

The last line is ``ratio pipeline/consumption = X``: the smaller of the two configs' ratios (the
goal is X >= 10: the input pipeline is never the bottleneck).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

H100_BF16_PEAK = 989.4e12
ASSUMED_MFU = 0.40
NODE_GPUS = 8


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


def tiny_consumption(batches: int) -> tuple[float, dict]:
    """tokens/s of the real tiny.gin train step on this machine, fed by the real pipeline."""
    import jax

    from maxlm import config
    from maxlm.data import make_train_iterator
    from maxlm.parallel import sharding
    from maxlm.train import optim, step, tasks

    cfg = config.load("tiny.gin", num_devices=jax.device_count())
    tc = cfg.train
    mesh = sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    optimizer = optim.make_optimizer(cfg.optim, tc.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    it = make_train_iterator(cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch)
    data = [next(it) for _ in range(batches + 2)]
    it.close()
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings)
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        for b in data[:2]:  # compile and warm up
            state, metrics = train_step(state, step.device_batch(b, mesh, tasks.LM_BATCH))
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for b in data[2:]:
            state, metrics = train_step(state, step.device_batch(b, mesh, tasks.LM_BATCH))
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
    return batches * tc.global_batch * tc.seq_len / seconds, cfg.data.__dict__ | {"seq_len": tc.seq_len,
                                                                                  "global_batch": tc.global_batch}


def llama_consumption() -> tuple[float, float]:
    from maxlm import config, model

    cfg = config.load("llama3_1b.gin")
    fpt = model.flops_per_token(cfg.model, cfg.train.seq_len)
    return NODE_GPUS * H100_BF16_PEAK * ASSUMED_MFU / fpt, fpt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer batches and documents (a smoke run)")
    p.add_argument("--workdir", help="where the tokenizer and packed shards go (default: a temp dir)")
    args = p.parse_args(argv)
    quick = args.quick
    from maxlm import config
    from maxlm.data import dedup
    from maxlm.data.prepare import prepare
    from maxlm.data.sources import open_source
    from maxlm.data.tokenizer import train_bpe

    tmp = tempfile.TemporaryDirectory()
    work = args.workdir or tmp.name
    os.makedirs(work, exist_ok=True)
    print(f"maxlm data benchmark ({os.cpu_count()} CPU cores{', quick' if quick else ''})", flush=True)

    # ---- tiny.gin ---------------------------------------------------------------------------
    tiny = config.load("tiny.gin")
    tc = tiny.train
    tiny_pipe = pipeline_tokens_per_s(tiny.data, tc.seq_len, tc.global_batch, 100 if quick else 400)
    tiny_step, _ = tiny_consumption(5 if quick else 20)
    tiny_ratio = tiny_pipe / tiny_step
    print(f"tiny.gin     pipeline {tiny_pipe:>14,.0f} tokens/s   train step {tiny_step:>12,.0f} tokens/s "
          f"(measured here)   ratio {tiny_ratio:,.1f}", flush=True)

    # ---- llama3_1b shapes ---------------------------------------------------------------------
    llama = config.load("llama3_1b.gin")
    seq_len, batch = llama.train.seq_len, llama.train.global_batch
    src = open_source("stdlib")
    n_docs = 300 if quick else 1000
    t0 = time.perf_counter()
    texts = (src.read(i).text or "" for i in range(0, len(src), max(1, len(src) // n_docs)))
    tok = train_bpe(texts, 8192, show_progress=False)
    tok_path = os.path.join(work, "tokenizer.json")
    tok.save(tok_path)
    report = prepare("stdlib", os.path.join(work, "packed"), tok_path, seq_len, eval_fraction=0.0,
                     limit=400 if quick else 1200, progress=False, overwrite=True)
    print(f"             (setup: BPE 8192 trained and {report['splits']['train']['tokens']:,} stdlib tokens "
          f"packed at seq {seq_len} in {time.perf_counter() - t0:.0f} s, prepare at "
          f"{report['tokens_per_s']:,.0f} tokens/s)", flush=True)
    packed_cfg = config.DataConfig(source=f"packed:{os.path.join(work, 'packed')}", tokenizer=tok_path)
    llama_pipe = pipeline_tokens_per_s(packed_cfg, seq_len, batch, 5 if quick else 20, warmup=1)
    raw_cfg = config.DataConfig(source="stdlib", tokenizer=tok_path)
    raw_pipe = pipeline_tokens_per_s(raw_cfg, seq_len, 16, 2 if quick else 6, warmup=1)
    llama_step, fpt = llama_consumption()
    llama_ratio = llama_pipe / llama_step
    print(f"llama3_1b    pipeline {llama_pipe:>14,.0f} tokens/s   train step {llama_step:>12,.0f} tokens/s "
          f"(computed: {NODE_GPUS}xH100 at {ASSUMED_MFU:.0%} MFU, {fpt / 1e9:.2f} GFLOP/token)   "
          f"ratio {llama_ratio:,.1f}", flush=True)
    print(f"             raw documents + BPE on the fly (no prepare): {raw_pipe:,.0f} tokens/s "
          f"(ratio {raw_pipe / llama_step:,.2f}; not used below)", flush=True)

    # ---- near-dedup ---------------------------------------------------------------------------
    docs, pairs = dedup.planted_corpus(n_base=200 if quick else 1000, copies_per_target=10 if quick else 30)
    score = dedup.score_planted(docs, pairs)
    print(f"near-dedup   {score['docs_per_s']:>14,.0f} docs/s (MinHash 256 perms + LSH, one core, "
          f"{np.mean([len(d) for d in docs]):,.0f} chars/doc)   planted pairs: recall {score['recall']:.3f} "
          f"({score['found']}/{score['pairs_above']} at J >= 0.8), precision {score['precision']:.3f} "
          f"({score['true_reported']}/{score['reported']})", flush=True)
    ratio = min(tiny_ratio, llama_ratio)
    print(f"ratio pipeline/consumption = {ratio:.1f}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
